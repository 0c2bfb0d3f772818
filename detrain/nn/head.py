"""The head seam: what the engine may ask of a detection head, and nothing more.

A head (:class:`detrain.nn.modules.Detect`, YOLOv8's and YOLO11's; :class:`detrain.nn.head_e2e.DetectE2E`, YOLO26's
end-to-end one) owns three things the engine would otherwise have to know per family:

* its **criterion** (:meth:`Head.criterion`): the loss object the trainer drives (``assign`` -> all-reduce of
  ``score_sum`` -> ``score``; ``set_epoch`` at every epoch's start for a loss with a schedule), built from the
  run's :class:`LossGains`, planned epochs and world size;
* its **loss item names** (:attr:`Head.loss_names`): the progress columns and results.csv's ``train/<name>``;
* its **postprocess** (:meth:`Head.postprocess`): inference output -> per image (n, 6) ``[x1, y1, x2, y2, score,
  class]``: NMS for a one-to-many head, a confidence filter of the top-k for a one-to-one head; and
  :meth:`Head.set_inference`, the options that shape the inference output itself (a one-to-one head's top-k
  count and class-agnostic selection, or ``nms=True`` to use its one-to-many branch with NMS instead).

The trainer, validator, predictor and exporter reach the head only through :class:`detrain.nn.model.DetectionModel`'s
methods of the same names (``tests/unit/test_head_seam.py`` keeps ``Detect`` and the loss names out of the engine).
Adding a head is a module in ``nn/`` that satisfies :class:`Head` and a yaml that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from detrain.nn.postprocess import non_max_suppression


@dataclass(frozen=True)
class LossGains:
    """The loss's per-term gains (the ``box``, ``cls`` and ``dfl`` keys): the third weighs DFL for a ``reg_max`` > 1
    head and the L1 distance term for a ``reg_max`` 1 head, as Ultralytics' ``dfl`` gain does. No defaults here:
    the run's come from its config, whose ``loss`` section holds the one copy of the default gains."""

    box: float
    cls: float
    dfl: float


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


class Criterion(Protocol):
    """A head's loss as the trainer drives it (see :class:`detrain.nn.loss.DetectionLoss` for the contract)."""

    @property
    def item_names(self) -> tuple[str, ...]:
        """The names of the items ``score`` returns, in order."""
        ...

    def assign(self, head_maps: Any, batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor) -> Any:
        """Targets for this rank's batch; they carry ``score_sum``, the normaliser to all-reduce (SUM)."""
        ...

    def score(self, targets: Any, summed_scores: Tensor | None, global_batch: int | None) -> tuple[Tensor, Tensor]:
        """``(loss with gradient, detached items)`` from ``assign``'s targets and the all-reduced ``score_sum``."""
        ...

    def set_epoch(self, epoch: float) -> None:
        """Follow the loss's schedule (if any) to ``epoch`` (0-based); called at every epoch's start."""
        ...


class Head(Protocol):
    """The seam (see the module docstring)."""

    nc: int
    reg_max: int
    stride: Tensor
    loss_names: tuple[str, ...]
    end2end: bool  # the inference output is final detections (B, k, 6), not boxes and scores for NMS

    def criterion(self, gains: LossGains, epochs: int, world_size: int = 1) -> Criterion:
        """This head's loss for a run of ``epochs`` epochs on ``world_size`` ranks."""
        ...

    def set_inference(self, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> None:
        """Shape the inference output (a no-op for a head whose output these do not shape)."""
        ...

    def postprocess(self, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
        """Inference output -> per image (n, 6) detections, best first."""
        ...

    def reset_classes(self, nc: int) -> None:
        """Swap the final class convolutions for ``nc`` classes, keeping every other weight."""
        ...


def set_inference(net: nn.Module, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> None:
    """:meth:`Head.set_inference` on ``net`` when it is a detrain model; any other module (a bare network that gives
    decoded (B, 4 + nc, N) output) has nothing to set."""
    setter = getattr(net, "set_inference", None)
    if callable(setter):
        setter(max_det, agnostic, nms)


def detections(net: nn.Module, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
    """``net``'s inference output -> per image (n, 6) detections by ``net``'s own postprocess; a module without
    one gives decoded (B, 4 + nc, N) xywh boxes and scores, which go through NMS.

    >>> import torch
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
