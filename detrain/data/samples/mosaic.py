"""YOLO's 4-image mosaic layout. ``train_sample.py`` plans it and composes it with the random affine into one warp
per image.

Layout (as YOLOv8): a virtual canvas of 2s x 2s (s = imgsz) with a random centre (xc, yc), each uniform in
[s/2, 3s/2). The four images (at load size, long side s) touch the centre with a corner: the first to its top-left,
then top-right, bottom-left, bottom-right; whatever falls outside the canvas is cut. The random affine then maps
the canvas centre to the output centre (zoom, rotation, shear, translation) into an s x s output.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mosaic_origins(rng: np.random.Generator, sizes_wh: Sequence[tuple[int, int]], imgsz: int) -> list[tuple[int, int]]:
    """Top-left corners on the 2s canvas of four images of ``sizes_wh``, around a random centre.

    >>> o = mosaic_origins(np.random.default_rng(0), [(10, 10)] * 4, 20)
    >>> o[3][0] - o[0][0], o[3][1] - o[0][1]  # the first ends where the last starts: at the centre
    (10, 10)
    """
    xc = int(rng.uniform(imgsz / 2, 1.5 * imgsz))
    yc = int(rng.uniform(imgsz / 2, 1.5 * imgsz))
    (w0, h0), (_, h1), (w2, _), _ = sizes_wh
    return [(xc - w0, yc - h0), (xc, yc - h1), (xc - w2, yc), (xc, yc)]
