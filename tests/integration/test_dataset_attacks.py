"""Named attacks on dataset reading (issue 25, item 5): special files among the images, labels and lists, label
files that never end, image headers declaring gigapixels, decoder errors. Each is skipped with its reason (or, for
a list or yaml, refused in one line); none hangs, none allocates what the header asks, none stops a run.

Every attack runs in a child interpreter with a timeout (a regression to a hang fails the test instead of stalling
the suite) and an address-space cap of 1 GiB (a regression to a 2.7 GB decode or a read of /dev/zero dies there,
not on the machine).
"""

from __future__ import annotations

import ast
import os
import resource
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD_LIMIT_S = 60
CHILD_MEMORY = 1 << 30


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY, CHILD_MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_LIMIT_S, CHILD_LIMIT_S + 1))


def _child(code: str, cwd: Path) -> str:
    """Run ``code`` (detrain importable) in a fresh interpreter under the limits; its stdout. A hang or a crash
    fails the test with what the child said."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_LIMIT_S,
            preexec_fn=_limits,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {CHILD_LIMIT_S} s: {e.stdout!r} {e.stderr!r}")
    assert run.returncode == 0, f"child ended with {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    return run.stdout


def _image(path: Path, h: int = 32, w: int = 48) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    ok, enc = cv2.imencode(path.suffix, np.full((h, w, 3), 90, np.uint8))
    assert ok
    path.write_bytes(enc.tobytes())
    return path


def _label(image: Path, text: str = "0 0.5 0.5 0.2 0.2\n") -> Path:
    label = Path(str(image).replace("/images/", "/labels/")).with_suffix(".txt")
    label.parent.mkdir(parents=True, exist_ok=True)
    label.write_text(text)
    return label


def png_bomb(path: Path, width: int, height: int) -> Path:
    """A valid PNG header declaring ``width`` x ``height`` RGB pixels, followed by one row of data: a few hundred
    bytes that make a decoder allocate ``3 * width * height`` bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (1 + 3 * width), 9)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b""))
    return path


_VERIFY = """
from detrain.data.labels.verify import load_labels
records, report = load_labels({files!r}, nc=1, cache=False, progress=False, workers=2{extra})
print("KEPT", sorted(r.im_file.rsplit("/", 1)[-1] for r in records))
for m in report.messages:
    print("MSG", m)
"""


def _verify(tmp_path: Path, files: list[Path], extra: str = "") -> tuple[list[str], list[str]]:
    out = _child(_VERIFY.format(files=[str(f) for f in files], extra=extra), tmp_path)
    kept = next(line for line in out.splitlines() if line.startswith("KEPT"))
    return ast.literal_eval(kept[5:]), [line[4:] for line in out.splitlines() if line.startswith("MSG ")]


def _one_message(messages: list[str], name: str) -> str:
    found = [m for m in messages if name in m]
    assert len(found) == 1, messages
    assert "\n" not in found[0] and len(found[0]) < 300
    return found[0]


def test_fifo_image_is_skipped_not_waited_on(tmp_path: Path) -> None:
    good = _image(tmp_path / "images" / "good.png")
    fifo = tmp_path / "images" / "fifo.jpg"
    os.mkfifo(fifo)
    for f in (good, fifo):
        _label(f)
    kept, messages = _verify(tmp_path, [good, fifo])
    assert kept == ["good.png"]
    assert "unreadable image file (a FIFO, not a regular file); image skipped" in _one_message(messages, "fifo.jpg")


def test_fifo_label_is_skipped_not_waited_on(tmp_path: Path) -> None:
    good, bad = _image(tmp_path / "images" / "good.png"), _image(tmp_path / "images" / "bad.png")
    _label(good)
    label = Path(str(bad).replace("/images/", "/labels/")).with_suffix(".txt")
    label.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(label)
    kept, messages = _verify(tmp_path, [good, bad])
    assert kept == ["good.png"]
    assert "unreadable label file (a FIFO, not a regular file); image skipped" in _one_message(messages, "bad.txt")


def test_label_linked_to_dev_zero_is_refused_not_read(tmp_path: Path) -> None:
    """The reported attack read /dev/zero until MemoryError; now the descriptor's kind is checked before a byte."""
    good, bad = _image(tmp_path / "images" / "good.png"), _image(tmp_path / "images" / "bad.png")
    _label(good)
    label = Path(str(bad).replace("/images/", "/labels/")).with_suffix(".txt")
    label.parent.mkdir(parents=True, exist_ok=True)
    label.symlink_to("/dev/zero")
    kept, messages = _verify(tmp_path, [good, bad])
    assert kept == ["good.png"]
    assert "a character device, not a regular file" in _one_message(messages, "bad.txt")


def test_label_file_over_its_cap_is_refused_unread(tmp_path: Path) -> None:
    from detrain.data.labels.check import MAX_LABEL_BYTES

    good, bad = _image(tmp_path / "images" / "good.png"), _image(tmp_path / "images" / "bad.png")
    _label(good)
    label = _label(bad)
    os.truncate(label, MAX_LABEL_BYTES + 1)  # sparse: no disk used
    kept, messages = _verify(tmp_path, [good, bad])
    assert kept == ["good.png"]
    assert f"too large: {MAX_LABEL_BYTES + 1} bytes" in _one_message(messages, "bad.txt")


