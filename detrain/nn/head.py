"""The head seam: what the rest of detrain may ask of a detection head, the one registry of heads, and the loss
template every head's criterion follows.

A head is the last layer of a model yaml; its row's module name picks its class from the registry
(:func:`register_head`, :func:`head_class`): ``Detect`` (YOLOv8's and YOLO11's, :class:`detrain.nn.modules.Detect`)
and ``DetectE2E`` (YOLO26's end-to-end one, :class:`detrain.nn.head_e2e.DetectE2E`; Ultralytics' YOLO26 yamls name
it ``Detect`` under ``end2end: True``, which builds it too). A head answers, as :class:`Head`, everything the rest
asks, so that nothing outside ``nn/`` names a head (``tests/unit/test_head_seam.py``):

* the builder: :meth:`Head.from_row`, the head from its planned yaml row (:class:`HeadRow`), on the meta device
  too (the plan counts its parameters that way before anything is allocated);
* the trainer: its **criterion** (:meth:`Head.criterion`, a :class:`Criterion`), built from its **loss gains**
  (:attr:`Head.loss_gains`: each gain's name and default; the run's loss section gives the values it holds,
  :func:`head_gains`), and its **loss item names** (:attr:`Head.loss_names`: the progress columns and results.csv's
  ``train/<name>``);
* the validator and predictor: its **postprocess** (:meth:`Head.postprocess`: inference output -> per image (n, 6)
  ``[x1, y1, x2, y2, score, class]``) and :meth:`Head.set_inference` (the options that shape the inference output);
* export and serving: its **output kind** (:attr:`Head.output`, one of :data:`OUTPUT_KINDS`): ``boxes``, (B, 4 + nc,
  N) xywh boxes and class scores per anchor, for NMS; or ``detections``, (B, k, 6) final detections;
* MuSGD: its class branches' parameters (:meth:`Head.class_parameters`, trained at 3x the learning rate);
* ``detrain info``: its arguments as built (:meth:`Head.yaml_args`);
* a fine-tune to other classes: :meth:`Head.reset_classes`.

Adding a head is a module that defines such a class and calls :func:`register_head` on it, and a model yaml whose
last row names it (docs/models.md; ``tests/integration/test_custom_head.py`` trains, validates, predicts and exports
one that lives in a test's own files).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import Tensor, nn

from detrain.nn.postprocess import non_max_suppression

#: what a head's inference output is (:attr:`Head.output`): the two kinds an exported graph may give and serve
BOXES, DETECTIONS = "boxes", "detections"
OUTPUT_KINDS = (BOXES, DETECTIONS)


@dataclass(frozen=True)
class InferenceOptions:
    """What turns a head's inference output into detections (the val/predict keys of the same names)."""

    conf: float = 0.25
    iou: float = 0.7
    max_det: int = 300
    classes: list[int] | None = None
    agnostic: bool = False
    multi_label: bool = False
    max_wh: int = 7680  # NMS's class offset in pixels: must exceed any coordinate


@dataclass(frozen=True)
class HeadRow:
    """What a head is built from: the last row of a model yaml as planned (:func:`detrain.nn.yaml_plan.plan_layers`).

    ``channels`` and ``strides``: of each feature map the row reads; ``args``: the row's arguments as written, ``nc``
    filled in (Ultralytics' rows: ``[nc]``); the yaml's own head settings: ``reg_max`` (DFL bins of a YOLOv8-style
    box branch), ``cls_channels`` (``head_cls_channels``: a class branch's width kept through ``reset_classes``) and
    ``depthwise_cls`` (the yaml builds YOLO11's blocks, whose head has the depthwise class branch)."""

    nc: int
    channels: tuple[int, ...]
    strides: tuple[float, ...]
    args: tuple[Any, ...] = ()
    reg_max: int = 16
    cls_channels: int | None = None
    depthwise_cls: bool = False


def first_tensor(value: Any) -> Tensor:
    """The first tensor in ``value`` (a tensor, or lists and tuples of them, nested), depth first.

    >>> first_tensor(([torch.zeros(1)], [torch.ones(2)])).tolist()
    [0.0]
    """
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            try:
                return first_tensor(item)
            except ValueError:
                continue
    raise ValueError(f"no tensor in {type(value).__name__}")


