"""A head detrain does not ship, with its own loss and its own postprocess, added the way a user adds one: this module
and a model yaml whose last row names it, nothing in detrain changed (``tests/integration/test_custom_head.py``).

``ToyHead`` is a one-branch, centre-assigned head (FCOS-like, much smaller): per level one shared 3x3 Conv, then a
1x1 box convolution (4 distances, ``sigmoid * SPAN`` strides to each side of the anchor) and a 1x1 class
convolution. Its loss (``ToyLoss``) gives each box to the anchor whose cell holds the box's centre on every level:
an L1 term on the distances (the ``ltrb`` gain, which the config's loss section does not hold: the head's own default
stands) and BCE on the classes (the ``cls`` gain: the run's). Its postprocess keeps the best anchors above ``conf``
and drops any whose centre lies inside a box already kept of the same class: no NMS. Its inference output is
``boxes`` (xywh and class scores per anchor), so an exported graph serves through NMS like YOLOv8's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from detrain.nn.boxes import dist2bbox, make_anchors, xywh2xyxy
from detrain.nn.head import BOXES, Criterion, HeadRow, InferenceOptions, register_head
from detrain.nn.modules import Conv

SPAN = 8.0  # the farthest a box side lies from its anchor, in strides


@dataclass(frozen=True)
class ToyTargets:
    """What ``ToyLoss`` assigned: the positives (image, anchor, class, target distances) and their count."""

    batch: int
    box: Tensor  # (B, N, 4) predicted distances in strides
    logits: Tensor  # (B, N, nc)
    img: Tensor
    anchor: Tensor
    label: Tensor
    ltrb: Tensor  # (P, 4) target distances in strides
    score_sum: Tensor  # positives on this rank: the normaliser


class ToyLoss(Criterion):
    """L1 on the positives' distances plus BCE on every class logit, each summed and divided by the positives
    (summed over the ranks: the template's ``score_sum``)."""

    item_names = ("ltrb_loss", "class_loss")

    def __init__(self, nc: int, strides: list[float], gains: Mapping[str, float], world_size: int = 1) -> None:
        self.nc, self.strides, self.world_size = nc, strides, world_size
        self.gains = dict(gains)

    def _assign(self, maps: list[Tensor], batch_idx: Tensor, cls: Tensor, bboxes_xywhn: Tensor) -> ToyTargets:
        b = maps[0].shape[0]
        rows = torch.cat([m.float().flatten(2) for m in maps], 2).transpose(1, 2)  # (B, N, 4 + nc)
        box, logits = rows[..., :4].sigmoid() * SPAN, rows[..., 4:]
        anchors, _ = make_anchors(maps, torch.tensor(self.strides), 0.5)  # in strides
        h, w = (s * self.strides[0] for s in maps[0].shape[2:])
        xyxy = xywh2xyxy(bboxes_xywhn.to(rows) * rows.new_tensor([w, h, w, h]))  # (M, 4) pixels
        centre = (xyxy[:, :2] + xyxy[:, 2:]) / 2
        img, anchor, label, ltrb, start = [], [], [], [], 0
        for (fh, fw), stride in zip([m.shape[2:] for m in maps], self.strides):
            cell = (centre / stride).floor().long()
            at = start + cell[:, 1].clamp(0, fh - 1) * fw + cell[:, 0].clamp(0, fw - 1)
            point = anchors[at] * stride
            dist = torch.cat((point - xyxy[:, :2], xyxy[:, 2:] - point), 1) / stride
            (
                img.append(batch_idx.to(at.device).long()),
                anchor.append(at),
                label.append(cls.to(at.device).view(-1).long()),
            )
            ltrb.append(dist.clamp(0, SPAN))
            start += fh * fw
        n = rows.new_tensor(float(len(batch_idx) * len(maps)))
        return ToyTargets(b, box, logits, torch.cat(img), torch.cat(anchor), torch.cat(label), torch.cat(ltrb), n)

    def _score(self, t: ToyTargets, summed: Tensor | None, global_batch: int | None) -> tuple[Tensor, Tensor]:
        normalizer = (t.score_sum if summed is None else summed).clamp(min=1.0)
        target = torch.zeros_like(t.logits)
        target[t.img, t.anchor, t.label] = 1.0
        l1 = (t.box[t.img, t.anchor] - t.ltrb).abs().sum() if len(t.img) else t.box.sum() * 0.0
        bce = F.binary_cross_entropy_with_logits(t.logits, target, reduction="sum")
        scale = self.world_size if summed is not None else 1
        items = torch.stack((l1 * self.gains["ltrb"], bce * self.gains["cls"])) / normalizer * scale
        return items.sum() * (global_batch or t.batch * self.world_size), items.detach()


class ToyHead(nn.Module):
    """See the module docstring. Training mode: raw maps (B, 4 + nc, H_i, W_i); otherwise (B, 4 + nc, N) xywh
    boxes in input pixels and sigmoid scores."""

    loss_names = ToyLoss.item_names
    loss_gains: ClassVar[dict[str, float]] = {"ltrb": 1.0, "cls": 1.0}  # the run's loss section overrides cls
    output = BOXES
    postprocessed = 0  # how many batches went through its own postprocess (the test reads it)

    def __init__(self, nc: int, ch: tuple[int, ...], strides: tuple[float, ...], hidden: int = 16) -> None:
        super().__init__()
        self.nc, self.hidden = nc, hidden
        self.stem = nn.ModuleList(Conv(c, hidden, 3) for c in ch)
        self.box = nn.ModuleList(nn.Conv2d(hidden, 4, 1) for _ in ch)
        self.cls = nn.ModuleList(nn.Conv2d(hidden, nc, 1) for _ in ch)
        self.register_buffer("stride", torch.tensor(strides, dtype=torch.float), persistent=False)

    @classmethod
    def from_row(cls, row: HeadRow) -> ToyHead:
        """``[nc]`` or ``[nc, hidden]``."""
        hidden = row.args[1] if len(row.args) > 1 else 16
        if not isinstance(hidden, int) or not 1 <= hidden <= 256:
            raise ValueError(f"ToyHead's hidden width must be a whole number from 1 to 256, got {hidden!r}")
        return cls(row.nc, row.channels, row.strides, hidden)

    def forward(self, xs: list[Tensor], decode: bool | None = None) -> Any:
        feats = [stem(x) for x, stem in zip(xs, self.stem)]
        maps = [torch.cat((box(f), cls(f)), 1) for f, box, cls in zip(feats, self.box, self.cls)]
        return self.decode(maps) if (not self.training if decode is None else decode) else maps

    def decode(self, maps: list[Tensor]) -> Tensor:
        b = maps[0].shape[0]
        anchors, strides = make_anchors(maps, self.stride, 0.5)
        x = torch.cat([m.reshape(b, 4 + self.nc, -1) for m in maps], 2)
        dist = x[:, :4].sigmoid() * SPAN
        return torch.cat((dist2bbox(dist, anchors.T[None], xywh=True, dim=1) * strides.T[None], x[:, 4:].sigmoid()), 1)

    def criterion(self, gains: Mapping[str, float], epochs: int, world_size: int = 1) -> Criterion:
        return ToyLoss(self.nc, self.stride.tolist(), gains, world_size)

    def set_inference(self, max_det: int = 300, agnostic: bool = False, nms: bool = False) -> None:
        """Nothing shapes its output."""

    def postprocess(self, preds: Tensor, options: InferenceOptions) -> list[Tensor]:
        type(self).postprocessed += 1
        out = []
        for p in preds.float():
            scores, labels = p[4:].max(0)
            keep = (scores > options.conf).nonzero().view(-1)
            if options.classes is not None:
                keep = keep[torch.isin(labels[keep], torch.tensor(options.classes, device=labels.device))]
            keep = keep[scores[keep].argsort(descending=True)]
            boxes = xywh2xyxy(p[:4, keep].T)
            kept: list[int] = []
            for k in range(len(keep)):  # a centre inside a kept box of its class is that object again
                cx, cy = p[0, keep[k]], p[1, keep[k]]
                if len(kept) == options.max_det:
                    break
                if not any(
                    int(labels[keep[j]]) == int(labels[keep[k]])
                    and boxes[j, 0] <= cx <= boxes[j, 2]
                    and boxes[j, 1] <= cy <= boxes[j, 3]
                    for j in kept
                ):
                    kept.append(k)
            rows = torch.tensor(kept, dtype=torch.long, device=p.device)
            out.append(torch.cat((boxes[rows], scores[keep[rows], None], labels[keep[rows], None].float()), 1))
        return out

    def reset_classes(self, nc: int) -> dict[str, Any]:
        self.cls = nn.ModuleList(nn.Conv2d(self.hidden, nc, 1) for _ in self.cls)
        self.nc = nc
        return {}

    def class_parameters(self) -> Iterator[nn.Parameter]:
        return self.cls.parameters()

    def yaml_args(self) -> list[Any]:
        return [self.nc, [s.conv.in_channels for s in self.stem], self.hidden]


register_head(ToyHead)

#: YOLOv8n's body at half width with the toy head on its three levels: the yaml a user writes
TOY_YAML = """\
nc: 2
scale: n
scales:
  n: [0.33, 0.125, 1024]
backbone:
  - [-1, 1, Conv, [64, 3, 2]]
  - [-1, 1, Conv, [128, 3, 2]]
  - [-1, 1, C2f, [128, True]]
  - [-1, 1, Conv, [256, 3, 2]]
  - [-1, 1, C2f, [256, True]]
  - [-1, 1, Conv, [512, 3, 2]]
  - [-1, 1, C2f, [512, True]]
  - [-1, 1, Conv, [1024, 3, 2]]
  - [-1, 1, SPPF, [1024, 5]]
head:
  - [[4, 6, 8], 1, ToyHead, [nc, 16]]
"""
