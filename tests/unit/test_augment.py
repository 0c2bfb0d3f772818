"""What training makes of a sample, step by step: boxes stay on their objects, shapes/dtypes hold, numerics are YOLO's.

Every augmentation is reached the way the dataset reaches it: ``train_sample.plan_sample`` draws the sample from the
generator of (seed, epoch, index), ``render_geometry`` warps it and ``augment.apply_hsv`` is the colour step, here on
in-memory images (``sample`` below) instead of files.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from _cutmix_check import check_cutmix, grid_scene

from detrain.config.keys import Augment
from detrain.data.image_io import load_size
from detrain.data.samples.affine import (
    _warp_general,
    apply_warp,
    box_candidates,
    flip_matrix,
    plan_warp,
    scaling,
    translation,
)
from detrain.data.samples.augment import apply_hsv, letterbox
from detrain.data.samples.instances import Labels
from detrain.data.samples.train_sample import SamplePlan, SampleSource, plan_sample, render_geometry

BACKGROUND = (40, 40, 40)
# Distinct, saturated colours (BGR): one per object, so each object can be found again by its colour.
COLOURS = [
    (0, 0, 255),
    (0, 255, 0),
    (255, 0, 0),
    (0, 255, 255),
    (255, 0, 255),
    (255, 255, 0),
    (0, 128, 255),
    (255, 128, 0),
]
NO_HSV = {"hsv_h": 0.0, "hsv_s": 0.0, "hsv_v": 0.0}
ONE_IMAGE = {**NO_HSV, "mosaic": 0.0, "fliplr": 0.0}  # the random affine alone (translate 0.1, scale 0.5)
SHOWN_AS_IT_IS = {**ONE_IMAGE, "translate": 0.0, "scale": 0.0}  # no geometry at all: a square image maps 1:1


def scene(h: int, w: int, boxes: list[tuple[int, int, int, int]], first_cls: int = 0) -> tuple[np.ndarray, Labels]:
    """A flat image with filled rectangles (objects) of distinct colours and their labels (class = colour)."""
    img = np.full((h, w, 3), BACKGROUND, np.uint8)
    for k, (x1, y1, x2, y2) in enumerate(boxes):
        img[y1:y2, x1:x2] = COLOURS[first_cls + k]
    cls = np.arange(first_cls, first_cls + len(boxes))
    return img, Labels(cls, np.array(boxes, np.float32).reshape(-1, 4))


def sample(
    images: list[np.ndarray],
    labels: list[Labels],
    index: int,
    hyp: dict[str, float],
    imgsz: int,
    seed: int = 0,
    epoch: int = 0,
    out_hw: tuple[int, int] | None = None,
    pool: list[int] | None = None,
) -> tuple[np.ndarray, Labels, SamplePlan]:
    """The training sample of ``index`` (BGR, labels in its pixels, the plan), made as ``DetectionDataset`` makes it
    from images at their load size: the same generator, planner, renderer and colour step; ``hyp``: the augment
    keys that differ from their defaults (the config's ``Augment``)."""
    load_hw = [load_size(im.shape[:2], imgsz) for im in images]
    source = SampleSource([(w, h) for h, w in load_hw], [max(im.shape[:2]) for im in images], can_reduce=False)
    rng = np.random.default_rng([seed, epoch, index])
    plan = plan_sample(index, rng, source, Augment(**hyp), imgsz, True, out_hw, pool)

    def at_load_size(i: int) -> Labels:
        (h, w), (lh, lw) = images[i].shape[:2], load_hw[i]
        return labels[i].scaled(lw / w, lh / h, 0, 0)

    img, lab = render_geometry(plan, lambda i, reduce: images[i], at_load_size)
    return apply_hsv(img, plan.hsv), lab, plan


def object_boxes(img: np.ndarray, cls: int, tol: int = 40) -> list[tuple[np.ndarray, int]]:
    """Bounding box (continuous pixel coordinates) and pixel count of each connected patch of ``cls``'s colour
    (a mosaic may show one image twice)."""
    close = (np.abs(img.astype(np.int16) - np.array(COLOURS[cls], np.int16)) <= tol).all(-1)
    n, _, stats, _ = cv2.connectedComponentsWithStats(close.astype(np.uint8), connectivity=8)
    return [(np.array([x, y, x + w, y + h], np.float32), int(count)) for x, y, w, h, count in stats[1:n]]


def iou(a: np.ndarray, b: np.ndarray) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def assert_boxes_on_objects(
    img: np.ndarray, labels: Labels, min_iou: float = 0.8, classes: set[int] | None = None
) -> None:
    """Each surviving box covers its object: it contains the object's pixels (1.5 px slack for interpolation)
    and its IoU with their bounding box is above 0.85, or ``min_iou`` for a box cut by the border: a rotated
    object cut by the border fills less of its clipped box, hence the lower thresholds for rotation and shear,
    and cut at a corner (two borders) as little as a triangle of it, so there only containment is checked.
    Boxes lie inside the image and classes among ``classes`` (the ones the sources hold)."""
    assert img.dtype == np.uint8 and img.ndim == 3
    h, w = img.shape[:2]
    for c, box in zip(labels.cls, labels.boxes_xyxy):
        patches = [(found, count) for found, count in object_boxes(img, int(c)) if count >= 20]
        assert patches, f"class {c}: box {box} but its object is not in the image"
        found = max((p[0] for p in patches), key=lambda f: iou(box, f))
        assert (found[:2] >= box[:2] - 1.5).all() and (found[2:] <= box[2:] + 1.5).all(), f"class {c}: {box} {found}"
        cut = [box[0] <= 2, box[1] <= 2, box[2] >= w - 2, box[3] >= h - 2]  # left, top, right, bottom
        if (cut[0] or cut[2]) and (cut[1] or cut[3]) and min_iou < 0.85:
            continue  # a rotated object cut at a corner: only a triangle of its box shows (YOLO's box, as there)
        assert iou(box, found) > (min_iou if any(cut) else 0.85), f"class {c}: box {box} vs object at {found}"
    b = labels.boxes_xyxy
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all() and (b[:, 2] <= w).all() and (b[:, 3] <= h).all()
    assert (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()
    if classes is not None:
        assert set(labels.cls.tolist()) <= classes, (labels.cls, classes)


SCENE_BOXES = [(20, 30, 90, 100), (130, 40, 200, 90), (60, 120, 150, 180)]


@pytest.mark.parametrize(
    ("kw", "min_iou"),
    [
        ({}, 0.85),  # the defaults: scale 0.5, translate 0.1 (the fast, axis-aligned path)
        ({"degrees": 30.0, "scale": 0.3}, 0.6),
        ({"shear": 10.0, "translate": 0.05}, 0.7),
        ({"perspective": 0.0008, "scale": 0.2}, 0.6),
    ],
)
def test_random_affine_keeps_boxes_on_objects(kw: dict, min_iou: float) -> None:
    img, labels = scene(200, 240, SCENE_BOXES)
    kept = 0
    for seed in range(8):
        out, lab, plan = sample([img], [labels], 0, {**ONE_IMAGE, **kw}, 240, seed)
        assert out.shape == (240, 240, 3) and not plan.mosaic and len(plan.layers) == 1
        assert_boxes_on_objects(out, lab, min_iou, {0, 1, 2})
        kept += len(lab)
    assert kept >= 8


def test_rect_training_sets_the_size_and_turns_mosaic_mixup_and_cutmix_off() -> None:
    img, _ = scene(100, 160, [])
    hyp = {"mosaic": 1.0, "mixup": 1.0, "cutmix": 1.0}
    out, lab, plan = sample([img, img], [Labels.empty()] * 2, 0, hyp, 160, out_hw=(64, 96), pool=[0, 1])
    assert out.shape == (64, 96, 3) and out.dtype == np.uint8 and len(lab) == 0
    assert not plan.mosaic and len(plan.layers) == 1 and plan.cutmix is None and plan.mix_ratio == 1.0


@pytest.mark.parametrize(("lr", "ud"), [(True, False), (False, True), (True, True)])
def test_flips_move_boxes_with_the_pixels(lr: bool, ud: bool) -> None:
    img, labels = scene(240, 240, SCENE_BOXES)
    hyp = {**SHOWN_AS_IT_IS, "fliplr": float(lr), "flipud": float(ud)}
    out, lab, _ = sample([img], [labels], 0, hyp, 240)
    assert np.array_equal(out, img[:: -1 if ud else 1, :: -1 if lr else 1])  # exactly the mirrored pixels
    b = labels.boxes_xyxy
    expected = np.stack(
        (
            240 - b[:, 2] if lr else b[:, 0],
            240 - b[:, 3] if ud else b[:, 1],
            240 - b[:, 0] if lr else b[:, 2],
            240 - b[:, 1] if ud else b[:, 3],
        ),
        1,
    )
    assert np.allclose(lab.boxes_xyxy, expected) and lab.cls.tolist() == [0, 1, 2]
    assert_boxes_on_objects(out, lab, 0.99)


def test_flip_probabilities() -> None:
    img, labels = scene(64, 64, [(5, 5, 20, 30)])
    out, lab, _ = sample([img], [labels], 0, {**SHOWN_AS_IT_IS, "fliplr": 0.0}, 64)
    assert np.array_equal(out, img) and lab.boxes_xyxy.tolist() == [[5, 5, 20, 30]]
    out, lab, _ = sample([img], [labels], 0, {**SHOWN_AS_IT_IS, "fliplr": 1.0}, 64)
    assert np.array_equal(out, img[:, ::-1]) and lab.boxes_xyxy.tolist() == [[44, 5, 59, 30]]
    flipped = [
        sample([img], [labels], 0, {**SHOWN_AS_IT_IS, "fliplr": 0.5}, 64, seed)[1].boxes_xyxy[0, 0] == 44
        for seed in range(40)
    ]
    assert 10 <= sum(flipped) <= 30  # about half: drawn per sample, not once for all


@pytest.mark.parametrize("kw", [{}, {"degrees": 20.0, "shear": 5.0}])
def test_mosaic_keeps_boxes_on_objects(kw: dict) -> None:
    # Four 128-px images with two objects each, eight colours in all; partners come from the pool of the four.
    tiles = [scene(96 + 16 * (k % 2), 128, [(10, 10, 60, 50), (70, 40, 120, 90)], first_cls=2 * k) for k in range(4)]
    images, labels = [t[0] for t in tiles], [t[1] for t in tiles]
    kept = 0
    for seed in range(6):
        out, lab, plan = sample(images, labels, seed % 4, {**NO_HSV, **kw}, 128, seed, pool=[0, 1, 2, 3])
        assert out.shape == (128, 128, 3) and plan.mosaic and len(plan.layers[0].tiles) == 4
        shown = {c for t in plan.layers[0].tiles for c in (2 * t.index, 2 * t.index + 1)}
        assert_boxes_on_objects(out, lab, 0.6 if kw else 0.85, shown)
        kept += len(lab)
    assert kept >= 12


def test_mixup_blends_images_and_keeps_both_label_sets() -> None:
    a = np.zeros((128, 128, 3), np.uint8)
    b = np.zeros((128, 128, 3), np.uint8)
    a[10:50, 10:60, 2] = 200  # red object in the first image
    b[40:90, 70:110, 1] = 200  # green object in the second
    la, lb = Labels([0], [[10, 10, 60, 50]]), Labels([1], [[70, 40, 110, 90]])
    for seed in range(4):
        out, lab, plan = sample([a, b], [la, lb], 0, {**SHOWN_AS_IT_IS, "mixup": 1.0}, 128, seed, pool=[0, 1])
        assert out.shape == a.shape and out.dtype == np.uint8 and len(plan.layers) == 2
        assert lab.cls.tolist() == [0, 1] and lab.boxes_xyxy.tolist() == [[10, 10, 60, 50], [70, 40, 110, 90]]
        for channel, box in ((2, lab.boxes_xyxy[0]), (1, lab.boxes_xyxy[1])):
            ys, xs = np.nonzero(out[..., channel] > 20)
            assert iou(box, np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])) > 0.95
        r = plan.mix_ratio
        assert 0.3 < r < 0.7  # Beta(32, 32) stays near an even blend
        assert abs(int(out[20, 20, 2]) - 200 * r) <= 1 and abs(int(out[60, 80, 1]) - 200 * (1 - r)) <= 1


