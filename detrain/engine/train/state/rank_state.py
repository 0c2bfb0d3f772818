"""What differs between ranks (their random generators), gathered to rank 0 as bytes, not pickles.

A checkpoint gives every rank back its own generators
(:func:`detrain.engine.train.state.resume_state.gather_per_rank`; BatchNorm statistics are rank 0's on every rank:
:func:`detrain.distributed.parallel.share_main_buffers`). Only rank 0 writes the checkpoint, so only rank 0 needs
them: each rank packs its state into one flat ``uint8`` tensor laid out by the structure every rank shares (the same
generators), and one ``gather`` brings them to rank 0, which unpacks each against its own structure. A rank other
than 0 receives nothing, however large the world; no rank unpickles what another sent.

The structure: nested dicts (sorted keys), lists and tuples whose leaves are tensors (their raw bytes), ints
(int64), floats or None (a flag and a float64: ``random.getstate()``'s cached Gaussian is either) and strings
(numpy's generator name: every rank's is rank 0's).

>>> import random
>>> state = {"python": random.getstate(), "t": torch.arange(3.0)}
>>> back = unpack(pack(state), state)
>>> back["python"] == state["python"], back["t"].tolist()
(True, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import struct
from typing import Any

import torch


def pack(state: Any) -> torch.Tensor:
    """``state`` as one flat uint8 tensor (see the module), on the CPU."""
    parts: list[bytes] = []
    _pack(state, parts)
    data = b"".join(parts)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def packed_size(state: Any) -> int:
    """The bytes :func:`pack` makes of ``state`` (every rank's are as many: same structure, same shapes)."""
    return int(pack(state).numel())


def unpack(data: torch.Tensor, like: Any) -> Any:
    """The state :func:`pack` packed into ``data``, rebuilt with the structure (and the strings) of ``like``."""
    raw = data.cpu().numpy().tobytes()
    value, end = _unpack(raw, 0, like)
    if end != len(raw):
        raise ValueError(f"a rank's state holds {len(raw)} bytes, {end} expected: the ranks' structures differ")
    return value


def _pack(value: Any, out: list[bytes]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value):
            _pack(value[key], out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _pack(item, out)
    elif isinstance(value, int):
        out.append(struct.pack("<q", int(value)))
    elif value is None or isinstance(value, float):
        out.append(struct.pack("<qd", value is not None, 0.0 if value is None else value))
    elif isinstance(value, str):
        pass  # the same on every rank: rank 0's is used
    else:
        raise TypeError(f"cannot pack a {type(value).__name__} of a rank's state")


def _unpack(raw: bytes, at: int, like: Any) -> tuple[Any, int]:
    try:
        return _unpack_one(raw, at, like)
    except struct.error:
        raise ValueError("a rank's state ends early: the ranks' structures differ") from None


def _unpack_one(raw: bytes, at: int, like: Any) -> tuple[Any, int]:
    if isinstance(like, torch.Tensor):
        n = like.numel() * like.element_size()
        chunk = bytearray(raw[at : at + n])
        if len(chunk) != n:
            raise ValueError("a rank's state ends early: the ranks' structures differ")
        flat = torch.frombuffer(chunk, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        return flat.view(like.dtype).reshape(like.shape).clone(), at + n
    if isinstance(like, dict):
        out = {}
        for key in sorted(like):
            out[key], at = _unpack(raw, at, like[key])
        return out, at
    if isinstance(like, (list, tuple)):
        items = []
        for item in like:
            value, at = _unpack(raw, at, item)
            items.append(value)
        return (tuple(items) if isinstance(like, tuple) else items), at
    if isinstance(like, int):
        (number,) = struct.unpack_from("<q", raw, at)
        return (bool(number) if isinstance(like, bool) else number), at + 8
    if like is None or isinstance(like, float):
        present, number = struct.unpack_from("<qd", raw, at)
        return (number if present else None), at + 16
    if isinstance(like, str):
        return like, at
    raise TypeError(f"cannot unpack a {type(like).__name__} of a rank's state")
