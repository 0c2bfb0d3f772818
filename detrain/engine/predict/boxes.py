"""``Results.boxes``: the detections of one picture with Ultralytics' attribute names and shapes, numpy inside.

Ultralytics' ``Boxes`` holds torch tensors; detrain's holds numpy arrays, and every array it hands out is a
:class:`HostArray`: a plain ``np.ndarray`` that also answers the tensor calls Ultralytics scripts chain
(``.cpu()``, ``.numpy()``, ``.detach()``, ``.int()``, ``.float()``...), so ``r.boxes.xyxy.cpu().numpy()`` and
``r.boxes.cpu().numpy().conf`` run unchanged. ``data`` is ``(n, 6)``: x1 y1 x2 y2 in the picture's pixels,
confidence, class id (as a float, as in Ultralytics).

>>> b = Boxes(np.array([[8., 4, 24, 20, 0.5, 1]], np.float32), orig_shape=(40, 80))
>>> b.xyxy.tolist(), b.xywh.tolist(), b.conf.tolist(), b.cls.tolist(), b.id
([[8.0, 4.0, 24.0, 20.0]], [[16.0, 12.0, 16.0, 16.0]], [0.5], [1.0], None)
>>> b.xyxyn.tolist()
[[0.10000000149011612, 0.10000000149011612, 0.30000001192092896, 0.5]]
>>> len(b), b[0].data.shape, [len(one) for one in b]
(1, (1, 6), [1])

Until the next release ``r.boxes`` also still works where code used it as the ``(n, 4)`` xyxy array it used to
be (``np.asarray(r.boxes)``, ``r.boxes[:, 0]``, ``r.boxes.shape``, arithmetic, array methods), with one
deprecation line the first time.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from detrain.errors import deprecated

_ARRAY_USE = (
    "r.boxes is a Boxes object now, with Ultralytics' attributes (xyxy, xywh, xyxyn, xywhn, conf, cls, data): "
    "using it as the old (n, 4) array (np.asarray(r.boxes), r.boxes[:, i], r.boxes.shape, arithmetic, array "
    "methods) is deprecated and stops working in the next release; write r.boxes.xyxy instead"
)


class HostArray(np.ndarray):
    """An ndarray that answers the ``torch.Tensor`` calls Ultralytics scripts chain on results (all on the host).

    >>> a = np.array([0.5, 1.5], np.float32).view(HostArray)
    >>> a.cpu().numpy().tolist(), a.int().tolist(), type(a.numpy()).__name__, float(a[:1])
    ([0.5, 1.5], [0, 1], 'ndarray', 0.5)
    """

    def cpu(self) -> HostArray:
        """Already on the host: itself."""
        return self

    def detach(self) -> HostArray:
        """No autograd here: itself."""
        return self

    def numpy(self) -> np.ndarray:
        """The same values as a plain ndarray (no copy)."""
        return self.view(np.ndarray)

    def clone(self) -> HostArray:
        return self.copy()

    def int(self) -> HostArray:
        """As int32, as ``Tensor.int()`` gives."""
        return host(self.astype(np.int32))

    def long(self) -> HostArray:
        return host(self.astype(np.int64))

    def float(self) -> HostArray:
        """As float32, as ``Tensor.float()`` gives."""
        return host(self.astype(np.float32))

    def __float__(self) -> builtins.float:
        # float(box.conf) on a one-element array, as on a one-element tensor (numpy warns for ndim > 0)
        return float(self.reshape(-1)[0]) if self.size == 1 else float(self.view(np.ndarray))

    def __int__(self) -> builtins.int:
        return int(self.reshape(-1)[0]) if self.size == 1 else int(self.view(np.ndarray))


def host(a: np.ndarray) -> HostArray:
    """``a`` seen as a :class:`HostArray` (no copy)."""
    return a.view(HostArray)


class Boxes(NDArrayOperatorsMixin):
    """Detections of one picture: ``data`` (n, 6) (or (n, 7) with a track id before conf) and ``orig_shape``
    (height, width) in pixels, as Ultralytics' ``Boxes(boxes, orig_shape)`` takes them (a tensor is read to numpy).

    Indexing with an int, a slice, a mask or a list gives a ``Boxes``; iterating gives one ``Boxes`` per detection.
    """

    def __init__(self, boxes: Any, orig_shape: tuple[int, int]) -> None:
        if hasattr(boxes, "detach"):  # a torch tensor, as Ultralytics users build them
            boxes = boxes.detach().cpu().numpy()
        data = np.asarray(boxes)
        if data.ndim == 1:
            data = data[None, :]
        if data.ndim != 2 or data.shape[-1] not in (6, 7):
            raise ValueError(f"Boxes takes (n, 6) or (n, 7) rows (x1 y1 x2 y2 [track id] conf cls), not {data.shape}")
        self._data = data
        self.orig_shape = (int(orig_shape[0]), int(orig_shape[1]))

    # ------------------------------------------------------------------ Ultralytics' attributes
    @property
    def data(self) -> HostArray:
        """(n, 6): x1 y1 x2 y2 conf cls ((n, 7) with a track id before conf)."""
        return host(self._data)

    @property
    def is_track(self) -> bool:
        """Whether the rows carry a track id (detrain does not track: False unless built so)."""
        return self._data.shape[-1] == 7

    @property
    def xyxy(self) -> HostArray:
        """(n, 4) corners x1 y1 x2 y2 in the picture's pixels."""
        return host(self._data[:, :4])

    @property
    def conf(self) -> HostArray:
        """(n,) confidences."""
        return host(self._data[:, -2])

    @property
    def cls(self) -> HostArray:
        """(n,) class ids, as floats (``Results.cls`` holds them as int64)."""
        return host(self._data[:, -1])

    @property
    def id(self) -> HostArray | None:
        """(n,) track ids, or None: detrain does not track."""
        return host(self._data[:, -3]) if self.is_track else None

    @property
    def xywh(self) -> HostArray:
        """(n, 4) centre x, centre y, width, height in pixels."""
        b = self._data[:, :4]
        out = np.empty_like(b)
        out[:, 0] = (b[:, 0] + b[:, 2]) / 2
        out[:, 1] = (b[:, 1] + b[:, 3]) / 2
        out[:, 2] = b[:, 2] - b[:, 0]
        out[:, 3] = b[:, 3] - b[:, 1]
        return host(out)

    @property
    def xyxyn(self) -> HostArray:
        """:attr:`xyxy` divided by the picture's width (x) and height (y)."""
        return self._normalised(self._data[:, :4].copy())

    @property
    def xywhn(self) -> HostArray:
        """:attr:`xywh` divided by the picture's width (x, w) and height (y, h)."""
        return self._normalised(np.asarray(self.xywh))

    def _normalised(self, b: np.ndarray) -> HostArray:
        h, w = self.orig_shape
        b[:, [0, 2]] /= w
        b[:, [1, 3]] /= h
        return host(b)

    def cpu(self) -> Boxes:
        """Already on the host: itself (Ultralytics' copy on the CPU)."""
        return self

    def numpy(self) -> Boxes:
        """Already numpy: itself (Ultralytics' copy as numpy arrays)."""
        return self

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[Boxes]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, tuple):  # r.boxes[:, 0]: the old array's indexing
            return _old_array(self)[index]
        return Boxes(self._data[index], self.orig_shape)

    def __repr__(self) -> str:
        return f"Boxes(data={np.asarray(self._data)!r}, orig_shape={self.orig_shape})"

    # ------------------------------------------------------------------ the old (n, 4) array, deprecated
    @property
    def shape(self) -> tuple[int, ...]:
        """Deprecated: the old array's shape, (n, 4) (Ultralytics' ``Boxes.shape`` is ``data``'s, (n, 6))."""
        return _old_array(self).shape

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        a = _old_array(self)
        if dtype is not None:
            a = a.astype(dtype)
        return a.copy() if copy else a

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(x, Boxes) for x in kwargs.get("out", ())):
            return NotImplemented
        args = [_old_array(x) if isinstance(x, Boxes) else x for x in inputs]
        return getattr(ufunc, method)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # only reached for names Boxes lacks: the old array's (dtype, tolist, astype, max...) still answer
        if name.startswith("_") or not hasattr(np.ndarray, name):
            raise AttributeError(f"'Boxes' object has no attribute '{name}'")
        return getattr(_old_array(self), name)


def _old_array(boxes: Boxes) -> np.ndarray:
    """What ``r.boxes`` used to be, (n, 4) xyxy, with the deprecation said once."""
    deprecated("boxes-as-array", _ARRAY_USE, stacklevel=4)
    return boxes._data[:, :4].view(np.ndarray)