def test_cutmix_pastes_a_free_rectangle_of_the_partner_with_its_boxes() -> None:
    base, base_labels = scene(128, 128, [(4, 4, 24, 20)])  # one object in a corner: most rectangles are free
    partner, partner_labels = grid_scene(128, 128, 14, 10, 1, COLOURS[1])
    untouched = base.copy()
    seen = {"pasted": 0, "clipped": 0, "dropped": 0}
    for seed in range(40):
        out, labels, plan = sample(
            [base, partner], [base_labels, partner_labels], 0, {**SHOWN_AS_IT_IS, "cutmix": 1.0}, 128, seed, pool=[0, 1]
        )
        assert out.shape == base.shape and out.dtype == np.uint8 and plan.cutmix is not None
        for k, v in check_cutmix(out, labels, base, base_labels, partner, partner_labels, 1).items():
            seen[k] += v
    assert seen["pasted"] >= 20 and seen["clipped"] >= 10 and seen["dropped"] >= 3, seen
    assert np.array_equal(base, untouched)  # the source image is left as it was


def test_cutmix_without_a_free_rectangle_changes_nothing() -> None:
    base, base_labels = scene(64, 64, [(0, 0, 64, 64)])  # one object fills the image: no rectangle is free
    partner, partner_labels = grid_scene(64, 64, 14, 10, 1, COLOURS[1])
    for seed in range(10):
        out, labels, _ = sample(
            [base, partner], [base_labels, partner_labels], 0, {**SHOWN_AS_IT_IS, "cutmix": 1.0}, 64, seed, pool=[0, 1]
        )
        assert (out == base).all() and labels.cls.tolist() == [0]


