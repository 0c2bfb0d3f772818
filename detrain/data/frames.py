"""Frames from the items of a source: decoded images, and the frames of videos, cameras and streams (OpenCV).

Images are decoded as the dataset decodes them (:func:`detrain.data.image_io.read_image`: EXIF orientation,
any path). Videos, cameras and streams go through ``cv2.VideoCapture`` (FFmpeg where OpenCV has it) and are read
frame by frame, in order, none dropped, so memory stays flat however long they run. A stream that stalls
for ``STREAM_TIMEOUT_MS`` ends.

What cannot be read: when the user named that one thing (``Source.single``) it is a
:class:`~detrain.errors.DatasetError` naming it; inside a folder, glob or list it is skipped with a warning.

>>> from detrain.data.sources import parse_source
>>> [(f.item.name, f.index, f.image.shape) for f in read_frames(parse_source(np.zeros((4, 6, 3), np.uint8)))]
[('image0', None, (4, 6, 3))]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import cv2
import numpy as np

from detrain.config.keys import MAX_PIXELS
from detrain.data.image_io import read_image_why
from detrain.data.sources import VIDEO_SUFFIXES, Source, SourceItem
from detrain.errors import DatasetError

STREAM_TIMEOUT_MS = 30_000  # a stream URL that sends nothing for this long has ended
DEFAULT_FPS = 30.0  # for the annotated video when the source does not say (cameras often do not)


@dataclass(frozen=True, eq=False)
class Frame:
    """One picture to predict on: an image, or frame ``index`` (0 = first) of a video, camera or stream."""

    item: SourceItem
    image: np.ndarray  # BGR uint8 (H, W, 3)
    index: int | None = None  # None for an image
    total: int | None = None  # frames in the video file when it says so; None otherwise
    fps: float = DEFAULT_FPS  # of the source video, for the annotated one


def read_frames(
    source: Source,
    warn: Callable[[str], None] = lambda message: None,
    max_pixels: int = MAX_PIXELS,
    vid_stride: int = 1,
) -> Iterator[Frame]:
    """Every frame of every item, in order; of a video, camera or stream every ``vid_stride``-th (frames 0, n,
    2n...: those between are grabbed, not decoded; each Frame keeps its number in the source and an ``fps`` of the
    source's rate / n). ``warn`` gets one line per item skipped as unreadable (a FIFO or device, an image whose
    header declares more than ``max_pixels`` pixels, a decoder error), with the reason."""
    for item in source.items:
        if item.is_video:
            yield from _video_frames(item, source.single, warn, max(1, vid_stride))
            continue
        image, why = (
            (as_bgr(item.pixels), "") if item.pixels is not None else read_image_why(item.target, 1, max_pixels)
        )
        if image is None:
            if source.single:
                raise DatasetError(f"cannot read image '{item.name}': {why}")
            warn(f"skipped {item.name}: {why}")
            continue
        yield Frame(item, image)


def as_bgr(pixels: np.ndarray) -> np.ndarray:
    """A grey (H, W) or (H, W, 1), BGR or BGRA uint8 array as contiguous BGR (H, W, 3)."""
    if pixels.ndim == 2 or pixels.shape[2] == 1:
        return cv2.cvtColor(np.ascontiguousarray(pixels.reshape(pixels.shape[:2])), cv2.COLOR_GRAY2BGR)
    if pixels.shape[2] == 4:
        return cv2.cvtColor(np.ascontiguousarray(pixels), cv2.COLOR_BGRA2BGR)
    return np.ascontiguousarray(pixels)


def open_capture(item: SourceItem) -> cv2.VideoCapture | None:
    """An opened capture for a video file, camera or stream; None if OpenCV cannot open it (its own warnings
    about that are silenced: the caller says it in one line)."""
    logging = getattr(getattr(cv2, "utils", None), "logging", None)
    level = logging.getLogLevel() if logging is not None else None
    if logging is not None:
        logging.setLogLevel(logging.LOG_LEVEL_ERROR)
    try:
        return _open_capture(item)
    finally:
        if logging is not None:
            logging.setLogLevel(level)


def _open_capture(item: SourceItem) -> cv2.VideoCapture | None:
    if item.kind == "camera":
        cap = cv2.VideoCapture(int(item.target))
    elif cv2.videoio_registry.hasBackend(cv2.CAP_FFMPEG):
        # FFmpeg by name: a file name with '%' is not taken for an image-sequence pattern; streams get timeouts
        params = (
            [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, STREAM_TIMEOUT_MS, cv2.CAP_PROP_READ_TIMEOUT_MSEC, STREAM_TIMEOUT_MS]
            if item.kind == "stream"
            else []
        )
        cap = cv2.VideoCapture(item.target, cv2.CAP_FFMPEG, params)
    else:
        cap = cv2.VideoCapture(item.target)
    if not cap.isOpened():
        cap.release()
        return None
    return cap


def _unreadable(item: SourceItem, why: str) -> str:
    if item.kind == "camera":
        return f"cannot read {item.name}: {why} (is it connected, and free?)"
    if item.kind == "stream":
        return f"cannot read stream '{item.name}': {why}"
    return f"cannot read video '{item.name}': {why} (videos OpenCV decodes: {', '.join(sorted(VIDEO_SUFFIXES))})"


def _video_frames(item: SourceItem, single: bool, warn: Callable[[str], None], stride: int = 1) -> Iterator[Frame]:
    cap = open_capture(item)
    if cap is None:
        message = _unreadable(item, "OpenCV cannot open it")
        if single or item.live:
            raise DatasetError(message)
        warn(f"skipped: {message}")
        return
    try:
        fps = cap.get(cv2.CAP_PROP_FPS)
        fps = fps if math.isfinite(fps) and 0 < fps <= 1000 else DEFAULT_FPS
        count = cap.get(cv2.CAP_PROP_FRAME_COUNT)
        total = int(count) if item.kind == "video" and math.isfinite(count) and count > 0 else None
        index = 0
        while True:
            if index % stride:  # a frame vid_stride skips: read past, not decoded
                if not cap.grab():
                    break
                index += 1
                continue
            ok, image = cap.read()
            if not ok or image is None:
                break
            yield Frame(item, as_bgr(image), index, total, fps / stride)
            index += 1
        if index == 0:
            message = _unreadable(item, "no frame could be decoded")
            if single or item.live:
                raise DatasetError(message)
            warn(f"skipped: {message}")
    finally:
        cap.release()
