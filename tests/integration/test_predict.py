"""``detrain predict`` / ``Model.predict`` end to end on pictures made here: the returned Results, the drawings,
the label files, videos, streams, batching, and what bad input gets.

Most tests use ``SquareFinder``, a stand-in detector whose answers are known: it finds squares of pure red,
green and blue (classes 0, 1, 2) and returns their exact bounding boxes in the head's output format, so every
step around the model (letterbox, batching, NMS, scaling back, drawing, writing) is checked against geometry.
The real network runs in the batching test (``../shared/weights/yolov8n.pt``, skipped when absent) and the CLI test.
"""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import ClassVar

import cv2
import numpy as np
import pytest
import torch
from torch import nn

from detrain import Model
from detrain.cli import main as cli_main
from detrain.config.cfg import make_cfg
from detrain.engine.predict.predictor import predict, stream_predict
from detrain.engine.predict.results import Results
from detrain.errors import ConfigError, DatasetError

SHARED = Path(__file__).resolve().parents[3] / "shared"
YOLOV8N = SHARED / "weights" / "yolov8n.pt"
COCO8_VAL = SHARED / "data" / "coco8" / "images" / "val"
BGR = {0: (0, 0, 255), 1: (0, 255, 0), 2: (255, 0, 0)}  # class -> the colour of its squares
GREY = 128


class SquareFinder(nn.Module):
    """Class k = the pixels of pure colour k (RGB input); its box = their bounding box, score 0.9 - 0.1 k (times
    ``gain``). Output as a YOLO head's in eval mode: (B, 4 + 3, 3 anchors) of xywh and class scores."""

    names: ClassVar[dict[int, str]] = {0: "red", 1: "green", 2: "blue"}

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.register_buffer("stride", torch.tensor([8.0, 16.0, 32.0]))
        self.calls: list[tuple[int, ...]] = []  # input shapes, to see the batches
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        self.dtypes.append(x.dtype)
        out = x.new_zeros(x.shape[0], 7, 3)
        for k in range(3):
            others = [c for c in range(3) if c != k]
            mask = (x[:, k] > 0.7) & (x[:, others] < 0.3).all(1)
            for i in range(x.shape[0]):
                ys, xs = torch.nonzero(mask[i], as_tuple=True)
                if len(xs):
                    x1, x2, y1, y2 = float(xs.min()), float(xs.max()) + 1, float(ys.min()), float(ys.max()) + 1
                    out[i, :4, k] = torch.tensor([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1])
                    out[i, 4 + k, k] = (0.9 - 0.1 * k) * self.gain
        return out


def picture(squares: dict[int, tuple[int, int, int, int]], hw: tuple[int, int] = (120, 160)) -> np.ndarray:
    """A grey BGR picture with a filled square of class k's colour at each (x1, y1, x2, y2), x2/y2 exclusive."""
    img = np.full((*hw, 3), GREY, np.uint8)
    for k, (x1, y1, x2, y2) in squares.items():
        img[y1:y2, x1:x2] = BGR[k]
    return img


def save(path: Path, img: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), img)
    return path


def write_video(path: Path, frames: list[np.ndarray], fps: float = 10.0) -> Path:
    h, w = frames[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (w, h))
    assert writer.isOpened()
    for frame in frames:
        writer.write(frame)
    writer.release()
    return path


def read_video(path: Path) -> list[np.ndarray]:
    cap = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = cap.read()
        if not ok:
            break
        frames.append(frame)
    cap.release()
    return frames


def moving_square_frames(n: int = 7) -> list[tuple[np.ndarray, tuple[int, int, int, int]]]:
    return [(picture({0: box}), box) for box in ((10 + 8 * i, 20, 50 + 8 * i, 60) for i in range(n))]


def cfg(tmp_path: Path, **kw):
    return make_cfg(
        {"imgsz": 160, "device": "cpu", "verbose": False, "project": str(tmp_path / "runs"), "save": False, **kw}
    )


def model_with(net: nn.Module) -> Model:
    """A Model whose network is ``net``."""
    model = Model("n.yaml")
    model.net = net
    return model