def test_same_seed_epoch_and_index_give_the_same_sample() -> None:
    images, labels = zip(*(scene(96, 128, [(10, 10, 60, 50)], first_cls=k) for k in range(4)))
    hyp = {"degrees": 10.0, "mixup": 0.5, "cutmix": 0.5, "flipud": 0.5}

    def make(index: int, seed: int = 3, epoch: int = 0) -> tuple[np.ndarray, Labels, SamplePlan]:
        return sample(list(images), list(labels), index, hyp, 128, seed, epoch, pool=[0, 1, 2, 3])

    first, again = make(2), make(2)
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1].boxes_xyxy, again[1].boxes_xyxy)
    assert np.array_equal(first[1].cls, again[1].cls)
    for other in (make(1), make(2, seed=4), make(2, epoch=1)):
        assert not np.array_equal(first[0], other[0])


def test_hsv_is_the_last_step_and_moves_no_box() -> None:
    img, labels = scene(128, 128, SCENE_BOXES[:1])
    plain, plain_labels, _ = sample([img], [labels], 0, SHOWN_AS_IT_IS, 128, seed=1)
    for seed in range(1, 6):
        hyp = {**SHOWN_AS_IT_IS, "hsv_h": 0.015, "hsv_s": 0.7, "hsv_v": 0.4}
        out, lab, plan = sample([img], [labels], 0, hyp, 128, seed)
        assert (np.abs(plan.hsv) <= [0.015, 0.7, 0.4]).all() and np.any(plan.hsv)
        assert out.shape == img.shape and out.dtype == np.uint8 and not np.array_equal(out, plain)
        assert np.array_equal(out, apply_hsv(plain, plan.hsv))  # the same geometry, then the colour step
        assert np.array_equal(lab.boxes_xyxy, plain_labels.boxes_xyxy) and lab.cls.tolist() == [0]


