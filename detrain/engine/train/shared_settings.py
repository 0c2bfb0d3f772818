"""The arguments every node of one run must share, compared across nodes at start
(:func:`detrain.distributed.launch.node_consistency.check_nodes`).

Each node is started with its own command line. Two that differ in what every rank's steps follow (the epochs,
the batch, the optimizer, the augmentation, ``parallel=``, ``sync_bn=``, when checkpoints are saved, validation's
thresholds, when a restart or a preemption stops) would train different models in one group, or call different
collectives and hang until ``dist_timeout``. The keys a node may choose for itself are those ``config/keys.py``
marks ``per_node`` (its devices and loader workers, its run folder, its network interface, and what only rank 0
does: plots, trackers, printing); every other key training takes is compared here, but for :data:`BY_WHAT_THEY_NAME`.

>>> from detrain.config.cfg import make_cfg
>>> shared_settings(make_cfg({"parallel": "fsdp"}))["parallel"]
'fsdp'
>>> "device" in shared_settings(make_cfg({})), "cache" in shared_settings(make_cfg({}))
(False, True)
"""

from __future__ import annotations

from detrain.config.cfg import Cfg
from detrain.config.keys import COMMAND_KEYS, PER_NODE_KEYS

# Keys every node gives alike (a derived run id hashes them) that are not compared by their value: each names
# something on a node's own disk, compared by what it holds (model=, pretrained= and weights_sha256=: the weights
# every rank receives from rank 0; data= and the download limits: the dataset's identity, node_consistency's
# image counts and file fingerprint; resume=: the checkpoint, by its epoch), or says how the nodes meet, which the
# group has done by now (another spelling of the master's address may have reached it all the same).
BY_WHAT_THEY_NAME = frozenset(
    {
        "model",
        "pretrained",
        "weights_sha256",
        "data",
        "download_max_gb",
        "download_max_unpacked_gb",
        "download_max_files",
        "download_anywhere",
        "resume",
        "nnodes",
        "master_addr",
        "master_port",
        "rdzv_backend",
    }
)
COMPARED = tuple(k for k in COMMAND_KEYS["train"] if k not in PER_NODE_KEYS and k not in BY_WHAT_THEY_NAME)


def shared_settings(cfg: Cfg) -> dict[str, str]:
    """``cfg``'s arguments that must be alike on every node, by key, as text (a list or None compares as shown)."""
    return {k: str(cfg.get(k)) for k in sorted(COMPARED)}