def test_png_declaring_30000_squared_is_skipped_before_decoding(tmp_path: Path) -> None:
    """2.7 GB to decode, under a 1 GiB cap: decoding it at all fails the child; the header alone skips it."""
    good = _image(tmp_path / "images" / "good.png")
    bomb = png_bomb(tmp_path / "images" / "bomb.png", 30000, 30000)
    assert bomb.stat().st_size < 2000
    for f in (good, bomb):
        _label(f)
    kept, messages = _verify(tmp_path, [good, bomb])
    assert kept == ["good.png"]
    assert "declares 30000x30000 = 900000000 pixels, over max_pixels=200000000" in _one_message(messages, "bomb")


def test_png_over_opencvs_own_limit_is_a_skip_with_opencvs_reason(tmp_path: Path) -> None:
    """50000 x 50000 makes OpenCV raise (its CV_IO_MAX_IMAGE_PIXELS); with max_pixels raised past it the header
    check lets it through, and the decoder's error is still one skipped file with the reason, not a traceback."""
    good = _image(tmp_path / "images" / "good.png")
    bomb = png_bomb(tmp_path / "images" / "huge.png", 50000, 50000)
    for f in (good, bomb):
        _label(f)
    kept, messages = _verify(tmp_path, [good, bomb], extra=", max_pixels=3_000_000_000")
    assert kept == ["good.png"]
    message = _one_message(messages, "huge.png")
    assert "not a readable image (OpenCV: " in message and message.endswith("image skipped")
    kept, messages = _verify(tmp_path, [good, bomb])  # by default the header check refuses it first
    assert "declares 50000x50000" in _one_message(messages, "huge.png")


def test_fifo_in_a_txt_list_and_a_fifo_list_do_not_hang(tmp_path: Path) -> None:
    """A FIFO named by a split's .txt list is a skipped image; a .txt list that is a FIFO is one line."""
    good = _image(tmp_path / "images" / "train" / "good.png")
    fifo = tmp_path / "images" / "train" / "fifo.png"
    os.mkfifo(fifo)
    for f in (good, fifo):
        _label(f)
    (tmp_path / "train.txt").write_text("images/train/good.png\nimages/train/fifo.png\n")
    os.mkfifo(tmp_path / "val.txt")
    (tmp_path / "data.yaml").write_text("path: .\ntrain: train.txt\nval: val.txt\nnames: [a]\n")
    code = """
    from detrain.data.dataset_yaml import load_dataset_yaml, _list_split
    from detrain.data.labels.verify import load_labels
    from detrain.errors import DatasetError
    from pathlib import Path
    try:
        load_dataset_yaml("data.yaml", download=False)
    except DatasetError as e:
        print("REFUSED", e)
    files, _ = _list_split("train", ["train.txt"], Path.cwd(), Path("data.yaml"))
    records, report = load_labels(files, nc=1, cache=False, progress=False)
    print("KEPT", [r.im_file.rsplit("/", 1)[-1] for r in records])
    print("MSG", *report.messages)
    """
    out = _child(code, tmp_path)
    assert "REFUSED" in out and "val.txt: cannot read the image list (a FIFO, not a regular file)" in out
    assert "KEPT ['good.png']" in out and "fifo.png: unreadable image file (a FIFO, not a regular file)" in out


def test_a_decoder_that_raises_never_stops_verification(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a decoder raises on a file (here an OpenCV error, then an error of another kind) is that file
    skipped with the reason; the other files are verified."""
    from detrain.data.labels import check
    from detrain.data.labels.verify import load_labels

    good, bad = _image(tmp_path / "images" / "good.png"), _image(tmp_path / "images" / "bad.png")
    for f in (good, bad):
        _label(f)
    real = cv2.imdecode

    def hostile(error: Exception):
        def decode(data: np.ndarray, flags: int) -> np.ndarray | None:
            if data.size == bad.stat().st_size and bytes(data[-64:]) == bad.read_bytes()[-64:]:
                raise error
            return real(data, flags)

        return decode

    bad.write_bytes(bad.read_bytes() + b"\x00")  # tell the two files apart by size
    for error, said in ((cv2.error("decoder exploded"), "not a readable image (OpenCV: "), (RuntimeError("x"), "")):
        monkeypatch.setattr(check.cv2, "imdecode", hostile(error))
        records, report = load_labels([str(good), str(bad)], nc=1, cache=False, progress=False)
        assert [Path(r.im_file).name for r in records] == ["good.png"]
        assert said in _one_message(report.messages, "bad.png")


def test_training_replaces_an_image_that_became_a_bomb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An image verified, then swapped for a file declaring 30000 x 30000: the loader never decodes it (its header
    is checked against max_pixels first) and draws another image, as for any unreadable file."""
    from detrain.data import image_io
    from detrain.data.dataset import DetectionDataset
    from detrain.data.labels.verify import load_labels

    files = [_image(tmp_path / "images" / f"{i}.png") for i in range(4)]
    for f in files:
        _label(f)
    records, _ = load_labels([str(f) for f in files], nc=1, cache=False, progress=False)
    ds = DetectionDataset(records, imgsz=64, augment=True, seed=1)
    png_bomb(files[0], 30000, 30000)
    real = image_io.cv2.imdecode

    def no_bomb(data: np.ndarray, flags: int) -> np.ndarray | None:
        assert bytes(data[16:24]) != struct.pack(">II", 30000, 30000), "the bomb reached the decoder"
        return real(data, flags)

    monkeypatch.setattr(image_io.cv2, "imdecode", no_bomb)
    with pytest.warns(UserWarning, match="unreadable since verification"):
        shapes = [ds[i]["img"].shape[0] for i in range(len(ds))]
    assert shapes == [3] * len(ds)
    assert ds.skipped_images >= 1