def outline(box: tuple[float, float, float, float], step: int = 3) -> list[tuple[int, int]]:
    """(x, y) pixels on the four sides of a box as it is drawn (corners at int(x1), int(y1), int(x2), int(y2))."""
    x1, y1, x2, y2 = (int(v) for v in box)
    xs, ys = range(x1 + 2, x2 - 1, step), range(y1 + 2, y2 - 1, step)
    return [(x1, y) for y in ys] + [(x2, y) for y in ys] + [(x, y1) for x in xs] + [(x, y2) for x in xs]


def no_temporary_files(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.startswith(".")]


# --- what predict returns ---------------------------------------------------------------------------------------


def test_results_hold_boxes_in_the_pictures_pixels(tmp_path: Path) -> None:
    path = save(tmp_path / "two.png", picture({0: (20, 30, 70, 90), 2: (100, 10, 140, 50)}))
    (r,) = predict(cfg(tmp_path), SquareFinder(), str(path))
    assert isinstance(r, Results) and (r.path, r.frame, r.orig_shape) == (str(path), None, (120, 160))
    assert r.boxes.xyxy.dtype == np.float32 and r.conf.dtype == np.float32 and r.cls.dtype == np.int64
    assert r.boxes.xyxy.shape == (2, 4) and r.conf.shape == (2,) and r.cls.shape == (2,) and len(r) == 2
    np.testing.assert_allclose(r.boxes.xyxy, [[20, 30, 70, 90], [100, 10, 140, 50]], atol=1e-4)
    np.testing.assert_allclose(r.conf, [0.9, 0.7], atol=1e-6)
    assert r.cls.tolist() == [0, 2] and r.names == SquareFinder.names and r.labels == ["red", "blue"]
    assert r.summary() == "1 red, 1 blue"
    np.testing.assert_allclose(
        r.xywhn, [[45 / 160, 60 / 120, 50 / 160, 60 / 120], [120 / 160, 30 / 120, 40 / 160, 40 / 120]], atol=1e-6
    )
    assert r.orig_img is not None and np.array_equal(r.orig_img, cv2.imread(str(path)))


def test_boxes_map_back_through_resizing_and_padding(tmp_path: Path) -> None:
    # 240 x 320 at imgsz 160: halved, then padded; the box comes back in the original's pixels
    path = save(tmp_path / "big.png", picture({1: (40, 60, 140, 180)}, hw=(240, 320)))
    (r,) = predict(cfg(tmp_path), SquareFinder(), str(path))
    assert r.orig_shape == (240, 320)
    np.testing.assert_allclose(r.boxes.xyxy, [[40, 60, 140, 180]], atol=2.01)  # one resized pixel = 2 original ones


def test_classes_keep_only_those_ids(tmp_path: Path) -> None:
    path = save(tmp_path / "three.png", picture({0: (5, 5, 30, 30), 1: (40, 5, 70, 30), 2: (80, 5, 110, 30)}))
    assert predict(cfg(tmp_path), SquareFinder(), str(path))[0].cls.tolist() == [0, 1, 2]
    assert predict(cfg(tmp_path, classes=[2]), SquareFinder(), str(path))[0].cls.tolist() == [2]
    assert predict(cfg(tmp_path, classes="0,2"), SquareFinder(), str(path))[0].cls.tolist() == [0, 2]
    with pytest.raises(ConfigError, match=r"'classes': \[5\] not among the model's 3 classes \(0 to 2\)"):
        predict(cfg(tmp_path, classes=5), SquareFinder(), str(path))


@pytest.mark.parametrize("bad", ["a", "1.5", "-1", "0,x", [True]])
def test_bad_classes_are_refused_by_the_config(bad: object) -> None:
    with pytest.raises(ConfigError, match="invalid value for 'classes'"):
        make_cfg({"classes": bad})


def test_agnostic_nms_and_max_det(tmp_path: Path) -> None:
    img = picture({0: (20, 20, 80, 80)})
    img[22:82, 22:82] = BGR[1]  # a green square over most of the red one: IoU 0.88, different classes
    path = save(tmp_path / "overlap.png", img)
    assert predict(cfg(tmp_path), SquareFinder(), str(path))[0].cls.tolist() == [0, 1]
    assert predict(cfg(tmp_path, agnostic_nms=True), SquareFinder(), str(path))[0].cls.tolist() == [0]
    assert predict(cfg(tmp_path, max_det=1), SquareFinder(), str(path))[0].cls.tolist() == [0]
    assert len(predict(cfg(tmp_path, conf=0.85), SquareFinder(), str(path))[0]) == 1  # green scores 0.8


