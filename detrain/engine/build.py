"""Turning arguments into objects: the run folder (rank 0's, on every rank), the model, and the CPU threads of a
worker."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from detrain.config.keys import Output
from detrain.config.values import EXPORTED_SUFFIXES
from detrain.distributed import dist
from detrain.distributed.launch.devices import cpu_threads_per_worker
from detrain.errors import ConfigError
from detrain.system.tempfiles import folder_problem
from detrain.system.text import shown

if TYPE_CHECKING:
    from detrain.distributed.world import World
    from detrain.nn.model import DetectionModel


def increment_run_dir(project: str, name: str, task: str, exist_ok: bool) -> Path:
    """``runs/<task>/exp``, then ``exp2``, ``exp3``… unless ``exist_ok``."""
    root = Path(project) if project else Path("runs") / task
    base = name or "exp"
    path = root / base
    if exist_ok or not path.exists():
        return path
    n = 2
    while (root / f"{base}{n}").exists():
        n += 1
    return root / f"{base}{n}"


def agree_run_dir(output: Output, task: str, given: str | Path | None, is_main: bool) -> Path:
    """The run folder of every rank: ``given`` (the folder the launching process picked), else a new one
    (:func:`increment_run_dir` of the ``output`` keys), decided by rank 0 and sent to every rank: other nodes may
    not know the folder the launching node picked, and look at another disk. A collective: call it on every rank.
    A folder :func:`run_dir_problem` refuses is one ConfigError on every rank."""
    picked, problem = None, None
    if is_main:
        picked = str(given or increment_run_dir(output.project, output.name, task, output.exist_ok))
        problem = run_dir_problem(Path(picked))
    picked, problem = dist.broadcast_object((picked, problem))  # collective: rank 0's folder on every rank
    if problem is not None:
        raise ConfigError(problem)
    return Path(picked)


def run_dir_problem(path: Path) -> str | None:
    """Why the run folder ``path`` (reused with exist_ok=True or name=) must not receive a run's files: it or its
    ``weights/`` is a symbolic link (the files would land where the link points), not a folder, or another user's.

    >>> run_dir_problem(Path("runs/train/exp")) is None
    True
    """
    for folder in (path, path / "weights"):
        problem = folder_problem(folder)
        if problem is not None:
            return f"run folder refused: {shown(problem)}; remove it or choose another name= or project="
    return None


def check_output_folder(project: str, task: str, output: Output | None = None) -> None:
    """The run folder goes into ``project`` (or ``runs/<task>``): the nearest part of it that exists must be a
    folder, not a file. With ``output``'s exist_ok, the folder reused must pass :func:`run_dir_problem`.

    Example:
        >>> check_output_folder("", "train")
    """
    if output is not None and output.exist_ok:
        problem = run_dir_problem(increment_run_dir(project, output.name, task, True))
        if problem is not None:
            raise ConfigError(problem)
    root = Path(project) if project else Path("runs") / task
    for folder in (root, *root.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(f"invalid value for 'project': {project!r}; {str(folder)!r} is a file, not a folder")
            problem = _creation_problem(folder)
            if problem is not None:
                raise ConfigError(f"invalid value for 'project': {project!r}; cannot make a folder in {problem}")
            return


def _creation_problem(folder: Path) -> str | None:
    """Why no folder can be made inside the existing ``folder`` (the run folder's nearest existing ancestor), or
    None: a probe folder is made and removed at once, so permissions, read-only mounts and pseudo-filesystems
    (/proc) all answer as they would for the run."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".detrain-probe-", dir=folder))
    except OSError as e:
        return f"{str(folder)!r} ({e.strerror or e})"
    return None


def is_weights(model: str) -> bool:
    """True when ``model`` names weights (``.pt``) rather than an architecture yaml."""
    return str(model).endswith((".pt", ".pth"))


#: the commands that take an exported file for ``model=``
SERVES_EXPORTED = ("val", "predict")


def is_exported(model: str) -> bool:
    """True when ``model`` names an exported file (``.onnx``, ``.torchscript``, an OpenVINO ``..._openvino_model``
    folder or its ``.xml``): a fixed graph that val and predict run, but that cannot be trained or exported again.

    >>> is_exported("runs/train/exp/weights/best.onnx"), is_exported("best_openvino_model/"), is_exported("best.pt")
    (True, True, False)
    """
    return str(model).strip().rstrip("/").endswith(EXPORTED_SUFFIXES)


def check_exported(model: str, command: str) -> None:
    """The one line for an exported ``model`` given to a command that needs the model itself (train, export,
    info), or an exported file that is missing or a folder.

    >>> try:
    ...     check_exported("best.onnx", "train")
    ... except ConfigError as e:
    ...     print(str(e)[:60])
    model=best.onnx is an exported file: 'detrain train' needs t
    """
    if command not in SERVES_EXPORTED:
        raise ConfigError(
            f"model={shown(str(model))} is an exported file: 'detrain {command}' needs the weights it was exported "
            "from (.pt); exported files serve val and predict only"
        )
    if str(model).strip().rstrip("/").endswith(EXPORTED_SUFFIXES[2:]):
        return  # an OpenVINO folder or graph: detrain.engine.openvino_ir.ir_path checks it when it is read
    path = Path(model).expanduser()
    if path.is_dir():
        raise ConfigError(f"model={shown(str(model))} is a folder, not an exported file")
    if not path.is_file():
        raise ConfigError(f"exported model file not found: {shown(str(model))}")


def build_model(
    model: str,
    nc: int | None = None,
    names: dict[int, str] | None = None,
    verbose: bool = True,
    weights_sha256: str = "",
) -> tuple[DetectionModel, dict[str, Any] | None]:
    """A DetectionModel from an architecture yaml or weights, with its head fitted to ``nc`` classes.

    Returns (model, checkpoint dict or None). A yaml builds fresh weights: ``n.yaml`` (scale n of the
    packaged YOLOv8 architecture), ``yolov8s.yaml``, ``yolo11s.yaml`` (the packaged YOLO11 one), or a path to
    a yaml of the same format. Weights are
    found or downloaded by :func:`detrain.weights.hub.resolve_weights`, checked against ``weights_sha256``
    when it is given.
    """
    from detrain.nn.model import DetectionModel

    if is_weights(model):
        from detrain.weights.checkpoint import load_checkpoint, model_from_checkpoint
        from detrain.weights.hub import resolve_weights

        ckpt = load_checkpoint(resolve_weights(str(model), sha256=weights_sha256 or None))
        net = model_from_checkpoint(ckpt, source=str(model))
        if nc is not None and (net.nc != nc or (names is not None and dict(net.names) != dict(names))):
            if net.nc != nc:
                if verbose:
                    from detrain.log import console

                    console.print(
                        f"{model}: {net.nc} classes in the weights, {nc} in the dataset: keeping every "
                        "matching layer and re-initialising the classification outputs"
                    )
                net.reset_classes(nc, names or {i: str(i) for i in range(nc)})
            else:
                net.names = dict(names or {})
        return net, ckpt
    cfg, scale = architecture(model)
    return DetectionModel(cfg=cfg, scale=scale, nc=80 if nc is None else nc, names=names), None


def check_model(model: str, command: str = "predict") -> None:
    """Raise the error ``build_model`` would raise for a ``model`` that names nothing usable, without building
    the model or reading or downloading weights (an architecture yaml is read: it says the scale): commands
    call it before any process starts or any folder is made. An exported file (:func:`is_exported`) is usable by
    val and predict only (``command``)."""
    if is_exported(model):
        check_exported(model, command)
        return
    if not is_weights(model):
        architecture(model)
        return
    from detrain.errors import CheckpointError
    from detrain.weights.hub import canonical_name

    path = Path(model).expanduser()
    if path.is_dir():
        raise CheckpointError(f"weights '{model}' is a folder, not a .pt file (e.g. runs/train/exp/weights/best.pt)")
    if not path.is_file() and canonical_name(str(model)) is None:  # a release name (n.pt) is downloaded later
        raise CheckpointError(f"weights file not found: {model}")


def architecture(model: str) -> tuple[str, str]:
    """(architecture yaml, scale) of a bundled scale name (n.yaml, yolov8s.yaml, yolo11s.yaml: the packaged yaml
    of its family, unless a file of that name is here) or of an architecture yaml on disk; anything else is a
    ConfigError.

    The scale is the yaml's own ``scale:``, else the one a bundled name implies; a conflict between the two,
    or a yaml with several ``scales`` that names none, is a ConfigError (see :func:`detrain.nn.model.choose_scale`).
    A yaml on disk is checked as the builder would check it (:func:`detrain.nn.model.check_architecture`): a
    field of the wrong type or beyond a bound is one line here, before any process starts.
    """
    from detrain.nn.model import bundled_scale, check_architecture, choose_scale, load_model_yaml, packaged_architecture

    path = Path(model)
    named = bundled_scale(path)
    if named and not path.is_file():
        return str(packaged_architecture(path)), named
    if path.suffix in (".yaml", ".yml") and path.is_file():
        d, named = load_model_yaml(path)
        scale = choose_scale(d, named, str(path))
        check_architecture(d, scale, shown(str(path)))  # every field typed and bounded; nothing is built
        return str(path), scale
    raise ConfigError(
        f"model '{model}' not found; use a scale yaml (n.yaml, s.yaml, m.yaml, l.yaml, x.yaml, yolov8n.yaml, "
        "yolo11n.yaml), "
        "a path to an architecture yaml, or weights (.pt)"
    )


def set_cpu_threads(device: torch.device, world: World) -> None:
    """On the CPU, unless the user or the launcher set OMP_NUM_THREADS (``world.omp_threads``): this worker's share
    of the cores (:func:`detrain.distributed.launch.devices.cpu_threads_per_worker` for the ranks on its node)."""
    threads = None if world.omp_threads else cpu_threads_per_worker(world.local_world_size)
    if device.type == "cpu" and threads is not None:
        torch.set_num_threads(threads)
