"""The YOLO26 detection head: end-to-end (NMS-free), box distances without DFL (``reg_max`` 1), two branches.

Per level, a box branch (``cv2``: two 3x3 Convs, then 4 distances) and a class branch (``cv3``: two depthwise 3x3 +
pointwise Conv pairs, then nc logits, YOLO11's lighter class branch), each twice: the one-to-many pair
(``cv2``/``cv3``), trained with YOLOv8's dense assignment, and the one-to-one pair (``one2one_cv2``/
``one2one_cv3``), trained to give one anchor per object (:mod:`detrain.nn.loss_e2e`). In training the one-to-one
branch reads the features detached: its sparse targets would otherwise pull the shared backbone away from what the
dense branch teaches it. Inference runs only the one-to-one branch and takes its top-k (anchor, class) pairs
(:mod:`detrain.nn.topk_decode`): a fixed (B, max_det, 6) output with no NMS.

Attribute names and nesting are Ultralytics' (``Detect`` with ``end2end=True``), so a YOLO26 checkpoint's head
loads by key (``tests/unit/test_parity_e2e.py``). A yaml row names it ``DetectE2E``, or ``Detect`` under the yaml's
``end2end: True`` as Ultralytics' YOLO26 yamls do (:func:`detrain.nn.yaml_plan.head_name`).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from detrain.nn.boxes import dist2bbox, make_anchors
from detrain.nn.head import BOXES, DETECTIONS, Criterion, HeadRow, InferenceOptions, nms, register_head
from detrain.nn.loss import YOLO_GAINS, LossGains
from detrain.nn.loss_e2e import ITEM_NAMES, E2EHeadMaps, EndToEndLoss
from detrain.nn.modules import (
    Conv,
    branch_inputs,
    class_convs,
    cls_width_setting,
    final_conv,
    replace_final_conv,
    run_branch,
)
from detrain.nn.topk_decode import decode_xyxy, filter_detections, topk_detections

BOX_BIAS = 2.0  # initial distances of 2 strides to every side: a box of 4 strides about each anchor


@register_head
class DetectE2E(nn.Module):
    """End-to-end detection head with a one-to-many and a one-to-one branch (YOLO26).

    Training mode: :class:`E2EHeadMaps` of raw maps (B, 4 + nc, H_i, W_i) per branch and level, for
    :class:`detrain.nn.loss_e2e.EndToEndLoss`. Otherwise: (B, min(max_det, N), 6) [x1, y1, x2, y2, score, class]
    in input pixels, best first, from the one-to-one branch alone; :meth:`postprocess` applies the confidence
    threshold. With ``end2end`` False inference uses the one-to-many branch and returns (B, 4 + nc, N) xywh boxes
    and scores, for :func:`detrain.nn.postprocess.non_max_suppression`, as :class:`detrain.nn.modules.Detect` does.

    >>> head = DetectE2E(nc=2, ch=(16, 32, 64), strides=(8, 16, 32))
    >>> feats = [torch.zeros(1, c, 64 // s, 64 // s) for c, s in ((16, 8), (32, 16), (64, 32))]
    >>> [m.shape[1] for m in head(feats).one2one], head.eval()(feats).shape
    ([6, 6, 6], torch.Size([1, 84, 6]))
    """

    stride: Tensor  # per-level strides (a non-persistent buffer)
    cv2: nn.ModuleList
    cv3: nn.ModuleList
    one2one_cv2: nn.ModuleList
    one2one_cv3: nn.ModuleList

    def __init__(
        self,
        nc: int = 80,
        ch: tuple[int, ...] | list[int] = (),
        strides: tuple[float, ...] | list[float] | None = None,
        max_det: int = 300,
        cls_channels: int | None = None,
    ) -> None:
        super().__init__()
        self.nc = nc
        self.nl = len(ch)
        self.reg_max = 1
        self.no = nc + 4
        self.max_det = max_det
        self.end2end = True
        self.agnostic = False
        c2 = max(16, ch[0] // 4, 4)
        c3 = cls_channels if cls_channels is not None else max(ch[0], min(nc, 100))
        self.cls_channels = c3
        self.cv2 = nn.ModuleList(nn.Sequential(Conv(c, c2, 3), Conv(c2, c2, 3), nn.Conv2d(c2, 4, 1)) for c in ch)
        self.cv3 = nn.ModuleList(nn.Sequential(*class_convs(c, c3, depthwise=True), nn.Conv2d(c3, nc, 1)) for c in ch)
        self.one2one_cv2 = copy.deepcopy(self.cv2)
        self.one2one_cv3 = copy.deepcopy(self.cv3)
        self.register_buffer("stride", torch.tensor(strides or [0.0] * self.nl, dtype=torch.float), persistent=False)
        if strides is not None:
            self.bias_init()

    family = "yolo26"  # whatever blocks the yaml's body uses (detrain.nn.model.family)

    @classmethod
    def from_row(cls, row: HeadRow) -> DetectE2E:
        """The head of a yaml row; the one form detrain builds is reg_max 1 with the depthwise class branch (a yaml
        with C3k2 blocks), as every YOLO26 is.

        >>> DetectE2E.from_row(HeadRow(nc=2, channels=(16,), strides=(8.0,), reg_max=16, depthwise_cls=True))
        Traceback (most recent call last):
        ...
        ValueError: an end-to-end head with reg_max 16 (DFL bins); detrain builds it with reg_max 1
        """
        if row.reg_max != 1:
            raise ValueError(
                f"an end-to-end head with reg_max {row.reg_max} (DFL bins); detrain builds it with reg_max 1"
            )
        if not row.depthwise_cls:
            raise ValueError(
                "an end-to-end head with YOLOv8's class branch (the yaml has no C3k2); detrain builds it with the "
                "depthwise one"
            )
        return cls(row.nc, row.channels, row.strides, cls_channels=row.cls_channels)

    def bias_init(self) -> None:
        """Both branches: distances of 2 strides, class logits at a prior of ~5 objects per 640 px image.

        >>> head = DetectE2E(nc=2, ch=(16, 32, 64), strides=(8, 16, 32))
        >>> head.one2one_cv2[0][2].bias.tolist()[0], bool(head.cv3[2][2].bias[0] < -5)
        (2.0, True)
        """
        if self.stride.is_meta:  # a head built for its shapes only (see model_from_checkpoint): no values to set
            return
        with torch.no_grad():
            for boxes, classes in ((self.cv2, self.cv3), (self.one2one_cv2, self.one2one_cv3)):
                for box, cls, s in zip(boxes, classes, self.stride.tolist()):
                    cast(Tensor, final_conv(box).bias).fill_(BOX_BIAS)
                    cast(Tensor, final_conv(cls).bias).fill_(math.log(5 / self.nc / (640 / s) ** 2))

    def branch_maps(self, xs: list[Tensor], one2one: bool) -> list[Tensor]:
        """Raw maps (B, 4 + nc, H_i, W_i) of one branch for features ``xs``."""
        boxes, classes = (self.one2one_cv2, self.one2one_cv3) if one2one else (self.cv2, self.cv3)
        return [torch.cat((run_branch(box, x), run_branch(cls, x)), 1) for x, box, cls in zip(xs, boxes, classes)]

    def forward(self, xs: list[Tensor], decode: bool | None = None) -> E2EHeadMaps | Tensor:
        """Both branches' raw maps in training (``decode`` False), else the inference output (see the class
        docstring)."""
        if decode is None:
            decode = not self.training
        if not decode:
            return E2EHeadMaps(self.branch_maps(xs, False), self.branch_maps([x.detach() for x in xs], True))
        if not self.end2end:
            return self.decode_one2many(self.branch_maps(xs, False))
        return topk_detections(decode_xyxy(self.branch_maps(xs, True), self.stride), self.max_det, self.agnostic)

    def decode(self, maps: E2EHeadMaps) -> Tensor:
        """Raw maps of both branches (training-mode output) -> the inference output, as in eval mode.

        >>> head = DetectE2E(nc=2, ch=(16,), strides=(8,))
        >>> head.decode(head([torch.zeros(1, 16, 4, 4)])).shape
        torch.Size([1, 16, 6])
        """
        if not self.end2end:
            return self.decode_one2many(maps.one2many)
        return topk_detections(decode_xyxy(maps.one2one, self.stride), self.max_det, self.agnostic)

    loss_names = ITEM_NAMES
    loss_gains = YOLO_GAINS  # box, cls, and dfl for the L1 term

    @property
    def output(self) -> str:
        """The inference output's kind: the one-to-one branch's top-k detections, or (``set_inference(nms=True)``)
        the one-to-many branch's boxes and scores for NMS."""
        return DETECTIONS if self.end2end else BOXES

    def criterion(self, gains: Mapping[str, float], epochs: int, world_size: int = 1) -> Criterion:
        """The end-to-end loss (:class:`detrain.nn.loss_e2e.EndToEndLoss`): both branches, the one-to-many one's
        weight moving to the one-to-one one over ``epochs``; the ``dfl`` gain weighs the L1 distance term.

        >>> head = DetectE2E(nc=2, ch=(16,), strides=(8,))
        >>> head.criterion({"box": 1.0, "cls": 1.0, "dfl": 1.0}, epochs=3).item_names
        ('box_loss', 'cls_loss', 'l1_loss')
        """
        return EndToEndLoss(
            nc=self.nc,
            strides=self.stride,
            epochs=epochs,
            gains=LossGains.of(gains),
            world_size=world_size,
        )

    def class_parameters(self) -> Iterator[nn.Parameter]:
        """Both branches' class convolutions (``cv3``, ``one2one_cv3``)."""
        return itertools.chain(self.cv3.parameters(), self.one2one_cv3.parameters())

    def yaml_args(self) -> list[Any]:
        """``[nc, [channels read at each level], "end2end"]``."""
        return [self.nc, branch_inputs(self.cv2), "end2end"]

    def set_inference(self, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> None:
        """The one-to-one branch's top-k size and class-agnostic selection; ``nms`` switches inference to the
        one-to-many branch, whose every anchor then goes through NMS (:meth:`postprocess`).

        >>> head = DetectE2E(nc=2, ch=(16,), strides=(8,)).eval()
        >>> head.set_inference(max_det=5); head([torch.zeros(1, 16, 4, 4)]).shape
        torch.Size([1, 5, 6])
        >>> head.set_inference(nms=True); head([torch.zeros(1, 16, 4, 4)]).shape  # xywh + scores per anchor
        torch.Size([1, 6, 16])
        """
        self.max_det, self.agnostic, self.end2end = max_det, agnostic, not nms

    def decode_one2many(self, maps: list[Tensor]) -> Tensor:
        """One-to-many maps -> (B, 4 + nc, N): xywh boxes in input pixels and sigmoid scores, for NMS.

        >>> head = DetectE2E(nc=1, ch=(16,), strides=(8,))
        >>> head.decode_one2many([torch.ones(1, 5, 2, 2)])[0, :, 0].tolist()[:4]  # (4, 4) px, 1 stride a side
        [4.0, 4.0, 16.0, 16.0]
        """
        b = maps[0].shape[0]
        anchors, strides = make_anchors(maps, self.stride, 0.5)
        x = torch.cat([m.reshape(b, self.no, -1) for m in maps], 2)
        box, cls = x.split((4, self.nc), 1)
        return torch.cat((dist2bbox(box, anchors.T[None], xywh=True, dim=1) * strides.T[None], cls.sigmoid()), 1)

    def postprocess(self, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
        """Inference output -> per image (n, 6) detections, best first: the top-k (B, k, 6) filtered by
        ``options.conf`` and ``options.classes`` (no NMS), or, after ``set_inference(nms=True)``, the one-to-many
        branch's (B, 4 + nc, N) through NMS.

        >>> head = DetectE2E(nc=2, ch=(16,), strides=(8,)).eval()
        >>> [d.shape for d in head.postprocess(head([torch.zeros(2, 16, 4, 4)]), InferenceOptions(conf=0.5))]
        [torch.Size([0, 6]), torch.Size([0, 6])]
        """
        if not self.end2end:
            return nms(preds, options)
        return filter_detections(preds, options.conf, options.max_det, options.classes)

    def reset_classes(self, nc: int) -> dict[str, Any]:
        """Swap the final class conv of every class branch, both branches, for one with ``nc`` outputs; the class
        branches keep their width (:func:`detrain.nn.modules.cls_width_setting`).

        >>> head = DetectE2E(nc=80, ch=(16, 32), strides=(8, 16))
        >>> head.reset_classes(3), head.one2one_cv3[1][2].out_channels, head.no
        ({'head_cls_channels': 80}, 3, 7)
        """
        for branches in (self.cv3, self.one2one_cv3):
            for branch in branches:
                replace_final_conv(branch, nc)
        self.nc = nc
        self.no = nc + 4
        self.bias_init()
        return cls_width_setting(self)