class Criterion:
    """A head's loss as the trainer drives it, and the template every detrain loss follows.

    ``loss, items = criterion(head_maps, batch_idx, cls, bboxes_xywhn)`` runs the two steps a loss implements with
    the all-reduce between them: :meth:`assign` (which anchors learn which boxes: targets that carry ``score_sum``,
    this rank's normaliser) and :meth:`score` (``(loss with gradient, detached items named in item_names)`` from the
    targets and the normaliser summed over every rank). The trainer calls the two itself with
    ``dist.all_reduce_sum`` of ``score_sum`` between them, in plain sight; calling the loss does the same with
    ``normalizer_reduce`` (None: this rank's own sum). Both steps run in float32 whatever autocast the caller runs
    under. A subclass implements ``_assign`` and ``_score``, and ``set_epoch`` if it follows a schedule (the
    trainer calls it at every epoch's start).

    >>> class Count(Criterion):
    ...     item_names = ("n",)
    ...     def _assign(self, maps, batch_idx, cls, bboxes):
    ...         return type("T", (), {"score_sum": torch.tensor(float(len(cls))), "maps": maps})
    ...     def _score(self, t, summed, global_batch):
    ...         items = t.maps.sum().reshape(1) / (t.score_sum if summed is None else summed)
    ...         return items.sum(), items.detach()
    >>> Count()(torch.ones(2, 3), torch.zeros(2), torch.zeros(2, 1), torch.zeros(2, 4))[1].tolist()
    [3.0]
    """

    item_names: tuple[str, ...] = ()
    normalizer_reduce: Callable[[Tensor], Tensor] | None = None
    world_size: int = 1

    def __call__(
        self, head_maps: Any, batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor, global_batch: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Loss for the head's raw maps (its training-mode output) and flat labels; see the class docstring."""
        targets = self.assign(head_maps, batch_idx, cls, bboxes_xywhn)
        # every rank must reach this collective, with or without boxes of its own
        summed = None if self.normalizer_reduce is None else self.normalizer_reduce(targets.score_sum.detach().clone())
        return self.score(targets, summed, global_batch)

    def assign(self, head_maps: Any, batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor) -> Any:
        """Targets for this rank's batch; they carry ``score_sum``, the normaliser to all-reduce (SUM)."""
        # a caller's autocast would run the loss's arithmetic in half precision: it is cheap next to the model
        with torch.autocast(first_tensor(head_maps).device.type, enabled=False):
            return self._assign(head_maps, batch_idx, cls, bboxes_xywhn)

    def score(
        self, targets: Any, summed_scores: Tensor | None = None, global_batch: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(loss with gradient, detached items)`` of ``assign``'s ``targets``, normalised by ``summed_scores`` (the
        all-reduced ``score_sum``), or by this rank's own when None; ``global_batch`` (default: this rank's batch
        times ``world_size``) scales the loss so that DDP's gradient average is the single-process gradient."""
        with torch.autocast(targets.score_sum.device.type, enabled=False):
            return self._score(targets, summed_scores, global_batch)

    def set_epoch(self, epoch: float) -> None:
        """Follow the loss's schedule, if it has one, to ``epoch`` (0-based); called at every epoch's start."""

    def _assign(self, head_maps: Any, batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor) -> Any:
        raise NotImplementedError

    def _score(self, targets: Any, summed_scores: Tensor | None, global_batch: int | None) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


