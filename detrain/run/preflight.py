"""The files and folders a command names, checked before any process starts, any folder is made or any data
is generated: a missing dataset yaml or weights file is one line at once, not an error from a spawned worker.

The checks only look: nothing is downloaded or written, and nothing read but a model yaml (its scale, and its
layer count for ``freeze``). What a file holds is checked by the code that reads it (the dataset yaml's keys, the
checkpoint's contents), which runs before the run folder is made too.

>>> from detrain.config.cfg import make_cfg
>>> check_inputs("train", make_cfg({"data": "coco8.yaml"}))
"""

from __future__ import annotations

from pathlib import Path

from detrain.config.cfg import Cfg
from detrain.data.dataset_yaml import find_dataset_yaml
from detrain.distributed.world import World
from detrain.engine.build import check_model, check_output_folder
from detrain.engine.telemetry import run_loggers
from detrain.engine.train.freeze import check_freeze
from detrain.engine.train.pretrained import check_pretrained
from detrain.engine.train.reproduce import find_resume_checkpoint
from detrain.engine.train.state.resume_state import may_host_rank0
from detrain.errors import ConfigError


def check_inputs(task: str, cfg: Cfg, world: World | None = None) -> None:
    """Raise the error the ``task`` (train, val, predict) would meet later for a path in ``cfg`` that names no
    usable file, and for a run folder that cannot be made. ``world``: this process's (None: a plain one)."""
    if task == "train" and cfg.distributed.node_rank == 0:
        run_loggers.check(cfg)  # mlflow=true or wandb=true without the library: the install line, now
    if task == "train" and cfg.train.resume:
        # rank 0 alone reads it and sends it to the others (resume_state.py)
        if may_host_rank0(world or World(), cfg.distributed.node_rank):
            find_resume_checkpoint(cfg)  # a resumed run takes its model and data from the checkpoint
        return
    if task in ("train", "val"):
        find_dataset_yaml(cfg.inputs.data)
    if task == "val" and cfg.predict.predictions:
        if not Path(cfg.predict.predictions).is_file():
            raise ConfigError(f"predictions file not found: {cfg.predict.predictions} (a COCO results json)")
    else:
        check_model(cfg.inputs.model, task)
    if task == "train":
        check_pretrained(cfg.inputs.pretrained)
        check_freeze(cfg.inputs.model, cfg.train.freeze)  # a look at the model yaml's layer count
    if cfg.distributed.node_rank == 0:  # only the first node writes
        check_output_folder(cfg.output.project, task, cfg.output)
