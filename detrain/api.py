"""The Python API: the same engine as the CLI, with Ultralytics' names for what it returns (numpy inside).

>>> from detrain import Model
>>> model = Model("n.yaml")                                   # a fresh YOLOv8n-layout model
>>> model.add_callback("on_fit_epoch_end", lambda e: print(e.epoch, e.metrics.get("metrics/mAP50")))

Then (minutes of training, so not run as a test)::

    metrics = model.train(data="shapes.yaml", epochs=3, imgsz=160, device="cpu")
    metrics.box.map, metrics.box.map50, metrics.results_dict, metrics.save_dir
    results = Model("runs/train/exp/weights/best.pt").predict("images/")
    r = results[0]
    r.boxes.xyxy, r.boxes.conf, r.boxes.cls, r.plot(), r.to_json()
    for r in Model("best.pt").predict("clip.mp4", stream=True): ...  # one frame at a time
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from detrain.config.cfg import command_values, make_cfg
from detrain.config.values import ImageSize, image_hw, note
from detrain.engine.build import build_model, check_exported, increment_run_dir, is_exported, is_weights
from detrain.engine.predict.results import Results
from detrain.engine.train.callbacks import CallbackFn, check_event
from detrain.errors import ConfigError
from detrain.metrics.det_metrics import DetectionMetrics

if TYPE_CHECKING:
    from detrain.nn.info import ModelInfo


class Model:
    """A detector from an architecture yaml (``n.yaml`` … ``x.yaml``), weights (detrain or YOLOv8 ``.pt``), or a
    file ``export()`` wrote (``.onnx``, ``.torchscript``: :meth:`val` and :meth:`predict` only, at the input size
    it was exported at).

    ``Model("missing.pt")`` raises :class:`detrain.errors.CheckpointError` naming the file.
    ``weights_sha256`` is the sha256 the weights must have (as the ``weights_sha256`` key): needed to
    download a bare name detrain holds no hash for, and checked against any weights file when given.
    """

    def __init__(self, model: str | Path = "n.yaml", weights_sha256: str = "") -> None:
        self.source = str(model)
        self.net: Any
        self.ckpt: dict[str, Any] | None
        if is_exported(self.source):  # an exported file serves val and predict (detrain.engine.backends)
            from detrain.engine.backends import export_summary

            self.net, self.ckpt = export_summary(self.source), None  # what it records; loaded when it serves
        else:
            self.net, self.ckpt = build_model(self.source, verbose=False, weights_sha256=weights_sha256)
        self._prepared: tuple[torch.nn.Module, tuple[Any, ...], torch.nn.Module] | None = None
        self.callbacks: dict[str, list[CallbackFn]] = {}
        # the data val() takes when none is given, as Ultralytics: what this Model trained on, else its checkpoint's
        self._data: str | None = _trained_on(self.ckpt)

    def __call__(self, source: Any, stream: bool = False, **kwargs: Any) -> list[Results] | Iterator[Results]:
        """``model(source)`` is :meth:`predict`, as in Ultralytics."""
        return self.predict(source, stream=stream, **kwargs)

    @property
    def names(self) -> dict[int, str]:
        return dict(self.net.names)

    def add_callback(self, event: str, fn: Callable[..., Any]) -> None:
        """Call ``fn(info)`` (``info``: a :class:`~detrain.engine.train.callbacks.TrainEvent`) at ``event`` of every
        later
        ``train()``, after the callbacks added before it. The events (Ultralytics' names):
        ``on_pretrain_routine_start``, ``on_pretrain_routine_end``, ``on_train_start``, ``on_train_epoch_start``,
        ``on_train_epoch_end``, ``on_model_save``, ``on_fit_epoch_end``, ``on_train_end``
        (see :mod:`detrain.engine.train.callbacks`).

        They run on rank 0 only, in the process that trains it. Training on several workers (``device="cpu,cpu"``,
        ``[0, 1]``) sends them to the spawned workers by reference, so there ``fn`` must be a function defined
        with ``def`` at the top level of an importable module: a lambda or a closure is refused when such a
        ``train()`` starts. A callback that raises stops the run with its exception; the epoch's last.pt is
        already written at ``on_model_save`` and ``on_fit_epoch_end``. ``detrain train`` has no callbacks.
        """
        check_event(event)
        if not callable(fn):
            raise ConfigError(
                f"add_callback({event!r}, {fn!r}): the callback must be callable (a function of one "
                "argument, the TrainEvent)"
            )
        self.callbacks.setdefault(event, []).append(fn)

    def train(self, **kwargs: Any) -> DetectionMetrics | None:
        """Train with the CLI's keys; ``device=[0, 1]`` or ``"cpu,cpu"`` trains on several workers.

        As in Ultralytics: ``cfg="args.yaml"`` reads keys from a yaml beneath the keywords given here and this
        Model's own model (see :func:`detrain.config.cfg.make_cfg`); ``task="detect"`` and ``mode="train"`` are
        accepted; ``batch=-1`` or a fraction picks the largest batch that fits each GPU (AutoBatch).

        Returns the final validation as a :class:`~detrain.metrics.det_metrics.DetectionMetrics` (Ultralytics'
        shape: ``.box.map``, ``.box.map50``, ``.results_dict``, ``.speed``, ``.save_dir``); afterwards this Model
        holds the best weights. The callbacks of :meth:`add_callback` fire on rank 0 during the run. On a node
        other than node 0 of a multi-node run (``node_rank > 0``), which holds neither the metrics nor the run
        folder, it returns None.
        """
        cfg = make_cfg({"model": self.source, **kwargs}, "train")
        self._refuse_exported("train")  # one line here, before anything starts
        from detrain.run.task import run_task

        result = run_task("train", cfg, self.callbacks)
        if result is None:
            return None
        self._data = cfg.inputs.data
        best = Path(result["save_dir"]) / "weights" / "best.pt"
        if best.is_file():
            self.source = str(best)
            self.net, self.ckpt = build_model(self.source, verbose=False)
        return DetectionMetrics.from_results(result, self.names)

    def val(self, **kwargs: Any) -> DetectionMetrics | None:
        """Validate (COCO-exact metrics) with the CLI's keys; returns a
        :class:`~detrain.metrics.det_metrics.DetectionMetrics` as :meth:`train` does (None on a node other than
        node 0 of a multi-node run). Without ``data`` (here or in a ``cfg=`` file), the data this Model trained on,
        or that its checkpoint records, as Ultralytics does."""
        if self._data and "data" not in command_values(kwargs, "val"):
            kwargs = {"data": self._data, **kwargs}
        cfg = make_cfg({"model": self.source, **kwargs}, "val")
        from detrain.run.task import run_task

        result = run_task("val", cfg)
        return None if result is None else DetectionMetrics.from_results(result, self.names)

    def predict(self, source: Any, stream: bool = False, **kwargs: Any) -> list[Results] | Iterator[Results]:
        """Detections per picture, as :class:`~detrain.engine.predict.results.Results` (path, frame, orig_shape,
        ``boxes``: Ultralytics' ``xyxy``/``xywh``/``xyxyn``/``xywhn``/``conf``/``cls`` as numpy arrays; conf, cls,
        names; ``.plot()`` draws them, ``.to_json()``, ``.save_txt()``, ``.save()``), in the source's order.

        ``source``: an image, a video, a folder, a glob, a ``.txt`` list, a camera index, a stream URL, a list of
        paths, or BGR image arrays (one, or a list). ``stream=True`` returns a generator that reads, predicts and
        yields one picture at a time, for videos and cameras. Takes the CLI's keys (``conf``, ``classes``,
        ``batch``, ``device``, ``half``...); unlike the CLI it writes files only with ``save=True`` or
        ``save_txt=True``. The weights are not changed: inference runs on a prepared copy, kept for the next call
        while the weights stay as they are.
        """
        from detrain.engine.predict.predictor import inference_device, stream_predict

        kwargs.setdefault("save", False)
        text = source if isinstance(source, (str, Path, int)) and not isinstance(source, bool) else None
        cfg = make_cfg({"model": self.source, "source": "" if text is None else str(text), **kwargs}, "predict")
        device, half = inference_device(cfg, note=False)
        results = stream_predict(
            cfg,
            self._inference_net(device, half, cfg.inputs.trust_export),
            None if text is not None else source,
            prepared=True,
            collecting=not stream,
            device=device,
        )
        return results if stream else list(results)

    def _inference_net(self, device: torch.device, half: bool, trust: bool = False) -> torch.nn.Module:
        """A fused copy of ``self.net`` on ``device`` for predict; made again when the weights change (another
        net, new names, or any parameter or buffer written since: every tensor's version is part of the key). An
        exported file is loaded here, its TorchScript code checked first unless ``trust`` (``trust_export``)."""
        from detrain.engine.predict.predictor import prepare_model

        if is_exported(self.source):  # a graph's constants move with torch.jit.load's map_location only
            from detrain.engine.backends import load_exported

            if self._prepared is None or self._prepared[1] != (str(device), trust):
                self._prepared = (self.net, (str(device), trust), load_exported(self.source, device, trust))
            return self._prepared[2]
        key = (
            str(device),
            half,
            tuple(sorted(dict(self.net.names).items())),
            tuple(t._version for t in self.net.state_dict(keep_vars=True).values()),
        )
        if self._prepared is None or self._prepared[0] is not self.net or self._prepared[1] != key:
            self._prepared = (self.net, key, prepare_model(self.net, device, half))
        return self._prepared[2]

    def info(self, imgsz: int | list[int] = 640, verbose: bool = True) -> ModelInfo:
        """Layers, parameters (as is and fused), gradients, GFLOPs at ``imgsz``, strides and classes.

        With ``verbose`` the per-layer table (index, from, repeats, params, module, arguments, GFLOPs) and
        a summary line are printed too. An ``imgsz`` that is no multiple of 32 is rounded up to one with a
        warning line, as for every command.

        >>> info = Model("n.yaml").info(imgsz=640, verbose=False)
        >>> info.params, info.fused_params, round(info.gflops, 1), info.stride, info.nc
        (3157200, 3151904, 8.7, (8, 16, 32), 80)
        """
        from detrain.nn.info import model_info, print_info

        cfg = make_cfg({"model": self.source, "imgsz": imgsz, "verbose": verbose}, "info")
        self._refuse_exported("info")
        report = model_info(self.net, image_hw(cfg.inputs.imgsz))
        if cfg.output.verbose:
            print_info(report, title=self.source)
        return report

    def export(self, **kwargs: Any) -> Path:
        """Export to ONNX (``format=onnx``, ``opset``, ``dynamic``, ``half``: a float16 graph), TorchScript
        (``format=torchscript``) or OpenVINO IR (``format=openvino``, ``dynamic``; ``half``: float16 weights) at
        ``imgsz``, by default the size the weights were trained at (640 for a yaml); returns the file's path: beside
        ``.pt`` weights
        (``best.onnx``, ``best.torchscript``, the folder ``best_openvino_model``), else
        ``runs/export/exp*/model.<suffix>`` (``model_openvino_model``). Names, stride, imgsz, batch and the kind of
        output go into the file's metadata."""
        from detrain.engine.export import SUFFIXES, export_model
        from detrain.engine.openvino_ir import export_openvino, openvino_folder

        cfg = make_cfg({"model": self.source, **kwargs}, "export")
        self._refuse_exported("export")
        openvino = cfg.export.format == "openvino"
        if cfg.predict.half and cfg.export.format == "torchscript":  # Ultralytics, exporting on a CPU, does so too
            note("note: half=True: a TorchScript export is traced on the CPU in float32; the graph is float32")
        given_imgsz = "imgsz" in command_values(kwargs, "export")  # a cfg= file's imgsz counts as given
        imgsz = export_size(cfg.inputs.imgsz) if given_imgsz else None  # None: the weights' own training size
        stem = (
            Path(self.source)
            if is_weights(self.source)
            else increment_run_dir(cfg.output.project, cfg.output.name, "export", cfg.output.exist_ok) / "model.pt"
        )
        if openvino:
            out = openvino_folder(stem)
            return export_openvino(self.net, out, imgsz, cfg.export.dynamic, cfg.predict.nms, cfg.predict.half)
        return export_model(
            self.net,
            stem.with_suffix(SUFFIXES[cfg.export.format]),
            format=cfg.export.format,
            imgsz=imgsz,
            opset=cfg.export.opset,
            dynamic_batch=cfg.export.dynamic,
            nms=cfg.predict.nms,
            half=cfg.predict.half,
        )

    def _refuse_exported(self, command: str) -> None:
        """The one line for ``command`` on an exported file, which serves val and predict only."""
        if is_exported(self.source):
            check_exported(self.source, command)

    def __repr__(self) -> str:
        if is_exported(self.source):
            return f"Model({self.source!r}: exported {self.net.format}, {self.net.nc} classes)"
        return f"Model({self.source!r}: scale {self.net.scale}, {self.net.nc} classes)"


def export_size(imgsz: int) -> int | tuple[int, int]:
    """What export traces at for an ``imgsz``: a rectangle's (h, w), else the one size."""
    return imgsz.hw if isinstance(imgsz, ImageSize) else imgsz


def _trained_on(ckpt: dict[str, Any] | None) -> str | None:
    """The dataset a detrain checkpoint's run trained on (its ``train_args``), if it records one as text.

    >>> _trained_on({"train_args": {"data": "coco8.yaml"}}), _trained_on({"train_args": None}), _trained_on(None)
    ('coco8.yaml', None, None)
    """
    args = (ckpt or {}).get("train_args")
    data = args.get("data") if isinstance(args, dict) else None
    return data if isinstance(data, str) and data.strip() else None
