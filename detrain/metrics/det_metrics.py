"""What ``Model.train()`` and ``Model.val()`` return: the final validation in the shape of Ultralytics'
``DetMetrics``, so a script written for Ultralytics reads it unchanged.

``metrics.box`` holds the box metrics under Ultralytics' names (``map``, ``map50``, ``map75``, ``maps``, ``mp``,
``mr``, per-class ``p``, ``r``, ``ap50``, ``ap``, ``ap_class_index``); ``metrics.results_dict`` the four numbers
and fitness under the keys results.csv-reading tools know (``metrics/mAP50-95(B)``...); ``metrics.speed`` the
milliseconds per image of each stage; ``metrics.details`` every number detrain's validator reported (the 12
COCO values, per-class counts, the F1-optimal confidence...); ``metrics.confusion_matrix`` (``.matrix``: the
(nc + 1, nc + 1) counts, ``matrix[predicted, true]``, the last row and column background) and ``metrics.curves`` /
``metrics.curves_results`` (the PR, F1, P and R curves: names, and each one's x, y, x label, y label), as
Ultralytics names them. The mAPs are COCO-exact (``map75`` is AP at IoU
0.75 from the same accumulation as ``map``); where COCO leaves a value undefined (no ground truth) it reads 0
here, as Ultralytics gives 0, and -1 in ``details``.

>>> m = DetectionMetrics.from_results({"map": 0.4, "map50": 0.6, "map75": 0.5, "precision": 0.7, "recall": 0.5,
...     "fitness": 0.4, "names": {0: "cat", 1: "dog", 2: "cow"},
...     "per_class": {1: {"p": 0.7, "r": 0.5, "ap50": 0.6, "ap": 0.4, "n_gt": 3, "n_images": 2}}})
>>> m.box.map, m.box.map50, m.box.map75, m.box.maps.tolist(), m.fitness
(0.4, 0.6, 0.5, [0.4, 0.4, 0.4], 0.4)
>>> m.results_dict["metrics/mAP50-95(B)"], m.box.ap_class_index.tolist()
(0.4, [1])

Until the next release it also reads as the dict ``train()``/``val()`` used to return (``m["map50"]``,
``m.get``, ``in``, ``m.keys()``), with one deprecation line the first time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detrain.errors import deprecated
from detrain.metrics.confusion import ConfusionMatrix
from detrain.metrics.summary import DetMetrics

SPEED_STAGES = ("preprocess", "inference", "loss", "postprocess")
RESULT_KEYS = ("metrics/precision(B)", "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)")
_DICT_USE = (
    "Model.train() and Model.val() return a metrics object now, in Ultralytics' shape (metrics.box.map, "
    "metrics.box.map50, metrics.box.map75, metrics.results_dict, metrics.save_dir...): reading it as the old dict "
    "(metrics['map'], .get(), in, keys()) is deprecated and stops working in the next release; detrain's other "
    "numbers are in metrics.details"
)


CURVE_NAMES = ("Precision-Recall(B)", "F1-Confidence(B)", "Precision-Confidence(B)", "Recall-Confidence(B)")
Curve = tuple[np.ndarray, np.ndarray, str, str]


def curves_of(summary: DetMetrics) -> dict[str, Curve]:
    """The curves a validation's plots draw, by Ultralytics' names: name -> (x, y, x label, y label), ``y`` one row
    per class with ground truth (``summary.curve_classes``, Ultralytics' ``ap_class_index``). Precision-Recall is
    COCO's at IoU 0.5 over its 101 recall points; F1, P and R are over 1000 confidence thresholds.

    >>> from detrain.metrics.summary import coco_summary
    >>> {name: (len(x), y.shape, xl, yl) for name, (x, y, xl, yl) in curves_of(coco_summary([], nc=2)).items()}
    ... # doctest: +NORMALIZE_WHITESPACE
    {'Precision-Recall(B)': (101, (0, 101), 'Recall', 'Precision'),
     'F1-Confidence(B)': (1000, (0, 1000), 'Confidence', 'F1'),
     'Precision-Confidence(B)': (1000, (0, 1000), 'Confidence', 'Precision'),
     'Recall-Confidence(B)': (1000, (0, 1000), 'Confidence', 'Recall')}
    """
    s = summary
    return dict(
        zip(
            CURVE_NAMES,
            (
                (s.recall_grid, s.pr_curve, "Recall", "Precision"),
                (s.conf_grid, s.f1_curve, "Confidence", "F1"),
                (s.conf_grid, s.p_curve, "Confidence", "Precision"),
                (s.conf_grid, s.r_curve, "Confidence", "Recall"),
            ),
        )
    )


def _defined(value: Any) -> float:
    """COCO's -1 ("no ground truth") as Ultralytics' 0."""
    return max(float(value), 0.0)


@dataclass(eq=False)
class BoxMetric:
    """Ultralytics' ``metrics.box``: means over the classes that have ground truth, and per-class arrays over
    those classes (``ap_class_index`` names them). Not here: Ultralytics' ``all_ap`` (per-class AP at each IoU)."""

    map: float = 0.0  # mAP50-95
    map50: float = 0.0
    map75: float = 0.0
    mp: float = 0.0  # mean precision at the F1-optimal confidence
    mr: float = 0.0  # mean recall there
    nc: int = 0  # every class the model knows, ground truth or not
    ap_class_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    p: np.ndarray = field(default_factory=lambda: np.zeros(0))
    r: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ap50: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ap: np.ndarray = field(default_factory=lambda: np.zeros(0))  # AP50-95 per class

    @property
    def f1(self) -> np.ndarray:
        return 2 * self.p * self.r / (self.p + self.r + 1e-16)

    @property
    def maps(self) -> np.ndarray:
        """(nc,) AP50-95 of every class; a class without ground truth reads the mean (as in Ultralytics)."""
        maps = np.full(self.nc, self.map)
        maps[self.ap_class_index] = self.ap
        return maps

    def fitness(self) -> float:
        """mAP50-95, what picks best.pt (as Ultralytics 8.4 weighs it)."""
        return self.map

    def mean_results(self) -> list[float]:
        """[mp, mr, map50, map]."""
        return [self.mp, self.mr, self.map50, self.map]

    def class_result(self, i: int) -> tuple[float, float, float, float]:
        """(p, r, ap50, ap) of the ``i``-th class of ``ap_class_index``."""
        return float(self.p[i]), float(self.r[i]), float(self.ap50[i]), float(self.ap[i])


class _KeyNames(list[str]):
    """Ultralytics' ``metrics.keys`` (a list of names) that can still be called as the old dict's ``keys()``."""

    def __init__(self, names: tuple[str, ...], owner: DetectionMetrics) -> None:
        super().__init__(names)
        self._owner = owner

    def __call__(self) -> list[str]:
        return list(self._owner._old().keys())


@dataclass(eq=False)
class DetectionMetrics:
    """The final validation of a ``train()`` or a ``val()``; printable (one line) and picklable."""

    box: BoxMetric = field(default_factory=BoxMetric)
    names: dict[int, str] = field(default_factory=dict)
    # ms per image: preprocess (to the device, as floats), inference (forward), postprocess (NMS); loss is 0
    # (detrain's validator computes none). Rank 0's, over its share of the images.
    speed: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SPEED_STAGES, 0.0))
    save_dir: Path | None = None
    # everything the validator (or trainer) reported but names, speed and the arrays below: the old dict, save_dir
    # included
    details: dict[str, Any] = field(default_factory=dict)
    # the summed confusion counts (None: the result carried none); the curves by name (curves_of)
    confusion_matrix: ConfusionMatrix | None = None
    curve_data: dict[str, Curve] = field(default_factory=dict)

    @classmethod
    def from_results(cls, result: dict[str, Any], names: dict[int, str] | None = None) -> DetectionMetrics:
        """From the dict the validator (``val``) or the trainer (``train``) returns; ``names``: the classes when
        the dict does not carry them."""
        names = {int(k): str(v) for k, v in (result.get("names") or names or {}).items()}
        per_class = {int(k): v for k, v in (result.get("per_class") or {}).items()}
        index = np.array(sorted(per_class), np.int64)
        column = [per_class[int(k)] for k in index]
        box = BoxMetric(
            map=_defined(result.get("map", 0.0)),
            map50=_defined(result.get("map50", 0.0)),
            map75=_defined(result.get("map75", 0.0)),
            mp=float(result.get("precision", 0.0)),
            mr=float(result.get("recall", 0.0)),
            nc=max(len(names), int(index.max()) + 1 if len(index) else 0),
            ap_class_index=index,
            p=np.array([c["p"] for c in column], np.float64),
            r=np.array([c["r"] for c in column], np.float64),
            ap50=np.array([c["ap50"] for c in column], np.float64),
            ap=np.array([c["ap"] for c in column], np.float64),
        )
        speed = {k: float((result.get("speed") or {}).get(k, 0.0)) for k in SPEED_STAGES}
        save_dir = Path(result["save_dir"]) if result.get("save_dir") else None
        details = {k: v for k, v in result.items() if k not in ("names", "speed", "confusion", "curves")}
        confusion = None
        if result.get("confusion") is not None:
            counts = np.asarray(result["confusion"], np.int64)
            confusion = ConfusionMatrix(len(counts) - 1)
            confusion.matrix = counts
        curves = {str(k): v for k, v in (result.get("curves") or {}).items()}
        return cls(box, names, speed, save_dir, details, confusion_matrix=confusion, curve_data=curves)

    # ------------------------------------------------------------------ Ultralytics' DetMetrics
    @property
    def curves(self) -> list[str]:
        """The curves' names: Precision-Recall(B), F1-Confidence(B), Precision-Confidence(B), Recall-Confidence(B)."""
        return list(self.curve_data)

    @property
    def curves_results(self) -> list[list[Any]]:
        """Each curve of :attr:`curves` as [x, y, x label, y label]; ``y`` has one row per class of
        ``box.ap_class_index``."""
        return [list(curve) for curve in self.curve_data.values()]

    @property
    def results_dict(self) -> dict[str, float]:
        """Mean precision, recall, mAP50, mAP50-95 and fitness under Ultralytics' keys."""
        return dict(zip((*RESULT_KEYS, "fitness"), (*self.box.mean_results(), self.fitness)))

    @property
    def fitness(self) -> float:
        return self.box.fitness()

    @property
    def maps(self) -> np.ndarray:
        return self.box.maps

    @property
    def ap_class_index(self) -> np.ndarray:
        return self.box.ap_class_index

    @property
    def keys(self) -> _KeyNames:
        """Ultralytics' result key names; called as ``keys()`` it is the old dict's (deprecated)."""
        return _KeyNames(RESULT_KEYS, self)

    def mean_results(self) -> list[float]:
        return self.box.mean_results()

    def class_result(self, i: int) -> tuple[float, float, float, float]:
        return self.box.class_result(i)

    @property
    def nt_per_class(self) -> np.ndarray:
        """(nc,) ground-truth boxes per class."""
        return self._per_class_count("n_gt")

    @property
    def nt_per_image(self) -> np.ndarray:
        """(nc,) images holding each class."""
        return self._per_class_count("n_images")

    def _per_class_count(self, key: str) -> np.ndarray:
        counts = np.zeros(self.box.nc, np.int64)
        for c, row in (self.details.get("per_class") or {}).items():
            counts[int(c)] = int(row.get(key, 0))
        return counts

    def __repr__(self) -> str:
        b, s = self.box, self.speed
        return (
            f"DetectionMetrics(mAP50-95 {b.map:.4f}, mAP50 {b.map50:.4f}, mAP75 {b.map75:.4f}, P {b.mp:.4f}, "
            f"R {b.mr:.4f}, {len(b.ap_class_index)}/{b.nc} classes with ground truth; ms per image: preprocess "
            f"{s['preprocess']:.1f}, inference {s['inference']:.1f}, postprocess {s['postprocess']:.1f}; "
            f"save_dir {self.save_dir})"
        )

    # ------------------------------------------------------------------ the old dict, deprecated
    def _old(self) -> dict[str, Any]:
        deprecated("metrics-as-dict", _DICT_USE, stacklevel=4)
        return self.details

    def __getitem__(self, key: str) -> Any:
        return self._old()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._old().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._old()

    def __iter__(self) -> Iterator[str]:
        return iter(self._old())

    def items(self) -> Any:
        return self._old().items()

    def values(self) -> Any:
        return self._old().values()