# --- what predict writes ----------------------------------------------------------------------------------------


def test_boxes_are_drawn_along_their_outline_and_nowhere_else(tmp_path: Path) -> None:
    original = picture({0: (20, 40, 70, 100), 2: (100, 50, 140, 90)})
    path = save(tmp_path / "in" / "x.png", original)
    (r,) = predict(cfg(tmp_path, save=True, name="drawn"), SquareFinder(), str(path))
    drawn = cv2.imread(str(tmp_path / "runs" / "drawn" / "x.png"))
    assert drawn.shape == original.shape and np.array_equal(drawn, r.plot())
    for box in r.boxes.xyxy:
        for x, y in outline(box):
            assert (drawn[y, x] != original[y, x]).any(), (x, y)
    changed = (drawn != original).any(2)
    assert not changed[105:, :].any() and not changed[:, :15].any()  # far from both boxes: untouched
    assert changed[:40, 20:60].any()  # the label above the red box
    assert no_temporary_files(tmp_path / "runs")


def test_txt_rows_match_the_results(tmp_path: Path) -> None:
    path = save(tmp_path / "x.png", picture({0: (20, 30, 70, 90), 2: (100, 10, 140, 50)}))
    save(tmp_path / "empty.png", picture({}))
    results = predict(cfg(tmp_path, save_txt=True, save_conf=True, name="conf"), SquareFinder(), str(tmp_path))
    r = next(r for r in results if r.path.endswith("x.png"))
    rows = np.loadtxt(tmp_path / "runs" / "conf" / "labels" / "x.txt", ndmin=2)
    assert rows.shape == (2, 6)
    assert rows[:, 0].astype(int).tolist() == r.cls.tolist()
    np.testing.assert_allclose(rows[:, 1:5], r.xywhn, atol=1e-6)
    np.testing.assert_allclose(rows[:, 5], r.conf, atol=1e-5)
    np.testing.assert_allclose(rows[0, 1:5], [45 / 160, 60 / 120, 50 / 160, 60 / 120], atol=1e-6)
    assert not (tmp_path / "runs" / "conf" / "labels" / "empty.txt").exists()  # nothing found, no file
    assert not list((tmp_path / "runs" / "conf").glob("*.png"))  # save=False: no drawings

    predict(cfg(tmp_path, save_txt=True, name="plain"), SquareFinder(), str(path))
    rows = np.loadtxt(tmp_path / "runs" / "plain" / "labels" / "x.txt", ndmin=2)
    assert rows.shape == (2, 5)


def test_defaults_write_no_label_files(tmp_path: Path) -> None:
    c = make_cfg({})
    assert (c.predict.save_txt, c.predict.save_conf, c.inputs.classes, c.predict.agnostic_nms, c.predict.half) == (
        False,
        False,
        None,
        False,
        False,
    )
    path = save(tmp_path / "x.png", picture({0: (20, 30, 70, 90)}))
    predict(cfg(tmp_path, save=True, name="d"), SquareFinder(), str(path))
    assert sorted(p.name for p in (tmp_path / "runs" / "d").iterdir()) == ["x.png"]


def test_same_named_files_in_sub_folders_are_all_kept(tmp_path: Path) -> None:
    src = tmp_path / "imgs"
    save(src / "a" / "x.png", picture({0: (10, 10, 40, 40)}))
    save(src / "b" / "x.png", picture({2: (90, 60, 130, 100)}))
    save(src / "c.jpg", picture({1: (10, 10, 40, 40)}))
    save(src / "c.png", picture({2: (10, 10, 40, 40)}))  # shares the stem: labels c.txt and c_2.txt
    predict(cfg(tmp_path, save=True, save_txt=True, name="s"), SquareFinder(), str(src))
    out = tmp_path / "runs" / "s"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "a/x.png",
        "b/x.png",
        "c.jpg",
        "c.png",
        "labels/a/x.txt",
        "labels/b/x.txt",
        "labels/c.txt",
        "labels/c_2.txt",
    ]
    assert (out / "labels/a/x.txt").read_text().split()[0] == "0"
    assert (out / "labels/b/x.txt").read_text().split()[0] == "2"
    assert (out / "labels/c.txt").read_text().split()[0] == "1" and (out / "labels/c_2.txt").read_text()[0] == "2"
    assert not np.array_equal(cv2.imread(str(out / "a/x.png")), cv2.imread(str(out / "b/x.png")))


