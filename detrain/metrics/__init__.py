"""COCO-exact detection metrics: per-image matching, accumulation, P/R at best F1, confusion matrix.

The flow is ``match_image`` per image (on any rank) -> gather the :class:`ImageStats` -> one
``coco_summary`` -> :class:`DetMetrics`, whose 12 COCO values equal pycocotools' for the same boxes.
:class:`DetectionMetrics` is what ``Model.train()``/``val()`` hand the user: those numbers in Ultralytics' shape.

>>> import numpy as np
>>> s = match_image(np.array([[0., 0, 10, 10]]), np.array([0.9]), np.array([0]),
...                 np.array([[1., 0, 10, 10]]), np.array([0]), image_id=0)
>>> round(coco_summary([s], nc=1).map50, 3)
1.0
"""

from detrain.metrics.confusion import ConfusionMatrix, box_iou_xyxy
from detrain.metrics.det_metrics import BoxMetric, DetectionMetrics
from detrain.metrics.match import (
    AREA_NAMES,
    AREA_RANGES,
    IOU_THRESHOLDS,
    MAX_DETS,
    RECALL_THRESHOLDS,
    ImageStats,
    coco_box_iou,
    match_image,
    match_image_coco,
)
from detrain.metrics.summary import SUMMARY_KEYS, DetMetrics, coco_summary

__all__ = [
    "AREA_NAMES",
    "AREA_RANGES",
    "IOU_THRESHOLDS",
    "MAX_DETS",
    "RECALL_THRESHOLDS",
    "SUMMARY_KEYS",
    "BoxMetric",
    "ConfusionMatrix",
    "DetMetrics",
    "DetectionMetrics",
    "ImageStats",
    "box_iou_xyxy",
    "coco_box_iou",
    "coco_summary",
    "match_image",
    "match_image_coco",
]