def test_apply_hsv_numerics() -> None:
    rng = np.random.default_rng(0)
    img = rng.integers(30, 220, (64, 80, 3), dtype=np.uint8)
    assert np.array_equal(apply_hsv(img, np.zeros(3)), img)
    assert np.array_equal(apply_hsv(img, np.zeros(3), to_rgb=True), img[..., ::-1])

    gains = np.array([0.015, 0.5, -0.3])
    hsv0 = cv2.cvtColor(img, cv2.COLOR_BGR2HSV).astype(np.int32)
    hsv1 = cv2.cvtColor(apply_hsv(img, gains), cv2.COLOR_BGR2HSV).astype(np.int32)
    dh = (hsv1[..., 0] - hsv0[..., 0] + 90) % 180 - 90
    # Hue moves by at most the gain's share of the circle (plus the 8-bit round trip's error).
    assert np.percentile(np.abs(dh), 95) <= 0.015 * 180 + 2
    v_ratio = hsv1[..., 2].mean() / hsv0[..., 2].mean()
    s_ratio = hsv1[..., 1].mean() / hsv0[..., 1].mean()
    assert 0.65 < v_ratio < 0.75 and 1.3 < s_ratio < 1.55
    assert np.array_equal(apply_hsv(img, gains, to_rgb=True), apply_hsv(img, gains)[..., ::-1])