# --- videos and streams -----------------------------------------------------------------------------------------


def test_a_video_gives_an_annotated_video_with_every_frame(tmp_path: Path) -> None:
    frames = moving_square_frames(7)
    video = write_video(tmp_path / "clip.avi", [f for f, _ in frames])
    results = predict(cfg(tmp_path, save=True, save_txt=True, batch=3, name="v"), SquareFinder(), str(video))
    assert [r.frame for r in results] == list(range(7)) and {r.path for r in results} == {str(video)}
    for r, (_, box) in zip(results, frames):
        assert r.cls.tolist() == [0]
        np.testing.assert_allclose(r.boxes.xyxy[0], box, atol=3)  # MJPG blurs the square's edges a little
    out = tmp_path / "runs" / "v"
    written = read_video(out / "clip.avi")
    source = read_video(video)
    assert len(written) == len(source) == 7 and written[0].shape == source[0].shape
    for r, before, after in zip(results, source, written):
        diff = np.abs(after.astype(int) - before.astype(int)).sum(2)
        on_box = np.mean([diff[y, x] for x, y in outline(r.boxes.xyxy[0])])
        assert on_box > 60 and diff[100:, :].mean() < 15  # drawn on the box, not elsewhere (codec noise only)
    assert sorted(p.name for p in (out / "labels").iterdir()) == [f"clip_{i}.txt" for i in range(7)]
    assert no_temporary_files(out)


