"""Ultralytics' predict, val and export spellings detrain now takes (issue 38 item 3): imgsz=[h, w], vid_stride,
save_crop, show, show_labels, show_conf, show_boxes, half at val and export, Results.speed and Results.to_df.

The geometry runs on ``SquareFinder`` (tests/integration/test_predict.py: a stand-in detector that finds pure
coloured squares, so every box is known); val and export on ``../shared/weights/yolov8n.pt`` and coco8, skipped
when absent."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import cv2
import numpy as np
import pytest
from test_predict import SquareFinder, cfg, picture, read_video, save, write_video

from detrain import Model
from detrain.cli import main as cli_main
from detrain.engine.predict.predictor import stream_predict
from detrain.engine.predict.results import CROP_GAIN, CROP_PAD, Results

SHARED = Path(__file__).resolve().parents[3] / "shared"
YOLOV8N = SHARED / "weights" / "yolov8n.pt"
COCO8_YAML = SHARED / "data" / "coco8.yaml"
needs_coco8 = pytest.mark.skipif(
    not (YOLOV8N.is_file() and COCO8_YAML.is_file()), reason="needs ../shared/weights/yolov8n.pt and coco8"
)


def run(tmp_path: Path, source: Path, **keys) -> tuple[list[Results], SquareFinder]:
    model = SquareFinder()
    return list(stream_predict(cfg(tmp_path, **keys), model, str(source), prepared=True)), model


# --- imgsz=[h, w] ------------------------------------------------------------------------------------------------


def test_a_rectangle_imgsz_fits_each_picture_in_it(tmp_path: Path) -> None:
    path = save(tmp_path / "x.png", picture({0: (20, 30, 70, 90)}, hw=(120, 160)))
    (r,), model = run(tmp_path, path, imgsz="64,160")  # the height binds: 120 x 160 -> 64 x 85, padded to 96 wide
    assert model.calls == [(1, 3, 64, 96)]
    np.testing.assert_allclose(r.boxes.xyxy, [[20, 30, 70, 90]], atol=2.5)  # back in the picture's pixels
    (_,), model = run(tmp_path, path, imgsz=160)  # one size: the long side, as before
    assert model.calls == [(1, 3, 128, 160)]


def test_a_rectangle_that_is_no_multiple_of_the_stride_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    save(tmp_path / "x.png", picture({}))
    with pytest.raises(SystemExit) as e:
        cli_main(["predict", "model=n.yaml", "source=x.png", "imgsz=480,650"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "error: invalid value for 'imgsz': '480,650'; expected one size, or [h, w] with h and w multiples of 32"
    ), err


def test_train_takes_the_long_side_of_a_rectangle_and_says_so(capsys: pytest.CaptureFixture) -> None:
    from detrain.config.cfg import make_cfg

    assert make_cfg({"imgsz": [320, 480]}, "train").inputs.imgsz == 480
    assert "training takes one size, the long side: imgsz=480" in capsys.readouterr().out
    kept = make_cfg({"imgsz": [320, 480]}, "val").inputs.imgsz
    assert kept.hw == (320, 480) and make_cfg({"imgsz": [320, 480]}, "val").to_dict()["imgsz"] == [320, 480]


# --- vid_stride, save_crop, the drawing keys, show --------------------------------------------------------------


def test_vid_stride_predicts_every_nth_frame_and_the_video_keeps_its_pace(tmp_path: Path) -> None:
    frames = [picture({0: (10 + 8 * i, 20, 50 + 8 * i, 60)}) for i in range(7)]
    video = write_video(tmp_path / "clip.avi", frames, fps=12.0)
    results, model = run(tmp_path, video, vid_stride=3, save=True)
    assert [r.frame for r in results] == [0, 3, 6] and sum(c[0] for c in model.calls) == 3
    for r in results:  # each the frame of its number, not the next one read
        x1 = 10 + 8 * r.frame
        np.testing.assert_allclose(r.boxes.xyxy, [[x1, 20, x1 + 40, 60]], atol=2.5)
    out = tmp_path / "runs" / "exp" / "clip.avi"
    assert len(read_video(out)) == 3
    cap = cv2.VideoCapture(str(out))
    assert cap.get(cv2.CAP_PROP_FPS) == pytest.approx(4.0, abs=0.01)  # 12 fps / 3
    cap.release()


def test_save_crop_writes_each_detection_under_its_class(tmp_path: Path) -> None:
    path = save(tmp_path / "sub" / "x.png", picture({0: (10, 20, 50, 60), 1: (90, 30, 130, 100)}))
    (r,), _ = run(tmp_path, path, save_crop=True)
    crops = tmp_path / "runs" / "exp" / "crops"
    assert sorted(str(p.relative_to(crops)) for p in crops.rglob("*.jpg")) == ["green/x.jpg", "red/x.jpg"]
    red = cv2.imread(str(crops / "red" / "x.jpg"))
    side = int(40 * CROP_GAIN + CROP_PAD)  # the 40-pixel box grown as Ultralytics grows it
    assert abs(red.shape[0] - side) <= 1 and abs(red.shape[1] - side) <= 1
    assert r.save_crop(crops, "x.jpg")[0].name == "x2.jpg"  # a name taken: <stem>2.jpg, as Ultralytics
    assert not (tmp_path / "runs" / "exp" / "x.png").exists()  # save=False: crops alone


def test_show_boxes_labels_and_conf_change_the_drawing(tmp_path: Path) -> None:
    path = save(tmp_path / "x.png", picture({0: (40, 40, 100, 100)}))
    (r,), _ = run(tmp_path, path)
    full, no_conf, no_labels = r.plot(), r.plot(conf=False), r.plot(labels=False)
    assert np.array_equal(r.plot(boxes=False), r.orig_img)  # show_boxes=false: the picture as it is
    above = (slice(25, 37), slice(40, 100))  # where the label sits, above the box
    assert not np.array_equal(full[above], no_conf[above]) and not np.array_equal(no_conf[above], no_labels[above])
    assert np.array_equal(no_labels[above], r.orig_img[above])  # boxes alone: nothing above
    for keys, want in (
        ({"show_boxes": False}, r.orig_img),
        ({"show_labels": False}, no_labels),
        ({"show_conf": False}, no_conf),
    ):
        run(tmp_path, path, save=True, exist_ok=True, name="drawn", **keys)
        drawn = cv2.imread(str(tmp_path / "runs" / "drawn" / "x.png"))
        assert np.array_equal(drawn, want), keys


def test_show_without_a_display_saves_the_drawings_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    path = save(tmp_path / "x.png", picture({0: (40, 40, 100, 100)}))
    run(tmp_path, path, show=True)  # save=False, as Model.predict's default
    out = capsys.readouterr().out
    where = tmp_path / "runs" / "exp"
    assert out.count("show=True: no display here") == 1 and f"saved in {where}" in out
    assert (where / "x.png").is_file()


def test_results_speed_and_to_df(tmp_path: Path) -> None:
    path = save(tmp_path / "x.png", picture({0: (40, 40, 100, 100)}))
    (r,), _ = run(tmp_path, path)
    assert set(r.speed) == {"preprocess", "inference", "postprocess"}
    assert all(isinstance(v, float) and v >= 0 for v in r.speed.values())
    if not (importlib.util.find_spec("polars") or importlib.util.find_spec("pandas")):
        pytest.skip("neither polars nor pandas is installed")
    df = r.to_df()
    assert len(df) == 1 and list(df.columns) == ["name", "class", "confidence", "box"]


# --- val and export on yolov8n ------------------------------------------------------------------------------------


@needs_coco8
def test_val_at_a_rectangle_and_half_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from detrain.config.cfg import make_cfg
    from detrain.data.prepare import build_val_loader, load_split
    from detrain.distributed.world import World

    keys = {"data": str(COCO8_YAML), "imgsz": "256,320", "batch": 2, "workers": 0}
    c = make_cfg({"model": str(YOLOV8N), **keys}, "val")
    loader = build_val_loader(load_split(c.inputs.data, "val", c), c, 2, World())
    assert {tuple(b["img"].shape[2:]) for b in loader} == {(256, 320)}  # every image letterboxed into h x w
    metrics = Model(str(YOLOV8N)).val(**keys, half=True, device="cpu", project=str(tmp_path), plots=False)
    assert math.isfinite(metrics.box.map) and metrics.box.map > 0
    assert "half=True runs on CUDA only; validating in float32 on cpu" in capsys.readouterr().out


@needs_coco8
def test_export_at_a_rectangle_is_served_at_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("onnxruntime")
    weights = tmp_path / "yolov8n.pt"
    weights.write_bytes(YOLOV8N.read_bytes())
    onnx = Model(str(weights)).export(format="onnx", imgsz=[256, 320], dynamic=False, half=True)  # float16 graph
    assert "half" not in capsys.readouterr().out
    Model(str(weights)).export(format="torchscript", imgsz=64, half=True)
    assert "half=True: a TorchScript export is traced on the CPU in float32" in capsys.readouterr().out
    served = Model(str(onnx))
    assert tuple(served.net.info.imgsz) == (256, 320) and not served.net.info.free_size
    metrics = served.val(data=str(COCO8_YAML), batch=2, workers=0, device="cpu", project=str(tmp_path), plots=False)
    assert math.isfinite(metrics.box.map) and metrics.box.map > 0  # refused before: val letterboxed to squares


# --- augment=True on yolov8n --------------------------------------------------------------------------------------


@needs_coco8
def test_augment_changes_the_predictions_and_val_scores_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    images = SHARED / "data" / "coco8" / "images" / "val"
    model = Model(str(YOLOV8N))
    plain = model.predict(str(images), imgsz=320, device="cpu")
    augmented = model.predict(str(images), imgsz=320, device="cpu", augment=True)
    assert [r.path for r in plain] == [r.path for r in augmented]
    assert any(
        len(a) != len(p) or not np.allclose(a.boxes.xyxy, p.boxes.xyxy, atol=0.5) for a, p in zip(augmented, plain)
    )
    for a, p in zip(augmented, plain):  # the same objects, found again: each confident plain box has a match
        for box in p.boxes.xyxy[p.conf > 0.6]:
            assert len(a) and np.abs(a.boxes.xyxy - box).max(1).min() < 30
    metrics = model.val(
        data=str(COCO8_YAML), imgsz=320, batch=4, workers=0, device="cpu", augment=True, project=str(tmp_path)
    )
    assert math.isfinite(metrics.box.map) and metrics.box.map > 0
    assert "augment=True" not in capsys.readouterr().out  # no note: it ran augmented
