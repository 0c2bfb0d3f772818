"""Checkpoints: atomic save, safe load, and the model they hold.

A detrain checkpoint is a plain dict of tensors, numbers, strings and containers, so it loads with
``torch.load(weights_only=True)``: nothing in it can run code. Ultralytics files (YOLOv8, YOLO11, YOLO26) are read by
the restricted unpickler in :mod:`detrain.weights.ultralytics` and converted on the fly; the model is built
from the architecture a file records, and a file whose weights do not fit it is refused in one line.

>>> from detrain.nn.model import DetectionModel
>>> net = DetectionModel(nc=2, names={0: "cat", 1: "dog"})
>>> path = save_checkpoint({"model": {**model_meta(net, 64), "state_dict": net.state_dict()}, "ema": None}, "best.pt")
>>> model = model_from_checkpoint(load_checkpoint(path)); model.scale, model.names
('n', {0: 'cat', 1: 'dog'})
"""

from __future__ import annotations

import datetime as _dt
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from detrain import __version__
from detrain.errors import CheckpointError, ConfigError
from detrain.system.input_file import read_input, reason_of
from detrain.system.tempfiles import UnsafePath, atomic_file, keep_generation
from detrain.system.text import excerpt
from detrain.weights import limits

if TYPE_CHECKING:
    from detrain.nn.model import DetectionModel

FORMAT = "detrain-checkpoint"
PREVIOUS = "last.prev.pt"  # the generation of last.pt before the latest (save_checkpoint's keep_previous)