def test_a_stream_url_is_read_frame_by_frame(tmp_path: Path) -> None:
    frames = moving_square_frames(5)
    (tmp_path / "served").mkdir()
    write_video(tmp_path / "served" / "cam.avi", [f for f, _ in frames])
    handler = functools.partial(QuietHandler, directory=str(tmp_path / "served"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/cam.avi"
        model = SquareFinder()
        results = list(stream_predict(cfg(tmp_path, save=True, batch=8, name="u"), model, url, prepared=True))
    finally:
        server.shutdown()
    assert [r.frame for r in results] == list(range(5)) and results[0].path == url
    assert [shape[0] for shape in model.calls] == [1] * 5  # a stream goes frame by frame, not in batches
    assert len(read_video(tmp_path / "runs" / "u" / "cam.avi")) == 5


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_stream_true_yields_one_result_at_a_time_and_keeps_what_was_written(tmp_path: Path) -> None:
    video = write_video(tmp_path / "long.avi", [f for f, _ in moving_square_frames(6)])
    model = model_with(SquareFinder())
    gen = model.predict(
        str(video),
        stream=True,
        imgsz=160,
        device="cpu",
        verbose=False,
        batch=1,
        save=True,
        project=str(tmp_path / "runs"),
        name="g",
    )
    assert isinstance(gen, types.GeneratorType)
    first, second = next(gen), next(gen)
    assert (first.frame, second.frame) == (0, 1)
    gen.close()  # the caller stops early: the annotated video holds the frames given so far, and is playable
    assert len(read_video(tmp_path / "runs" / "g" / "long.avi")) == 2
    assert no_temporary_files(tmp_path / "runs")


def test_an_interrupt_keeps_a_playable_video_and_an_error_leaves_none(tmp_path: Path) -> None:
    video = write_video(tmp_path / "cam.avi", [f for f, _ in moving_square_frames(6)])

    class StopsAtThird(SquareFinder):
        def __init__(self, error: type[BaseException]) -> None:
            super().__init__()
            self.error = error

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if len(self.calls) == 2:
                raise self.error()
            return super().forward(x)

    with pytest.raises(KeyboardInterrupt):
        list(
            stream_predict(
                cfg(tmp_path, save=True, batch=1, name="i"), StopsAtThird(KeyboardInterrupt), str(video), prepared=True
            )
        )
    assert len(read_video(tmp_path / "runs" / "i" / "cam.avi")) == 2
    with pytest.raises(RuntimeError):
        list(
            stream_predict(
                cfg(tmp_path, save=True, batch=1, name="e"), StopsAtThird(RuntimeError), str(video), prepared=True
            )
        )
    assert not (tmp_path / "runs" / "e" / "cam.avi").exists() and no_temporary_files(tmp_path / "runs")


def test_unreadable_files_named_directly_fail_and_are_skipped_in_a_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "mixed"
    (src / "sub").mkdir(parents=True)
    (src / "broken.avi").write_bytes(b"\x00garbage" * 64)
    (src / "broken.jpg").write_bytes(b"\xff\xd8not really")
    (src / "readme.md").write_text("hi")
    save(src / "sub" / "ok.png", picture({0: (10, 10, 40, 40)}))
    for name, message in (
        ("broken.avi", "cannot read video '.*broken.avi': OpenCV cannot open it"),
        ("broken.jpg", "cannot read image '.*broken.jpg'"),
    ):
        with pytest.raises(DatasetError, match=message):
            predict(cfg(tmp_path), SquareFinder(), str(src / name))
    results = predict(cfg(tmp_path), SquareFinder(), str(src))
    assert [Path(r.path).name for r in results] == ["ok.png"]
    out = capsys.readouterr().out
    assert "skipped 1 file(s) that are neither images nor videos" in out and "readme.md" in out
    assert "broken.avi" in out and "skipped" in out and "broken.jpg: not a readable image" in out
    (src / "sub" / "ok.png").unlink()
    with pytest.raises(DatasetError, match="none of its 2 image"):
        predict(cfg(tmp_path), SquareFinder(), str(src))


# --- batching ---------------------------------------------------------------------------------------------------


def test_batches_group_consecutive_pictures_of_one_shape(tmp_path: Path) -> None:
    src = tmp_path / "b"
    shapes = [(120, 160)] * 5 + [(160, 120)] * 2 + [(120, 160)]
    for i, hw in enumerate(shapes):
        save(src / f"{i}.png", picture({i % 3: (10 + i, 10, 40 + i, 40)}, hw=hw))
    model = SquareFinder()
    batched = list(stream_predict(cfg(tmp_path, batch=4), model, str(src), prepared=True))
    assert [c[0] for c in model.calls] == [4, 1, 2, 1]
    single = predict(cfg(tmp_path, batch=1), SquareFinder(), str(src))
    assert [r.path for r in batched] == [r.path for r in single] == [str(src / f"{i}.png") for i in range(8)]
    for a, b in zip(batched, single):
        assert np.array_equal(a.boxes.xyxy, b.boxes.xyxy) and np.array_equal(a.cls, b.cls)


@pytest.mark.skipif(not (YOLOV8N.is_file() and COCO8_VAL.is_dir()), reason="needs ../shared yolov8n.pt and coco8")
def test_batched_and_unbatched_real_predictions_agree() -> None:
    model = Model(str(YOLOV8N))
    kw = {"imgsz": 320, "device": "cpu", "verbose": False}
    single = model.predict(str(COCO8_VAL), batch=1, **kw)
    batched = model.predict(str(COCO8_VAL), batch=4, **kw)
    assert sum(len(r) for r in single) >= 4  # people, a giraffe...: real detections
    assert [Path(r.path).name for r in batched] == [Path(r.path).name for r in single]
    for a, b in zip(single, batched):
        assert a.cls.tolist() == b.cls.tolist()
        np.testing.assert_allclose(a.boxes.xyxy, b.boxes.xyxy, atol=0.05)
        np.testing.assert_allclose(a.conf, b.conf, atol=1e-3)


# --- Model.predict ----------------------------------------------------------------------------------------------


def test_model_predict_writes_nothing_by_default_and_leaves_the_weights_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model = Model("n.yaml")
    net = model.net
    training, has_bn = net.training, any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    results = model.predict(np.full((64, 96, 3), 90, np.uint8), imgsz=64, device="cpu", verbose=False)
    assert isinstance(results, list) and len(results) == 1 and results[0].orig_shape == (64, 96)
    assert results[0].path == "image0" and results[0].boxes.xyxy.shape[1:] == (4,)
    assert model.net is net and net.training == training and has_bn  # a fused copy ran, not the net itself
    assert any(isinstance(m, nn.BatchNorm2d) for m in net.modules())
    assert not (tmp_path / "runs").exists()


def test_model_predict_sees_changed_weights(tmp_path: Path) -> None:
    img = picture({0: (20, 30, 70, 90)})
    model = model_with(SquareFinder())
    kw = {"imgsz": 160, "device": "cpu", "verbose": False}
    assert model.predict(img, **kw)[0].conf.tolist() == pytest.approx([0.9])
    with torch.no_grad():
        model.net.gain.fill_(0.5)  # an in-place change, as an optimizer step makes
    assert model.predict(img, **kw)[0].conf.tolist() == pytest.approx([0.45])
    model.net.load_state_dict({"gain": torch.tensor(1.0), "stride": model.net.stride})
    assert model.predict([img, img], **kw)[1].conf.tolist() == pytest.approx([0.9])


def test_half_is_ignored_with_a_note_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = save(tmp_path / "x.png", picture({0: (20, 30, 70, 90)}))
    model = SquareFinder()
    (r,) = list(stream_predict(cfg(tmp_path, half=True), model, str(path), prepared=True))
    assert "half=True runs on CUDA only" in capsys.readouterr().out and model.dtypes == [torch.float32]
    np.testing.assert_allclose(r.boxes.xyxy, [[20, 30, 70, 90]], atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_half_runs_in_float16_on_cuda(tmp_path: Path) -> None:
    path = save(tmp_path / "x.png", picture({0: (20, 30, 70, 90), 2: (100, 10, 140, 50)}))
    (r,) = model_with(SquareFinder()).predict(str(path), imgsz=160, device="0", half=True, verbose=False)
    np.testing.assert_allclose(r.boxes.xyxy, [[20, 30, 70, 90], [100, 10, 140, 50]], atol=1e-2)
    assert r.boxes.xyxy.dtype == np.float32
    model = SquareFinder()
    list(stream_predict(cfg(tmp_path, device="0", half=True), model.cuda().half(), str(path), prepared=True))
    assert model.dtypes == [torch.float16]
    if YOLOV8N.is_file() and COCO8_VAL.is_dir():
        real = Model(str(YOLOV8N))
        full = real.predict(str(COCO8_VAL), imgsz=320, device="0", verbose=False)
        half = real.predict(str(COCO8_VAL), imgsz=320, device="0", half=True, verbose=False)
        for a, b in zip(full, half):
            confident = a.conf > 0.5
            assert len(b) >= confident.sum()
            for box in a.boxes.xyxy[confident]:
                assert np.abs(b.boxes.xyxy - box).max(1).min() < 2.0  # each confident box found again in fp16


# --- the command line -------------------------------------------------------------------------------------------


def detrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "detrain.cli", "predict", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_cli_predicts_a_folder_of_images_and_videos(tmp_path: Path) -> None:
    src = tmp_path / "src"
    save(src / "a" / "x.jpg", picture({0: (10, 10, 40, 40)}))
    save(src / "b" / "x.jpg", picture({1: (10, 10, 40, 40)}))
    write_video(src / "clip.avi", [f for f, _ in moving_square_frames(4)])
    proc = detrain("model=n.yaml", f"source={src}", "imgsz=64", "device=cpu", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "runs" / "predict" / "exp"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["a", "a/x.jpg", "b", "b/x.jpg", "clip.avi"]
    assert len(read_video(out / "clip.avi")) == 4
    assert "video 1/3 (frame 4/4)" in proc.stdout and f"results in {Path('runs/predict/exp')}" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "error: predict needs source=<an image, a video"),
        (("source=broken.avi",), "error: cannot read video 'broken.avi': OpenCV cannot open it"),
        (("source=x.png", "classes=a"), "error: invalid value for 'classes': 'a'"),
        (("source=x.png", "classes=3,80"), "error: invalid value for 'classes': [80] not among the model's 80 classes"),
    ],
)
def test_cli_usage_errors_are_one_line_and_exit_2(
    tmp_path: Path, args: tuple[str, ...], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.avi").write_bytes(b"\x00garbage" * 64)
    save(tmp_path / "x.png", picture({}))
    with pytest.raises(SystemExit) as e:
        cli_main(["predict", "model=n.yaml", *args])  # in this process: the same path as the command, faster
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(message), err
    assert err.count("\n") == 1 and not (tmp_path / "runs").exists()
