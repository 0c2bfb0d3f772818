"""Which labels a run trains and scores on: ``classes=`` (only these class ids) and ``single_cls=`` (every object
is one class, ``item``), applied the way Ultralytics' datasets apply them.

Images keep their pixels: an image whose objects are all of other classes stays in the split without labels (a
background image in training; in validation its detections of the kept classes are false positives). Both keys
act on the verified records, which the datasets render, and on the split's ground truth, which validation scores
against, so training, validation and ``predictions.json`` agree. ``classes`` picks before ``single_cls`` merges.

>>> f = ClassFilter(classes=(0, 2), single_cls=True)
>>> keep, cls = f.labels(np.array([0, 1, 2]))
>>> keep.tolist(), cls.tolist(), f.names({0: "a", 1: "b", 2: "c"})
([True, False, True], [0, 0], {0: 'item'})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from detrain.data.labels.ground_truth import ImageGT, SplitGT
from detrain.data.labels.record import LabelRecord
from detrain.errors import ConfigError

SINGLE_CLASS_NAME = "item"  # the one class of single_cls=true, as Ultralytics names it


@dataclass(frozen=True)
class ClassFilter:
    """``classes``: the class ids to keep (None: all); ``single_cls``: merge what is kept into class 0."""

    classes: tuple[int, ...] | None = None
    single_cls: bool = False

    @classmethod
    def from_cfg(cls, cfg: Any) -> ClassFilter:
        """The filter of a ``Cfg`` (none without one)."""
        if cfg is None:
            return cls()
        return cls(tuple(cfg.inputs.classes) if cfg.inputs.classes else None, bool(cfg.inputs.single_cls))

    @property
    def active(self) -> bool:
        """Whether it changes any label."""
        return self.classes is not None or self.single_cls

    def check(self, names: Mapping[int, str], source: Any) -> None:
        """Raise a ConfigError naming ``source`` (the dataset yaml) when ``classes`` holds an id it does not have."""
        unknown = [c for c in self.classes or () if c not in names]
        if unknown:
            raise ConfigError(
                f"invalid value for 'classes': {unknown} not among the {len(names)} classes of "
                f"{source} (0 to {len(names) - 1})"
            )

    def names(self, names: Mapping[int, str]) -> dict[int, str]:
        """The class names a model trained on the filtered labels has: the dataset's, or ``{0: 'item'}``."""
        return {0: SINGLE_CLASS_NAME} if self.single_cls else dict(names)

    def labels(self, cls: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of the objects of classes ``cls`` stay (bool), their classes after the merge)."""
        cls = np.asarray(cls, np.int64).reshape(-1)
        keep = np.isin(cls, self.classes) if self.classes is not None else np.ones(len(cls), bool)
        return keep, np.zeros(int(keep.sum()), np.int64) if self.single_cls else cls[keep]

    def records(self, records: Sequence[LabelRecord]) -> list[LabelRecord]:
        """The records with only the kept objects (every image stays)."""
        if not self.active:
            return list(records)
        out = []
        for r in records:
            keep, cls = self.labels(r.cls)
            out.append(LabelRecord(r.im_file, r.shape_hw, cls, np.asarray(r.bboxes_xywhn, np.float32)[keep]))
        return out

    def category_ids(self, category_ids: np.ndarray) -> np.ndarray:
        """The category id written for each class: the first class's for the merged class of ``single_cls``."""
        return category_ids[:1].copy() if self.single_cls else category_ids

    def ground_truth(self, gt: SplitGT) -> SplitGT:
        """``gt`` with only the kept objects (crowd regions too) of every image."""
        if not self.active:
            return gt
        images = {}
        for key, g in gt.images.items():
            keep, cls = self.labels(g.cls)
            images[key] = ImageGT(
                g.image_id,
                g.boxes_ltwh[keep],
                cls,
                g.area[keep],
                g.crowd[keep],
                None if g.ann_ids is None else g.ann_ids[keep],
            )
        return dataclasses.replace(gt, images=images, category_ids=self.category_ids(gt.category_ids))
