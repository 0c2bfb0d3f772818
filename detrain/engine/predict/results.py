"""What ``Model.predict`` returns: one :class:`Results` per image or video frame, plain numpy inside.

>>> r = Results("a.jpg", None, (40, 80), np.array([[8., 4, 24, 20]], np.float32), np.array([0.9], np.float32),
...             np.array([1]), {0: "cat", 1: "dog"})
>>> len(r), r.summary(), r.labels
(1, '1 dog', ['dog'])
>>> r.txt_lines(save_conf=True)
['1 0.200000 0.300000 0.200000 0.400000 0.90000']

Ultralytics' names read the same: ``r.boxes.xyxy``, ``r.boxes.conf``, ``r.boxes.cls`` (numpy where Ultralytics
has tensors, see :mod:`detrain.engine.predict.boxes`), ``r.to_json()``, ``r.verbose()``, ``r.save()``:

>>> r.boxes.xyxy.tolist(), r.boxes.cls.tolist(), r.verbose()
([[8.0, 4.0, 24.0, 20.0]], [1.0], '1 dog, ')
>>> r.to_json(normalize=True)
'[{"name":"dog","class":1,"confidence":0.9,"box":{"x1":0.1,"y1":0.1,"x2":0.3,"y2":0.5}}]'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from detrain.engine.predict.boxes import Boxes
from detrain.log import atomic_write_bytes, atomic_write_text
from detrain.plots.annotate import draw_detections
from detrain.system.process_env import has_display

#: Ultralytics' ``save_crop`` grows each box by this factor and these pixels (its width and height) before cutting
CROP_GAIN, CROP_PAD = 1.02, 10


def show_image(title: str, image: np.ndarray, wait_ms: int) -> bool:
    """``image`` in an OpenCV window named ``title`` for ``wait_ms`` (0: until a key) where a display exists;
    False where none does (no ``DISPLAY``/``WAYLAND_DISPLAY``, or OpenCV built without windows)."""
    if not has_display():
        return False
    try:
        cv2.imshow(title, image)
        cv2.waitKey(wait_ms)
        return True
    except cv2.error:
        return False  # a build without a window system


class Results:
    """The detections in one image or video frame, best first.

    Attributes:
        path: the image or video file (a camera as ``camera 0``, a stream as its URL without the password,
            an in-memory image as ``image<i>``).
        frame: the frame's number in its video, camera or stream (0 = first); None for an image.
        orig_shape: (height, width) of the picture, in pixels.
        boxes: a :class:`~detrain.engine.predict.boxes.Boxes`, Ultralytics' attributes (``xyxy``, ``xywh``,
            ``xyxyn``, ``xywhn``, ``conf``, ``cls``, ``data``) as numpy arrays where Ultralytics has tensors.
        conf: (n,) float32 confidences (``boxes.conf``).
        cls: (n,) int64 class ids (``boxes.cls`` holds them as floats, as Ultralytics does).
        names: class id -> name, for every class the model knows.
        orig_img: the picture (BGR uint8, as cv2 reads it), for :meth:`plot`; kept only while the Results is.
        speed: milliseconds this picture took, as Ultralytics' ``speed``: ``preprocess`` (letterbox, to a
            tensor), ``inference`` (the forward) and ``postprocess`` (NMS, boxes back to the picture), its batch's
            share; None each for a Results made by hand.

    Made from ``xyxy`` (n, 4) float32 boxes in the picture's pixels, ``conf`` and ``cls``.
    """

    def __init__(
        self,
        path: str,
        frame: int | None,
        orig_shape: tuple[int, int],
        xyxy: np.ndarray,
        conf: np.ndarray,
        cls: np.ndarray,
        names: dict[int, str],
        orig_img: np.ndarray | None = None,
        speed: dict[str, float | None] | None = None,
    ) -> None:
        self.path, self.frame, self.orig_shape = path, frame, (int(orig_shape[0]), int(orig_shape[1]))
        self.speed = speed or {"preprocess": None, "inference": None, "postprocess": None}
        self.conf, self.cls, self.names, self.orig_img = conf, cls, names, orig_img
        corners = np.asarray(xyxy).reshape(-1, 4)
        rows = np.empty((len(corners), 6), corners.dtype)
        rows[:, :4], rows[:, 4], rows[:, 5] = corners, conf.reshape(-1), cls.reshape(-1)
        self.boxes = Boxes(rows, self.orig_shape)

    def __repr__(self) -> str:
        where = "" if self.frame is None else f", frame {self.frame}"
        return f"Results({self.path!r}{where}, {self.orig_shape[0]}x{self.orig_shape[1]}: {self.summary()})"

    def __len__(self) -> int:
        return len(self.cls)

    @property
    def labels(self) -> list[str]:
        """The class name of each detection."""
        return [self.names.get(int(c), str(int(c))) for c in self.cls]

    @property
    def xywhn(self) -> np.ndarray:
        """(n, 4) boxes as centre x, centre y, width, height, normalised by the picture's size (YOLO labels)."""
        h, w = self.orig_shape
        b = np.asarray(self.boxes.xyxy, np.float64)
        xywh = np.stack(((b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2, b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]), 1)
        return (xywh / np.array([w, h, w, h])).reshape(-1, 4)

    def summary(self) -> str:
        """``'2 person, 1 car'`` (counts by class, most frequent first), or ``'no detections'``."""
        counts: dict[str, int] = {}
        for name in self.labels:
            counts[name] = counts.get(name, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{n} {name}" for name, n in ranked) or "no detections"

    def plot(self, line_width: int = 0, boxes: bool = True, labels: bool = True, conf: bool = True) -> np.ndarray:
        """A copy of the picture with the boxes and '<name> <conf>' labels drawn (BGR uint8); as Ultralytics'
        ``plot``: ``boxes=False`` draws nothing, ``labels=False`` the boxes alone, ``conf=False`` the class name
        alone."""
        if self.orig_img is None:
            raise ValueError(f"{self.path}: the picture was not kept, nothing to draw on")
        return draw_detections(
            self.orig_img,
            np.asarray(self.boxes.xyxy),
            self.conf,
            self.cls,
            self.names,
            line_width,
            boxes=boxes,
            labels=labels,
            show_conf=conf,
        )

    def show(self, line_width: int = 0, boxes: bool = True, labels: bool = True, conf: bool = True) -> str | None:
        """:meth:`plot`'s picture in a window (OpenCV's, until a key is pressed) where a display exists; where none
        does (no ``DISPLAY``/``WAYLAND_DISPLAY``, or OpenCV built without windows, as opencv-python-headless is) it
        is saved with :meth:`save` and one line says where. Returns the file saved, or None when shown."""
        image = self.plot(line_width, boxes, labels, conf)
        if show_image(str(self.path), image, 0):
            return None
        saved = self.save(line_width=line_width, boxes=boxes, labels=labels, conf=conf)
        print(f"no display to show {self.path}: saved {saved}")
        return saved

    def txt_lines(self, save_conf: bool = False) -> list[str]:
        """YOLO-format rows: ``class cx cy w h`` (normalised), and the confidence with ``save_conf``."""
        lines = []
        for c, row, score in zip(self.cls.tolist(), self.xywhn.tolist(), self.conf.tolist()):
            text = f"{int(c)} " + " ".join(f"{v:.6f}" for v in row)
            lines.append(text + (f" {score:.5f}" if save_conf else ""))
        return lines

    def save_txt(self, path: str | Path, save_conf: bool = False, root: str | Path | None = None) -> Path:
        """Write :meth:`txt_lines` to ``path`` (whole or not at all, through no symbolic link: below ``root`` when
        given, else in ``path``'s own folder); returns the path."""
        lines = self.txt_lines(save_conf)
        return atomic_write_text(path, "\n".join(lines) + ("\n" if lines else ""), root)

    def verbose(self) -> str:
        """Ultralytics' log text: ``'2 persons, 1 car, '`` (counts by class id, plural 's' past one), or
        ``'(no detections), '``."""
        if not len(self):
            return "(no detections), "
        counts = np.bincount(self.cls.astype(np.int64))
        return "".join(
            f"{n} {self.names.get(i, str(i))}{'s' * (n > 1)}, " for i, n in enumerate(counts.tolist()) if n > 0
        )

    def records(self, normalize: bool = False, decimals: int = 5) -> list[dict[str, Any]]:
        """One dict per detection, as Ultralytics' ``Results.summary()`` gives them: ``name``, ``class``,
        ``confidence`` and ``box`` (``x1 y1 x2 y2`` in pixels, or divided by the width and height with
        ``normalize``), rounded to ``decimals``. (detrain's :meth:`summary` is the counts line.)"""
        h, w = self.orig_shape if normalize else (1, 1)
        rows = []
        for (x1, y1, x2, y2), score, c in zip(self.boxes.xyxy.tolist(), self.conf.tolist(), self.cls.tolist()):
            box = {"x1": x1 / w, "y1": y1 / h, "x2": x2 / w, "y2": y2 / h}
            rows.append(
                {
                    "name": self.names.get(int(c), str(int(c))),
                    "class": int(c),
                    "confidence": round(score, decimals),
                    "box": {k: round(v, decimals) for k, v in box.items()},
                }
            )
        return rows

    def to_json(self, normalize: bool = False, decimals: int = 5) -> str:
        """:meth:`records` as compact JSON text, as Ultralytics' ``to_json`` writes it."""
        return json.dumps(self.records(normalize, decimals), separators=(",", ":"))

    def save(
        self,
        filename: str | Path | None = None,
        line_width: int = 0,
        boxes: bool = True,
        labels: bool = True,
        conf: bool = True,
    ) -> str:
        """Write :meth:`plot`'s picture to ``filename`` (default ``results_<picture's name>``, a ``.jpg`` when the
        name has no image suffix), whole or not at all, making its folder; returns the file name."""
        if not filename:
            name = Path(self.path).name or "image"
            filename = f"results_{name}" if Path(name).suffix else f"results_{name}.jpg"
        out = Path(filename)
        ok, data = cv2.imencode(out.suffix or ".jpg", self.plot(line_width, boxes, labels, conf))
        if not ok:
            raise ValueError(f"cannot encode '{out}' as {out.suffix or '.jpg'}")
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, data.tobytes())
        return str(filename)

    def crops(self) -> list[tuple[str, np.ndarray]]:
        """(class name, BGR crop) per detection, best first: the box grown as Ultralytics' ``save_crop`` grows it
        (its width and height times :data:`CROP_GAIN` plus :data:`CROP_PAD` pixels), cut to the picture."""
        if self.orig_img is None:
            raise ValueError(f"{self.path}: the picture was not kept, nothing to crop")
        h, w = self.orig_img.shape[:2]
        out = []
        for (x1, y1, x2, y2), name in zip(np.asarray(self.boxes.xyxy, np.float64).tolist(), self.labels):
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            bw, bh = (x2 - x1) * CROP_GAIN + CROP_PAD, (y2 - y1) * CROP_GAIN + CROP_PAD
            left, top = min(max(int(cx - bw / 2), 0), w), min(max(int(cy - bh / 2), 0), h)
            right, bottom = min(max(int(cx + bw / 2), 0), w), min(max(int(cy + bh / 2), 0), h)
            out.append((name, self.orig_img[top:bottom, left:right]))
        return out

    def save_crop(self, save_dir: str | Path, file_name: str | Path = "im.jpg") -> list[Path]:
        """Each detection's crop (:meth:`crops`) as ``save_dir/<class name>/<file_name stem>.jpg``, Ultralytics'
        layout: a name taken already gets 2, 3... after its stem (``im.jpg``, ``im2.jpg``); each file whole or
        not at all, through no symbolic link below ``save_dir``. Returns the files written."""
        root, stem = Path(save_dir), Path(file_name).stem
        written = []
        for name, crop in self.crops():
            if crop.size == 0:
                continue  # a box of no pixels (cut away at the border): nothing to save
            folder = root / name
            path, n = folder / f"{stem}.jpg", 2
            while path.exists():
                path, n = folder / f"{stem}{n}.jpg", n + 1
            ok, data = cv2.imencode(".jpg", crop)
            if not ok:
                raise ValueError(f"cannot encode a crop of {self.path} as .jpg")
            written.append(atomic_write_bytes(path, data.tobytes(), root))
        return written

    def to_df(self, normalize: bool = False, decimals: int = 5) -> Any:
        """:meth:`records` as a DataFrame, one row per detection (``name``, ``class``, ``confidence``, ``box``), as
        Ultralytics' ``to_df``: polars' where it is installed (Ultralytics' choice), else pandas'; an ImportError
        naming both when neither is."""
        rows = self.records(normalize, decimals)
        try:
            import polars  # type: ignore[import-not-found,unused-ignore]

            return polars.DataFrame(rows)
        except ImportError:
            pass
        try:
            import pandas  # type: ignore[import-untyped,import-not-found,unused-ignore]
        except ImportError:
            raise ImportError("Results.to_df needs polars or pandas: pip install polars") from None
        return pandas.DataFrame(rows, columns=["name", "class", "confidence", "box"])