class Head(Protocol):
    """The seam (see the module docstring): what a registered head class provides."""

    nc: int
    stride: Tensor  # per-level strides (a non-persistent buffer)
    loss_names: tuple[str, ...]  # the criterion's item names
    loss_gains: ClassVar[Mapping[str, float]]  # each gain the criterion takes, with its default
    output: str  # the inference output's kind: BOXES or DETECTIONS

    @classmethod
    def from_row(cls, row: HeadRow) -> Head:
        """The head a planned yaml row describes; a row it cannot build is a ValueError with a one-line reason."""
        ...

    def __call__(self, xs: list[Tensor], decode: bool | None = None) -> Any:
        """Raw maps for the criterion (``decode`` False; the default in training mode), else the inference
        output."""
        ...

    def decode(self, maps: Any) -> Tensor:
        """Raw maps (training-mode output) -> the inference output, as in eval mode."""
        ...

    def criterion(self, gains: Mapping[str, float], epochs: int, world_size: int = 1) -> Criterion:
        """This head's loss for a run of ``epochs`` epochs on ``world_size`` ranks, its terms weighed by ``gains``
        (one value for each name of :attr:`loss_gains`)."""
        ...

    def set_inference(self, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> None:
        """Shape the inference output (a no-op for a head whose output these do not shape)."""
        ...

    def postprocess(self, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
        """Inference output -> per image (n, 6) detections, best first."""
        ...

    def reset_classes(self, nc: int) -> Mapping[str, Any]:
        """Swap the final class convolutions for ``nc`` classes, keeping every other weight; returns the yaml's
        top-level settings that rebuild this head's shapes (a value None: the key goes)."""
        ...

    def class_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of the class branches (MuSGD trains them at 3x the learning rate)."""
        ...

    def yaml_args(self) -> list[Any]:
        """The arguments the head was built with, as ``detrain info`` shows them."""
        ...


# what register_head checks a class for: every member of Head the rest of detrain reaches
_MEMBERS = (
    "from_row",
    "decode",
    "criterion",
    "set_inference",
    "postprocess",
    "reset_classes",
    "class_parameters",
    "yaml_args",
    "loss_names",
    "loss_gains",
    "output",
)
_HEADS: dict[str, type[nn.Module]] = {}
H = TypeVar("H", bound=type[nn.Module])


def register_head(cls: H, name: str | None = None) -> H:
    """Make ``cls`` the head a model yaml's last row builds when it names ``name`` (default: the class's name);
    returns ``cls``, so it serves as a decorator. Registering the same class again does nothing; a name another
    class holds, a class that is no ``nn.Module`` or lacks a member of :class:`Head` is a TypeError.

    A process that builds the model must have registered its head first (import the head's module): a checkpoint
    names its head as its yaml does, and detrain never imports a module a file names. Spawned training and
    validation workers register the launching process's heads themselves (:class:`detrain.engine.run_plan.RunPlan`).

    >>> from detrain.nn.modules import Detect
    >>> head_class("Detect") is Detect, register_head(Detect) is Detect
    (True, True)
    """
    name = cls.__name__ if name is None else name
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"a head must be an nn.Module class, got {cls!r}")
    missing = [member for member in _MEMBERS if not hasattr(cls, member)]
    if missing:
        raise TypeError(f"head {name} lacks {', '.join(missing)} (see detrain.nn.head.Head)")
    if not name.isidentifier():
        raise TypeError(f"a head's name must be a Python identifier, got {name!r}")
    held = _HEADS.get(name)
    if held is not None and held is not cls:
        raise TypeError(f"head name {name} is taken by {held.__module__}.{held.__qualname__}")
    _HEADS[name] = cls
    return cls


def head_class(name: str) -> type[nn.Module] | None:
    """The head class registered under ``name``, else None: ``head_class("Detect")`` is YOLOv8's head."""
    return _HEADS.get(name)


def registered_heads() -> dict[str, type[nn.Module]]:
    """Every registered head by name (a copy)."""
    return dict(_HEADS)


def is_head(module: nn.Module) -> bool:
    """Whether ``module`` is a registered head's instance.

    >>> is_head(nn.Identity())
    False
    """
    return type(module) in _HEADS.values()


def head_gains(head: Any, given: Mapping[str, float]) -> dict[str, float]:
    """The gains ``head`` weighs its loss terms with: for each name of its :attr:`Head.loss_gains`, the run's value
    where ``given`` (the config's loss section) holds that name, else the head's own default; names ``given`` holds
    that the head does not take are left out.

    >>> class Toy:
    ...     loss_gains = {"box": 1.0, "obj": 2.0}
    >>> head_gains(Toy(), {"box": 5.0, "dfl": 3.0})
    {'box': 5.0, 'obj': 2.0}
    """
    return {name: float(given.get(name, default)) for name, default in head.loss_gains.items()}


def set_inference(net: nn.Module, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> None:
    """:meth:`Head.set_inference` on ``net`` when it is a detrain model; any other module (a bare network that gives
    decoded (B, 4 + nc, N) output) has nothing to set."""
    setter = getattr(net, "set_inference", None)
    if callable(setter):
        setter(max_det, agnostic, nms)


def detections(net: nn.Module, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
    """``net``'s inference output -> per image (n, 6) detections by ``net``'s own postprocess; a module without
    one gives decoded (B, 4 + nc, N) xywh boxes and scores, which go through NMS.

    >>> preds = torch.zeros(1, 5, 2); preds[0, :, 0] = torch.tensor([8.0, 8, 4, 4, 0.9])
    >>> [round(v, 3) for v in detections(nn.Identity(), preds, InferenceOptions(conf=0.5))[0][0].tolist()]
    [6.0, 6.0, 10.0, 10.0, 0.9, 0.0]
    """
    post = getattr(net, "postprocess", None)
    return post(preds, options) if callable(post) else nms(preds, options)


def nms(preds: Tensor, options: InferenceOptions) -> list[Tensor]:
    """Decoded (B, 4 + nc, N) xywh boxes and scores -> per image (n, 6) detections after NMS
    (:func:`detrain.nn.postprocess.non_max_suppression`, in float32: its class offsets pass float16's range)."""
    return non_max_suppression(
        preds.float(),
        conf_thres=options.conf,
        iou_thres=options.iou,
        max_det=options.max_det,
        classes=options.classes,
        agnostic=options.agnostic,
        multi_label=options.multi_label,
        max_wh=options.max_wh,
    )
