"""The arguments every node of one run must share, compared across nodes at start
(:func:`detrain.distributed.node_consistency.check_nodes`).

Each node is started with its own command line. Two that differ in what every rank's steps follow (the epochs,
the batch, the optimizer, the augmentation, ``parallel=``, ``sync_bn=``, when checkpoints are saved) would train
different models in one group, or call different collectives and hang until ``dist_timeout``. What a node may
choose for itself is left out: its paths (``data=`` is compared by the dataset's identity, ``model=`` by the
weights every rank receives from rank 0), its devices and loader workers, its run folder, its network interface,
and what only rank 0 does (plots, trackers, printing).

>>> from detrain.config.cfg import make_cfg
>>> shared_settings(make_cfg({"parallel": "fsdp"}))["parallel"]
'fsdp'
>>> "device" in shared_settings(make_cfg({}))
False
"""

from __future__ import annotations

import dataclasses
from typing import Any

from detrain.config.cfg import Cfg

_SECTIONS = ("train", "loss", "augment")  # every key, but those below
_LEFT_OUT = {"train": {"resume"}}  # a path on the node's own disk; the checkpoint it names is compared by epoch
_PICKED = {
    "inputs": ("imgsz", "fraction", "single_cls", "classes", "max_pixels", "cache", "augment_device"),
    "distributed": ("sync_bn", "parallel"),
    "output": ("save", "save_period", "save_interval", "save_replicas"),
}


def shared_settings(cfg: Cfg) -> dict[str, str]:
    """``cfg``'s arguments that must be alike on every node, by key, as text (a list or None compares as shown)."""
    out: dict[str, Any] = {}
    for section in _SECTIONS:
        values = getattr(cfg, section)
        for field in dataclasses.fields(values):
            if field.name not in _LEFT_OUT.get(section, set()):
                out[field.name] = getattr(values, field.name)
    for section, names in _PICKED.items():
        values = getattr(cfg, section)
        out |= {name: getattr(values, name) for name in names}
    return {k: str(v) for k, v in sorted(out.items())}
