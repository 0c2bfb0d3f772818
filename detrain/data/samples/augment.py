"""The HSV colour step of training and the letterbox that validation and prediction use. The augmentation
settings, their defaults and bounds are the config's augment section (:class:`detrain.config.keys.Augment`).

Training does not chain augmentations one by one: ``train_sample.py`` draws every random choice of a sample
(mosaic placement, affine, flips, mixup, cutmix, HSV gains) from one generator, multiplies the geometry into one
matrix per source image and warps once (``compose.render``); the HSV gains drawn by :func:`hsv_gains` are then
applied by :func:`apply_hsv` as the colour step writes the batch.
"""

from __future__ import annotations

import cv2
import numpy as np

from detrain.data.samples.affine import FILL

MIXUP_BETA = 32.0  # mixing ratio ~ Beta(32, 32): close to an even blend


def hsv_gains(rng: np.random.Generator, hgain: float = 0.015, sgain: float = 0.7, vgain: float = 0.4) -> np.ndarray:
    """Random (hue, saturation, value) gains, each uniform in +-its gain."""
    return rng.uniform(-1, 1, 3) * np.array([hgain, sgain, vgain])


def apply_hsv(img: np.ndarray, gains: np.ndarray, to_rgb: bool = False, dst: np.ndarray | None = None) -> np.ndarray:
    """``img`` (BGR) with hue shifted by ``gains[0]`` of the circle and saturation and value scaled by
    ``1 + gains[1:]`` (clipped); BGR out, or RGB with ``to_rgb`` (the channel swap comes free with the
    conversion back). Written into ``dst`` (same shape) if given, else a new array.

    OpenCV's full-range 8-bit HSV (hue 0-255 for the whole circle) is used: its conversion back is a quarter
    faster than the 0-180 one and the hue steps are finer.
    """
    if not np.any(gains):
        if to_rgb:
            return cv2.cvtColor(img, cv2.COLOR_BGR2RGB, dst=dst)
        if dst is None:
            return img.copy()
        dst[...] = img
        return dst
    x = np.arange(256, dtype=np.float64)
    lut = np.empty((1, 256, 3), np.uint8)
    lut[0, :, 0] = (x + gains[0] * 256) % 256
    lut[0, :, 1] = np.clip(x * (1 + gains[1]), 0, 255)
    lut[0, :, 2] = np.clip(x * (1 + gains[2]), 0, 255)
    hsv = cv2.cvtColor(img, cv2.COLOR_BGR2HSV_FULL)
    cv2.LUT(hsv, lut, dst=hsv)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB_FULL if to_rgb else cv2.COLOR_HSV2BGR_FULL, dst=dst)


def letterbox(
    img: np.ndarray,
    new_shape: int | tuple[int, int] = (640, 640),
    auto: bool = False,
    scaleup: bool = True,
    stride: int = 32,
    center: bool = True,
    color: int = FILL,
) -> tuple[np.ndarray, tuple[float, float], tuple[int, int]]:
    """Resize keeping the aspect ratio and pad to ``new_shape`` (h, w), with YOLOv8's exact numerics.

    Returns (image, (gain, gain), (pad_left, pad_top)). The gain is ``r = min(new_h / h, new_w / w)`` (at most 1
    without ``scaleup``); the resized size is ``max(round(w * r), 1)`` x ``max(round(h * r), 1)`` (resized with
    INTER_LINEAR only if it differs); ``auto`` pads only to the next multiple of ``stride``; centred padding splits
    it as ``top = round(dh / 2 - 0.1)``, ``bottom = round(dh / 2 + 0.1)`` (same for left/right), with grey 114.
    A box maps as ``x * gain + pad_left`` (``Labels.scaled``).

    >>> out, ratio, pad = letterbox(np.zeros((480, 640, 3), np.uint8), (640, 640))
    >>> out.shape, ratio, pad
    ((640, 640, 3), (1.0, 1.0), (0, 80))
    """
    shape = img.shape[:2]
    if isinstance(new_shape, int):
        new_shape = (new_shape, new_shape)
    r = min(new_shape[0] / shape[0], new_shape[1] / shape[1])
    if not scaleup:
        r = min(r, 1.0)
    new_unpad = (max(round(shape[1] * r), 1), max(round(shape[0] * r), 1))  # w, h
    dw, dh = new_shape[1] - new_unpad[0], new_shape[0] - new_unpad[1]
    if auto:
        dw, dh = dw % stride, dh % stride
    if center:
        dw, dh = dw / 2, dh / 2
    top, bottom = (round(dh - 0.1) if center else 0), round(dh + 0.1)
    left, right = (round(dw - 0.1) if center else 0), round(dw + 0.1)
    if shape[::-1] != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(color, color, color))
    return img, (r, r), (left, top)
