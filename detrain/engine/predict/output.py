"""What ``detrain predict`` writes under its run folder, each file whole or not at all.

* ``<rel>``: an image with its detections drawn, at the source's own path relative to the folder, glob or list
  it came from (``save=True``); a suffix OpenCV cannot write (``.mpo``, ``.dng``, ``.gif``) gets ``.jpg`` added;
* ``<rel stem>.avi``: a video, camera or stream with every frame annotated (MJPG, the source's frame rate);
  written beside its name and renamed when it ends, or when the user interrupts, so it is always playable;
* ``labels/<rel stem>.txt``, ``labels/<rel stem>_<frame>.txt`` for video frames (``save_txt=True``): YOLO rows
  ``class cx cy w h`` normalised, with the confidence when ``save_conf``; none when nothing was detected;
* ``crops/<class name>/<stem>.jpg``, ``<stem>_<frame>.jpg`` for video frames (``save_crop=True``): each
  detection cut out as Ultralytics cuts it (:meth:`~detrain.engine.predict.results.Results.save_crop`), a second
  of one class in one picture ``<stem>2.jpg``.

Two sources that would share an output (``a.jpg`` and ``a.png`` share ``labels/a.txt``; ``a.mp4`` and ``a.mkv``
share ``a.avi``; one file listed twice) keep separate files: the later one gets ``_2``, ``_3``... after its stem.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import cv2
import numpy as np

from detrain.data.frames import Frame
from detrain.data.sources import SourceItem, shown
from detrain.engine.predict.results import Results
from detrain.errors import DatasetError
from detrain.log import atomic_write_bytes
from detrain.system.tempfiles import open_folder, temp_beside

VIDEO_SUFFIX, VIDEO_FOURCC = ".avi", "MJPG"  # Ultralytics' choice on Linux: every OpenCV build writes it


class VideoSink:
    """Annotated frames into ``path`` (MJPG .avi): written to a hidden file beside it, renamed by :meth:`close`;
    ``root``: the run folder, below which no folder on the way may be a symbolic link."""

    def __init__(self, path: Path, fps: float, size_wh: tuple[int, int], root: Path | None = None) -> None:
        os.close(open_folder(path.parent, root))  # made, and no folder below root a link (OpenCV writes by path)
        fd, self.tmp = temp_beside(path.with_name(path.stem), VIDEO_SUFFIX)
        os.close(fd)
        self.path, self.size_wh, self.frames = path, size_wh, 0
        self.writer = cv2.VideoWriter(self.tmp, cv2.VideoWriter.fourcc(*VIDEO_FOURCC), fps, size_wh)
        if not self.writer.isOpened():
            os.unlink(self.tmp)
            raise DatasetError(f"cannot write video '{shown(str(path))}': OpenCV has no {VIDEO_FOURCC} writer here")

    def write(self, image: np.ndarray) -> None:
        """One frame; a frame of another size (a stream that changed resolution) is resized to the first's."""
        if (image.shape[1], image.shape[0]) != self.size_wh:
            image = cv2.resize(image, self.size_wh, interpolation=cv2.INTER_LINEAR)
        self.writer.write(image)
        self.frames += 1

    def close(self, keep: bool = True) -> Path | None:
        """Finish the file and give it its name (``keep``), or remove it; returns the path kept."""
        self.writer.release()
        if keep and self.frames:
            os.replace(self.tmp, self.path)
            return self.path
        Path(self.tmp).unlink(missing_ok=True)
        return None


class PredictionWriter:
    """Writes each frame's outputs under ``save_dir`` as the module docstring says; call :meth:`close` at the end."""

    def __init__(
        self,
        save_dir: Path,
        save: bool,
        save_txt: bool,
        save_conf: bool,
        line_width: int = 0,
        *,
        save_crop: bool = False,
        draw: dict[str, bool] | None = None,
    ) -> None:
        self.save_dir, self.save, self.save_txt, self.save_conf = save_dir, save, save_txt, save_conf
        self.line_width, self.save_crop = line_width, save_crop
        self.draw = draw or {}  # Results.plot's boxes, labels, conf (show_boxes, show_labels, show_conf)
        self._places: dict[SourceItem, tuple[PurePosixPath, PurePosixPath]] = {}
        self._taken_out: set[PurePosixPath] = set()
        self._taken_labels: set[PurePosixPath] = set()
        self._video: tuple[SourceItem, VideoSink] | None = None
        self.written: list[Path] = []  # images and videos written, in order

    @property
    def active(self) -> bool:
        return self.save or self.save_txt or self.save_crop

    def add(self, frame: Frame, result: Results) -> np.ndarray | None:
        """The outputs of one frame: its drawing (image, or the next frame of its video), its label file and its
        crops; returns the drawing when it made one."""
        drawn = None
        if self._video is not None and self._video[0] is not frame.item:
            self._close_video(keep=True)
        if not self.active:
            return drawn
        out_rel, label_rel = self._place(frame.item)
        name = label_rel.name + ("" if frame.index is None else f"_{frame.index}")
        if self.save:
            drawn = result.plot(self.line_width, **self.draw)
            if frame.item.is_video:
                if self._video is None:
                    h, w = drawn.shape[:2]
                    sink = VideoSink(self.save_dir / out_rel, frame.fps, (w, h), self.save_dir)
                    self._video = (frame.item, sink)
                self._video[1].write(drawn)
            else:
                ok, data = cv2.imencode(out_rel.suffix, drawn)
                if not ok:
                    raise DatasetError(f"cannot encode '{shown(str(out_rel))}' as {out_rel.suffix}")
                self.written.append(atomic_write_bytes(self.save_dir / out_rel, data.tobytes(), self.save_dir))
        if self.save_txt and len(result):
            label = self.save_dir / "labels" / label_rel.parent / f"{name}.txt"
            result.save_txt(label, self.save_conf, root=self.save_dir)
        if self.save_crop and len(result):  # Ultralytics' layout: crops/<class name>/<picture stem>[_frame].jpg
            result.save_crop(self.save_dir / "crops", f"{name}.jpg")
        return drawn

    def close(self, keep: bool = True) -> None:
        """Finish the video being written (kept, or removed when ``keep`` is False: a run that failed)."""
        if self._video is not None:
            self._close_video(keep)

    def _close_video(self, keep: bool) -> None:
        assert self._video is not None
        sink = self._video[1]
        self._video = None
        path = sink.close(keep)
        if path is not None:
            self.written.append(path)

    def _place(self, item: SourceItem) -> tuple[PurePosixPath, PurePosixPath]:
        """(drawing's path, label stem) of an item under the run folder, unique among this run's items."""
        if item not in self._places:
            rel = item.rel
            stem = rel.name if item.live else rel.stem  # a camera's or stream's rel is a bare name already
            if item.is_video:
                out = rel.with_name(stem + VIDEO_SUFFIX)
            else:
                out = rel if cv2.haveImageWriter(rel.name) else rel.with_name(rel.name + ".jpg")
            self._places[item] = (
                _unique(out, self._taken_out, out.stem, out.suffix),
                _unique(rel.with_name(stem), self._taken_labels, stem, ""),
            )
        return self._places[item]


def _unique(rel: PurePosixPath, taken: set[PurePosixPath], stem: str, suffix: str) -> PurePosixPath:
    """``rel``, or ``<stem>_2<suffix>``, ``_3``... beside it: the first not in ``taken`` (which then holds it)."""
    candidate, n = rel, 2
    while candidate in taken:
        candidate = rel.with_name(f"{stem}_{n}{suffix}")
        n += 1
    taken.add(candidate)
    return candidate
