"""``detrain val predictions=path.json``: score an existing COCO results file against a dataset split, no model.

The file is checked strictly against the split's image and category ids (the ids ``save_json`` writes, see
:mod:`detrain.data.labels.ground_truth`): the first entry with an unknown id, a box that is not 4 finite numbers
with non-negative width and height, a missing key or a file that is not a json list stops it with a
``DatasetError`` naming that entry. An empty list scores mAP 0. Scoring then runs the validator's own code
(:class:`detrain.engine.evaluate.validator.Scorer` and ``finish``): the same matching, table, metrics.json and plots,
so re-scoring a ``predictions.json`` reproduces the numbers of the run that wrote it. Ranks share the images.

Example (a dataset of one labelled image, and a results file without a detection):
>>> import os, cv2, yaml
>>> from detrain.config.cfg import make_cfg
>>> from detrain.data.prepare import load_split
>>> for folder in ("toy/images/val", "toy/labels/val"):
...     os.makedirs(folder)
>>> _ = cv2.imwrite("toy/images/val/a.png", np.zeros((48, 64, 3), np.uint8))
>>> with open("toy/labels/val/a.txt", "w") as f:
...     _ = f.write("0 0.5 0.5 0.25 0.5")
>>> with open("toy.yaml", "w") as f:
...     yaml.safe_dump({"path": "toy", "train": "images/val", "val": "images/val", "names": ["cat"]}, f)
>>> with open("predictions.json", "w") as f:
...     _ = f.write("[]")
>>> cfg = make_cfg({"data": "toy.yaml", "predictions": "predictions.json", "plots": False, "verbose": False})
>>> from detrain.distributed.world import World
>>> score_predictions_file(cfg, load_split(cfg.inputs.data, "val", cfg, verbose=False), None, World())["map"]
scoring predictions.json: 0 detections on 0 of 1 images (val split, ground truth: YOLO labels); results in None
0.0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from detrain.config.cfg import Cfg
from detrain.data.labels.ground_truth import split_ground_truth
from detrain.distributed import dist
from detrain.distributed.world import World
from detrain.engine.evaluate.validator import Scorer, finish
from detrain.log import console
from detrain.metrics.coco_json import CocoDetections, load_predictions


def score_predictions_file(cfg: Cfg, data: Any, save_dir: str | Path | None, world: World) -> dict[str, Any]:
    """Metrics of ``cfg.predict.predictions`` on ``data`` (a ``SplitData``); every rank of ``world`` scores its share
    of the images and returns the same dict."""
    gt = split_ground_truth(data)
    path = str(cfg.predict.predictions)
    # every rank reads and checks the file, so a bad one stops every rank with the same message
    predictions = load_predictions(path, gt.all_image_ids(), gt.category_ids.tolist())
    if world.is_main:
        n = sum(len(d.scores) for d in predictions.values())
        console.print(
            f"scoring {path}: {n} detections on {len(predictions)} of {len(gt.images)} images "
            f"({data.split} split, ground truth: {gt.source}); results in {save_dir}"
        )
    class_of = gt.class_of()
    images = sorted(gt.images.values(), key=lambda g: g.image_id)
    lo, hi = world.dp_rank * len(images) // world.dp_size, (world.dp_rank + 1) * len(images) // world.dp_size
    scorer = Scorer(
        data.nc, classes=None if cfg.inputs.single_cls or not cfg.inputs.classes else tuple(cfg.inputs.classes)
    )
    empty = CocoDetections(np.zeros((0, 4)), np.zeros(0), np.zeros(0, np.int64))
    for g in images[lo:hi]:
        d = predictions.get(g.image_id, empty)
        cls = np.array([class_of[int(c)] for c in d.category_ids], np.int64)
        scorer.add(g, d.boxes_ltwh.reshape(-1, 4), d.scores.reshape(-1), cls)
    gathered = dist.all_gather_object(scorer.part())  # collective: every rank's scores, on every rank
    metrics = None
    if world.is_main:
        metrics = finish(
            gathered,
            data,
            gt,
            cfg,
            Path(save_dir) if save_dir is not None else None,
            cfg.output.plots,
            cfg.output.verbose,
            predictions_file=path,
        )
    metrics = dist.broadcast_object(metrics)  # collective: rank 0's metrics on every rank
    if save_dir is not None:
        metrics["save_dir"] = str(save_dir)
    return metrics