def test_letterbox_numerics_and_boxes() -> None:
    img, labels = scene(150, 200, [(20, 30, 90, 100), (120, 40, 190, 90)])
    out, (r, r2), (left, top) = letterbox(img, (256, 320))
    # r = min(256/150, 320/200) = 1.6; new size 320 x 240; dh = 16 -> top round(7.9) = 8, bottom round(8.1) = 8
    assert (r, r2, left, top) == (1.6, 1.6, 0, 8) and out.shape == (256, 320, 3)
    assert (out[:8] == 114).all() and (out[-8:] == 114).all()
    assert_boxes_on_objects(out, labels.scaled(r, r, left, top), 0.95)

    out, (r, _), (left, top) = letterbox(img, (256, 320), scaleup=False)  # only shrink: centred at scale 1
    assert r == 1.0 and (left, top) == (60, 53) and out.shape == (256, 320, 3)
    assert np.array_equal(out[53:203, 60:260], img)

    out, _, (left, top) = letterbox(np.zeros((101, 99, 3), np.uint8), (96, 96), auto=True, stride=32)
    # r = 96/101; new 94 x 96; auto pads only to a multiple of 32: dw = 2 -> left round(0.9) = 1
    assert out.shape == (96, 96, 3) and (left, top) == (1, 0)


def test_box_candidates_rule() -> None:
    before = np.array([[0, 0, 100, 100]] * 5, np.float32)
    after = np.array(
        [
            [0, 0, 50, 50],  # 25 % of the area: kept
            [0, 0, 100, 2],  # only 2 px tall: a sliver
            [0, 0, 30, 30],  # 9 % of the area: lost most of it
            [0, 0, 3, 350],  # aspect > 100 would need a longer one; this is kept (area 10.5 %, ar 117 > 100: dropped)
            [0, 0, 60, 60],
        ],
        np.float32,
    )
    assert box_candidates(before, after).tolist() == [True, False, False, False, True]
    # The random zoom does not count as a loss: at scale 0.5 a box at 30 % of its size keeps 36 % of the area.
    assert box_candidates(before[:1], np.array([[0, 0, 30, 30]], np.float32), scale=0.5).tolist() == [True]


def test_fast_axis_aligned_path_matches_general_warp() -> None:
    rng = np.random.default_rng(0)
    src = cv2.GaussianBlur(rng.integers(0, 255, (90, 120, 3), dtype=np.uint8), (9, 9), 3)
    for m in (translation(7.3, -4.6) @ scaling(0.83, 0.83), flip_matrix(128, 96, True, True) @ scaling(1.21, 1.21)):
        fast = np.full((96, 128, 3), 114, np.uint8)
        general = fast.copy()
        plan = plan_warp(src.shape[:2], fast.shape[:2], m, None)
        assert plan is not None and plan.dst is not None  # the fast path
        apply_warp(fast, src, plan)
        applied = plan.matrix
        _warp_general(general, src, applied)
        # Same pixels (up to rounding) once the general warp uses the matrix the fast path reports.
        inner = (slice(8, -8), slice(8, -8))
        assert np.abs(fast[inner].astype(int) - general[inner].astype(int)).max() <= 3
        assert np.abs(applied - m).max() < 0.6