def save_checkpoint(state: dict[str, Any], path: str | Path, keep_previous: str | None = None) -> Path:
    """Write ``state`` to ``path`` atomically: a temporary file in the same folder, fsync, then rename; the folder
    is entered without following a symbolic link (a planted ``weights/`` link receives nothing). Weights or an EMA
    holding NaN or infinity are refused (one line; nothing is written).

    ``keep_previous``: a name in ``path``'s folder (``last.prev.pt``, :data:`PREVIOUS`) that first takes the file
    ``path`` holds now, a generation to fall back to when ``path`` is later found damaged (a hard link: no copy).

    A crash or a full disk never leaves a half-written ``last.pt``: either the old file or the new one exists.
    A write that fails (a full disk, an I/O error, a read-only folder) is one line naming the file and why, the
    previous file untouched (CheckpointError); a killed write's temporary file goes at the next start
    (:func:`detrain.system.tempfiles.remove_unfinished`).
    """
    path = Path(path)
    check_finite(state, path, writing=True)  # the last line of defence: a diverged run's weights are never kept
    state = {
        "format": FORMAT,
        "version": __version__,
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        **state,
    }
    try:
        if keep_previous:
            keep_generation(path, keep_previous)
        with atomic_file(path, sync=True) as f:  # weights/ is entered without following a link
            torch.save(state, f)
    except UnsafePath:
        raise
    except (OSError, RuntimeError) as e:  # torch's zip writer may turn a failed write into a RuntimeError
        cause = _os_error(e)
        if cause is None:
            raise
        kept = f"the previous {path.name} is intact" if path.is_file() else f"no {path.name} was written"
        raise CheckpointError(f"cannot write {path}: {cause.strerror or cause}; {kept}") from None
    return path


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (itself, or one it was raised while handling: ENOSPC, EIO, EROFS...), if any."""
    seen: BaseException | None = e
    for _ in range(8):
        if seen is None or isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a detrain checkpoint, or convert an Ultralytics one, without running anything in it.

    Every file is first read by the restricted reader (:mod:`detrain.weights.safe_pickle`), which checks
    the zip, the pickle and every size it declares and refuses anything a checkpoint does not need, so no
    file reaches torch's own loader unvetted. The file is read once: the check and torch's loader read the same
    bytes, whatever happens to the file meanwhile. An Ultralytics file is converted from what that reader built;
    a detrain file is then loaded by ``torch.load(weights_only=True)`` from those bytes.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file not found: {path}")
    from detrain.weights import ultralytics as ul

    data = _read_once(path)  # checked and loaded from these bytes: the file may change on disk meanwhile
    vetted = ul.read_torch_zip(path, data)  # CheckpointError for anything refused; nothing in the file runs
    if _is_detrain(vetted):
        del vetted  # torch.load builds the real thing; the two need not live side by side
        try:
            ckpt = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch says why (unsafe global, truncated zip) on its last line
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"cannot load weights file {path}: {reason[:300]}") from None
        if _is_detrain(ckpt):
            _check_detrain(ckpt, path)
            check_stored_apart(ckpt, path)
            check_finite(ckpt, path)
            return ckpt
    elif ul.is_ultralytics_record(vetted):  # pickled Ultralytics classes, as inert records
        converted = from_ultralytics(ul.ultralytics_info(vetted, path))
        check_stored_apart(converted, path)
        check_finite(converted, path)
        return converted
    raise CheckpointError(
        f"{path} is not a detrain checkpoint (nor an Ultralytics one); make one with 'detrain train' or "
        "'detrain convert'"
    )


def _read_once(path: Path) -> bytes:
    """The whole file, read once (a regular file: a FIFO or device is refused) and capped at what the checks
    could ever accept."""
    try:
        return read_input(path, limits.MAX_TOTAL_BYTES + limits.MAX_PICKLE_BYTES + limits.INFLATION_SLACK)
    except OSError as e:
        raise CheckpointError(f"cannot load weights file {path}: {reason_of(e)}") from None


def _is_detrain(ckpt: Any) -> bool:
    return isinstance(ckpt, dict) and isinstance(ckpt.get("format"), str) and ckpt["format"] == FORMAT


def _check_weights(entry: Any, where: str, path: Path) -> None:
    state = entry.get("state_dict") if isinstance(entry, dict) else None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{path} says it is a detrain checkpoint but its {where} has no state_dict of tensors")


def _check_detrain(ckpt: dict[str, Any], path: Path) -> None:
    """The entries every user of a checkpoint reads (the model's weights and description) have their types."""
    _check_weights(ckpt.get("model"), "'model'", path)
    meta = ckpt["model"]
    nc, imgsz, yaml = meta.get("nc"), meta.get("imgsz"), meta.get("yaml")
    if not (
        isinstance(meta.get("scale"), str)
        and type(nc) is int
        and nc > 0
        and isinstance(meta.get("names"), dict)
        and (imgsz is None or type(imgsz) is int)
        and (yaml is None or isinstance(yaml, (str, dict)))
    ):
        raise CheckpointError(
            f"{path} says it is a detrain checkpoint but its model description (scale, nc, names, "
            "imgsz, yaml) has the wrong types"
        )
    from detrain.nn.model import class_names, is_packaged_name

    problem = None if imgsz is None else limits.imgsz_problem(imgsz)
    if problem is not None:  # before any export traces, or any cost is counted, at that size
        raise CheckpointError(
            f"{path}: its model description records {problem}; detrain loads weights recorded at a size it runs"
        )
    if isinstance(yaml, str) and not is_packaged_name(yaml):  # a path would make detrain open (and so probe) it
        raise CheckpointError(
            f"{path}: its model description names the architecture {excerpt(yaml, 60)}; a checkpoint records its "
            "architecture as a mapping or a packaged name (yolov8n.yaml, yolo11s.yaml, yolo26.yaml), never a file"
        )
    try:
        class_names(meta["names"])
    except ConfigError as e:
        raise CheckpointError(f"{path}: its {e}") from None
    if ckpt.get("ema") is not None:
        _check_weights(ckpt["ema"], "'ema'", path)


def check_finite(ckpt: dict[str, Any], path: str | Path, writing: bool = False) -> None:
    """A one-line CheckpointError naming the first floating-point weight of the model or EMA state dict that holds
    NaN or infinity: such weights load without complaint and make training fail far from the cause (in the
    assigner, after the first forward). Costs one pass over the weights (``torch.isfinite``). ``writing``: the
    check before a save (:func:`save_checkpoint`), which then writes nothing.

    >>> check_finite({"model": {"state_dict": {"w": torch.tensor([1.0, float("nan")])}}}, "a.pt")
    Traceback (most recent call last):
    ...
    detrain.errors.CheckpointError: a.pt: weight w of its 'model' holds NaN or infinite values ...
    """
    for where in ("model", "ema"):
        entry = ckpt.get(where)
        state = entry.get("state_dict") if isinstance(entry, dict) else None
        for key, tensor in (state or {}).items():
            floating = isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
            if floating and not bool(torch.isfinite(tensor).all()):
                if writing:
                    raise CheckpointError(
                        f"refusing to write {path}: weight {_printable(key)} of its '{where}' holds NaN or infinite "
                        "values; the previous checkpoint is kept"
                    )
                raise CheckpointError(
                    f"{path}: weight {_printable(key)} of its '{where}' holds NaN or infinite values (a damaged file "
                    "or a diverged run); detrain loads only finite weights"
                )


def check_stored_apart(ckpt: dict[str, Any], path: str | Path) -> None:
    """A one-line CheckpointError naming the first weight of the model or EMA state dict whose bytes other weights
    of it claim too: the weights of a state dict may need no more bytes than the file stores for them, storage by
    storage. Views of one stored tensor cost the file nothing: 19 MB of them built a model of 267 million
    parameters (2.8 GB once made float). Weights that share a storage without overlapping (slices of one tensor)
    still load; detrain's and Ultralytics' files share none. Reads only sizes: no tensor is touched.

    >>> flat = torch.zeros(6)
    >>> check_stored_apart({"model": {"state_dict": {"a": flat[:3], "b": flat[3:]}}}, "a.pt")
    >>> check_stored_apart({"model": {"state_dict": {"a": flat, "b": flat.view(2, 3)}}}, "b.pt")
    Traceback (most recent call last):
    ...
    detrain.errors.CheckpointError: b.pt: weight b of its 'model' shares its stored bytes with other weights ...
    """
    for where in ("model", "ema"):
        entry = ckpt.get(where)
        state = entry.get("state_dict") if isinstance(entry, dict) else None
        tensors = {k: t for k, t in (state or {}).items() if isinstance(t, torch.Tensor) and t.numel()}
        key = _first_overlap(tensors)
        if key is not None:
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            stored = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
            raise CheckpointError(
                f"{path}: weight {_printable(str(key))} of its '{where}' shares its stored bytes with other weights "
                f"(overlapping views of one stored tensor): its weights need {limits.size_text(need)} where the file "
                f"stores {limits.size_text(sum(stored.values()))}; detrain loads only weights stored apart"
            )


def _first_overlap(tensors: dict[Any, torch.Tensor]) -> Any:
    """The first key at which the weights viewing one storage need more bytes than it holds, or None."""
    used: dict[int, int] = {}  # bytes the weights viewing each storage need, by the storage's address
    for key, tensor in tensors.items():
        storage = tensor.untyped_storage()
        at = storage.data_ptr()
        used[at] = used.get(at, 0) + tensor.numel() * tensor.element_size()
        if used[at] > storage.nbytes():
            return key
    return None


def from_ultralytics(info: dict[str, Any]) -> dict[str, Any]:
    """Turn :func:`detrain.weights.ultralytics.ultralytics_info`'s dict into a detrain checkpoint.

    The model is described by the architecture yaml the file recorded, so a YOLO11 file builds YOLO11 and a
    YOLO26 file YOLO26 (and a file of a kind detrain cannot build is refused when its model is built, naming what
    it does not know).
    """
    from detrain.nn.model import family

    names = {int(k): str(v) for k, v in info["names"].items()}
    return {
        "format": FORMAT,
        "version": __version__,
        "model": {
            "yaml": info["yaml"],
            "scale": info["scale"],
            "nc": int(info["nc"]),
            "names": names,
            "imgsz": int(info.get("imgsz") or 640),
            "state_dict": info["state_dict"],
        },
        "ema": None,
        "epoch": -1,
        "source": family(info["yaml"]),
    }


def model_from_checkpoint(ckpt: dict[str, Any], use_ema: bool = True, source: str = "checkpoint") -> DetectionModel:
    """Build the DetectionModel a checkpoint describes and load its weights (the EMA ones when present).

    An architecture detrain cannot build (an unknown module, an argument or key it does not follow, a cost of
    more than :data:`detrain.nn.info.MAX_GFLOPS` an image at the size it records) or weights that do not fit it are
    a one-line CheckpointError that starts with ``source`` (the file, for the user) and names what does not fit:
    the module, the cost, or the first keys with their shapes.
    """
    from detrain.nn.info import check_cost
    from detrain.nn.yaml_plan import plan_layers

    meta = ckpt["model"]
    ema = ckpt.get("ema")
    state = ema["state_dict"] if (use_ema and ema) else meta["state_dict"]
    try:
        # Shapes first, on the meta device (nothing allocated): the architecture came from the file, and only a
        # model whose every tensor the file holds is built for real, so a small file cannot ask for a huge one.
        with torch.device("meta"):
            shell = _described_model(meta)
        check_fits(shell, state, source)
        # and what one image costs it at the size it records, bounded as its parameters are (nn.info.check_cost)
        check_cost(shell, meta.get("imgsz"), plan_layers(dict(shell.yaml), shell.scale, shell.nc).head_strides)
        model = _described_model(meta)
    except ConfigError as e:
        raise CheckpointError(f"{source}: detrain cannot build the model it records: {e}") from None
    load_weights(model, {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, source)
    model.imgsz = int(meta.get("imgsz") or 640)
    return model


def _described_model(meta: dict[str, Any]) -> DetectionModel:
    from detrain.nn.model import DetectionModel

    cfg = meta.get("yaml") or "yolov8.yaml"
    return DetectionModel(cfg=cfg, scale=meta["scale"], nc=meta["nc"], names=meta["names"])


def load_weights(model: DetectionModel, state: dict[str, Any], source: str = "checkpoint") -> None:
    """``model.load_state_dict(state)`` once :func:`check_fits` found every key with its shape (a one-line
    CheckpointError naming the key and both shapes otherwise, never torch's multi-line report)."""
    check_fits(model, state, source)
    model.load_state_dict(state)


def check_fits(model: DetectionModel, state: dict[str, Any], source: str = "checkpoint") -> None:
    """A one-line CheckpointError unless ``state`` has exactly ``model``'s keys with its shapes and kinds of values
    (floating point or not); it names the first three differences (a missing key and the shape expected, a key of
    another shape or kind, a key the model lacks).

    >>> from detrain.nn.model import DetectionModel
    >>> state = DetectionModel(nc=2).state_dict(); del state["model.0.conv.weight"]
    >>> check_fits(DetectionModel(nc=2), state, "a.pt")
    Traceback (most recent call last):
    ...
    detrain.errors.CheckpointError: a.pt does not fit the yolov8 n model with nc=2: missing model.0.conv.weight ...
    """
    ours = model.state_dict()
    problems: list[str] = []
    for key, ref in ours.items():
        if key not in state:
            problems.append(f"missing {key} (expected shape {tuple(ref.shape)})")
        elif not isinstance(state[key], torch.Tensor):
            problems.append(f"{key} is a {type(state[key]).__name__}, not a tensor")
        elif tuple(state[key].shape) != tuple(ref.shape):
            problems.append(f"{key} has shape {tuple(state[key].shape)}, expected {tuple(ref.shape)}")
        elif state[key].is_floating_point() != ref.is_floating_point():
            kind = "a floating-point" if ref.is_floating_point() else "an integer"
            problems.append(f"{key} holds {state[key].dtype}, expected {kind} type")
    problems += [f"unexpected {_printable(key)}" for key in state if key not in ours]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"{source} does not fit the {model.family} {model.scale} model with nc={model.nc}: "
            f"{'; '.join(problems[:3])}{more}"
        )


def _printable(key: str) -> str:
    """A key from a file, shown on one line and briefly whatever it holds."""
    text = key if key.isprintable() else repr(key)
    return text if len(text) <= 80 else text[:77] + "..."


def model_meta(model: DetectionModel, imgsz: int) -> dict[str, Any]:
    """What a checkpoint records about a model besides its weights."""
    return {
        "yaml": getattr(model, "yaml", None),
        "scale": model.scale,
        "nc": model.nc,
        "names": dict(model.names),
        "imgsz": int(imgsz),
    }
