"""``time=``: train for a number of hours instead of a number of epochs, with a whole learning-rate schedule.

As in Ultralytics, the run starts with ``epochs`` as its estimate; after every epoch (validation and checkpoint
included) the measured mean epoch time says how many epochs fit in the hours, and the run is re-planned for
that many: the lr schedule is rebuilt so that it still ends at ``lr0 * lrf`` after the last epoch, warmup and
``close_mosaic`` refer to the new last epochs. The run stops at the end of the epoch the estimate makes the last.

Unlike Ultralytics the estimate counts only whole epochs that fit in what is left (it rounds down, and a run
never stops inside an epoch), so a run ends before its time is up unless an epoch runs much slower than the
mean: every epoch is complete, validated and in ``results.csv``, and ``resume`` continues exactly.

Every rank measures, rank 0's estimate is taken by all (one broadcast an epoch), so all ranks re-plan to the
same number of epochs and leave the loop together. The seconds used go into ``last.pt``: a resumed run has only
what is left of the hours (measured afresh on the machine it resumes on).

>>> budget = TimeBudget(hours=1.0)
>>> budget.epochs_that_fit(epochs_done=1) > 1000  # after the first epoch, on every rank: it took microseconds
True
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from detrain.config.cfg import INT_LIMIT, Cfg, replace_cfg
from detrain.distributed import dist

clock: Callable[[], float] = time.monotonic  # seconds; read once at the start and once per epoch (tests replace it)


class TimeBudget:
    """The hours of ``time=`` and the seconds already used; :meth:`epochs_that_fit` re-plans the run's length.

    ``spent_s``: seconds used before this process started (a resumed run's, from its checkpoint).
    """

    def __init__(self, hours: float, spent_s: float = 0.0) -> None:
        self.total_s = float(hours) * 3600.0
        self.spent_before_s = float(spent_s)
        self.spent_s = self.spent_before_s
        self.started = clock()
        self.epochs_here = 0  # epochs finished by this process

    def estimate(self, epochs_done: int) -> int:
        """This rank's estimate, after an epoch (``epochs_done`` finished in the whole run, resumed ones
        included): the epochs done plus the whole epochs of this process's mean length that fit in what is left;
        never fewer than ``epochs_done``.

        >>> import itertools, detrain.engine.train.time_budget as tb
        >>> ticks = itertools.count(0, 40); tb.clock = lambda: float(next(ticks))  # each epoch takes 40 s
        >>> budget = TimeBudget(hours=0.05)  # 180 s
        >>> [budget.estimate(done) for done in (1, 2, 3, 4)]
        [4, 4, 4, 4]
        >>> tb.clock = time.monotonic
        """
        self.epochs_here += 1
        ran = clock() - self.started
        self.spent_s = self.spent_before_s + ran
        per_epoch = max(ran / self.epochs_here, 1e-9)
        more = math.floor((self.total_s - self.spent_s) / per_epoch + 1e-9)  # 1e-9: 180/45 stays 4, not 3.99..
        return int(min(epochs_done + max(more, 0), INT_LIMIT))

    def epochs_that_fit(self, epochs_done: int) -> int:
        """Rank 0's :meth:`estimate`, on every rank (a collective: every rank calls it after every epoch)."""
        return int(dist.agree(self.estimate(epochs_done)))  # collective: rank 0's estimate on every rank


def replanned(cfg: Cfg, epochs: int) -> Cfg:
    """``cfg`` for a run of ``epochs`` epochs (what a resumed run and the checkpoint's ``train_args`` read)."""
    return cfg if epochs == cfg.train.epochs else replace_cfg(cfg, {"epochs": epochs})


def rescheduled(
    optimizer: torch.optim.Optimizer, lr_lambda: Callable[[float], float], next_epoch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following ``lr_lambda`` that stands where the replaced one stood: its next epoch is
    ``next_epoch`` and the optimizer's lr is set to ``initial_lr * lr_lambda(next_epoch)`` now. Its state
    dict has the form the old one had, so ``last.pt`` and ``resume`` keep working."""
    with warnings.catch_warnings():  # building one steps it once: torch warns if no optimizer step came first
        warnings.simplefilter("ignore", UserWarning)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lr_lambda, last_epoch=next_epoch - 1)


def mosaic_due(cfg: Cfg, epoch: int) -> bool:
    """Whether ``epoch`` (0-based) is one of the last ``close_mosaic`` epochs of the run as now planned.

    >>> from detrain.config.cfg import make_cfg
    >>> [mosaic_due(make_cfg({"epochs": 5, "close_mosaic": 2}), e) for e in range(5)]
    [False, False, False, True, True]
    """
    return bool(cfg.train.close_mosaic) and epoch >= cfg.train.epochs - cfg.train.close_mosaic


def close_mosaic_when_due(dataset: Any, cfg: Cfg, epoch: int, verbose: bool = True) -> None:
    """At the start of ``epoch``: switch the training set's mosaic off for good (in its loader workers too) when
    the epoch is one of the last ``close_mosaic`` as now planned. A later estimate that adds epochs leaves it off:
    once the last epochs have begun, the estimate is seldom off by more than one."""
    if mosaic_due(cfg, epoch) and dataset.mosaic_active:
        dataset.close_mosaic()
        if verbose:
            from detrain.log import console

            console.print(f"closing mosaic for the last {cfg.train.close_mosaic} epochs")
