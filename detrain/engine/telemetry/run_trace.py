"""A run's trace in its folder: ``events.jsonl`` (:mod:`detrain.engine.telemetry.events`) and ``manifest.json``
(:mod:`detrain.engine.telemetry.manifest`), kept by rank 0 from the start of training to its end.

Events, in the order they are written:

* ``start``: ``world_size``, ``epochs``, ``first_epoch`` (1-based) and ``world``: every rank's ``rank``,
  ``local_rank``, ``node``, ``host``, ``device`` (and ``device_name`` on CUDA), ``pid`` and ``launcher_pid`` (its
  node's launcher, which the node's restarts keep);
* ``restart`` (a start after the launcher restarted the workers, or a ``resume``): ``launcher_restart_count``
  (``TORCHELASTIC_RESTART_COUNT``), ``resumed_from`` (the checkpoint, or null when none had been saved yet),
  ``epoch`` (the 1-based epoch it continues with) and ``step`` (the batches already trained, over the run), and
  ``dataset_changed`` (``from``/``to`` fingerprints) when the dataset's files differ from the manifest's;
* ``membership`` (a restart or resume whose nodes differ from the previous ``start``'s in this folder):
  ``previous_world_size``, ``world_size``, ``left``/``joined`` (how many workers each host lost or gained) and
  ``left_nodes``/``joined_nodes`` (each node that left or joined: ``host``, ``launcher_pid``, ``workers``);
* ``straggler`` (per epoch and rank): ``epoch``, ``rank``, ``node``, ``host``, ``cause`` (``data_wait`` or
  ``compute``), ``ms_per_step`` and ``others_median_ms`` (:func:`detrain.engine.telemetry.epoch_stats.stragglers`);
* ``nonfinite`` (per update skipped for a NaN or infinity, :mod:`detrain.engine.train.nonfinite`): ``epoch``,
  ``batch`` (1-based), ``what`` (``loss`` or ``gradients``), ``ranks`` (how many saw a non-finite loss) and
  ``in_a_row``;
* ``checkpoint_fallback`` (before ``start``, written by resume: :mod:`detrain.engine.train.state.resume_state`):
  ``damaged`` (a ``last.pt`` or ``mid.pt`` that does not load), ``instead`` (the file taken) and ``reason``;
* ``end``: ``status`` (``completed``, ``stopped_early``, ``interrupted`` or ``failed``), ``epoch`` (the last
  whose training loop finished, 1-based; null if none), ``weights`` (the sha256 of best.pt, last.pt and mid.pt,
  those there), ``metrics`` (the last validation's numbers, after a normal end) and for a failure ``error``, its
  one line. A process
  killed outright (SIGKILL, or the launcher's SIGTERM after a peer died) writes no end: the next ``start``
  follows directly.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from detrain.config.cfg import Cfg
from detrain.data.labels.report_file import write_label_reports
from detrain.distributed import dist
from detrain.distributed.world import World
from detrain.distributed.world_layout import describe_nodes, gather_layout, membership_change
from detrain.engine.telemetry.epoch_stats import stragglers
from detrain.engine.telemetry.events import EventLog
from detrain.engine.telemetry.manifest import same_kind, split_fingerprint, write_start
from detrain.engine.telemetry.node_voice import NodeVoice
from detrain.log import console
from detrain.weights.hub import file_sha256

ERROR_CHARS = 1000  # an end event's error line is cut to this length


class RunTrace:
    """The events of one start of a run; every method is a no-op on ranks other than 0."""

    def __init__(
        self,
        save_dir: str | Path,
        main: bool,
        epochs: int,
        first_epoch: int,
        world: list[dict[str, Any]],
        restarts: int = 0,
    ) -> None:
        self.save_dir = Path(save_dir)
        self.events = EventLog(self.save_dir / "events.jsonl", main)
        self.main, self.epochs, self.first_epoch, self.world = main, epochs, first_epoch, world
        self.restarts = restarts  # the launcher's restart count (World.restart_count)
        self.last_epoch: int | None = None  # 0-based, the last epoch whose numbers came in
        self.ended = False
        self.voice: NodeVoice | None = None  # a node other than node 0: its lowest rank's own lines

    def record_start(self, cfg: Cfg, step: int, resumed_from: str | None, datasets: Iterable[Any]) -> None:
        """The start (with a restart and a membership change where there is one) and the manifest (rank 0)."""
        if not self.main:
            return
        previous = self.events.last("start")
        restarts = self.restarts
        restarted = restarts > 0 or resumed_from is not None
        self.events.write(
            "start", world_size=len(self.world), epochs=self.epochs, first_epoch=self.first_epoch + 1, world=self.world
        )
        datasets = list(datasets)
        # labels_train.txt, labels_val.txt: every file skipped or corrected, and why (splits that verified labels)
        write_label_reports(self.save_dir, *(d for d in datasets if getattr(d, "report", None) is not None))
        dataset = split_fingerprint(datasets, content=cfg.inputs.fingerprint == "content")
        manifest = write_start(
            self.save_dir / "manifest.json",
            cfg.to_dict(),
            dataset,
            restarted=restarted,
            launcher_restarts=restarts,
            resumed_from=resumed_from,
        )
        if restarted:
            fields: dict[str, Any] = {
                "launcher_restart_count": restarts,
                "resumed_from": resumed_from,
                "epoch": self.first_epoch + 1,
                "step": step,
            }
            before = manifest.get("dataset")
            before = before.get("fingerprint") if isinstance(before, dict) else None
            now = dataset["fingerprint"]
            if isinstance(before, str) and same_kind(before, now) and before != now:  # paths vs content: unknown
                fields["dataset_changed"] = {"from": before, "to": dataset["fingerprint"]}
                console.print(
                    f"note: the dataset's files changed since this run started ({before} -> {dataset['fingerprint']})"
                )
            self.events.write("restart", **fields)
        earlier = previous.get("world") if previous else None
        if restarted and isinstance(earlier, list) and all(isinstance(p, dict) for p in earlier):
            # the previous start is this run's (a fresh start in a reused folder follows another run's)
            change = membership_change(earlier, self.world)
            if change is not None:
                self.events.write("membership", **change)
                console.print(
                    f"membership: {change['previous_world_size']} -> {change['world_size']} workers; "
                    f"left {describe_nodes(change['left_nodes'])}; "
                    f"joined {describe_nodes(change['joined_nodes'])}"
                )

    def epoch(self, epoch: int, stats: list[dict[str, Any]]) -> None:
        """Note that ``epoch`` (0-based) finished training; flag its stragglers (from every rank's numbers)."""
        self.last_epoch = epoch
        if self.voice is not None:
            self.voice.epoch(epoch, self.epochs, stats)
        if not self.main:
            return
        for s in stragglers(stats):
            self.events.write("straggler", epoch=epoch + 1, **s)
            what = "waits for its data" if s["cause"] == "data_wait" else "computes its forward"
            console.print(
                f"straggler: rank {s['rank']} (node {s['node']}, {s['host']}) {what} {s['ms_per_step']:.0f} "
                f"ms a step; the other ranks' median {s['others_median_ms']:.0f} ms"
            )

    def end(self, error: BaseException | None, metrics: Mapping[str, Any] | None = None) -> None:
        """The end event: how the run ended (``error``: what ended it, None for a normal return), the sha256 of each
        checkpoint the run folder holds then, and the last validation's numbers (``metrics``)."""
        if not self.main or self.ended:
            return
        self.ended = True
        finished = None if self.last_epoch is None else self.last_epoch + 1
        fields: dict[str, Any] = {"epoch": finished, "weights": weights_sha256(self.save_dir / "weights")}
        numbers = {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if numbers:
            fields["metrics"] = numbers
        if isinstance(error, KeyboardInterrupt):
            status = "interrupted"
        elif error is not None:
            status = "failed"
            text = str(error).strip()
            line = text.splitlines()[0] if text else ""
            fields["error"] = (f"{type(error).__name__}: {line}" if line else type(error).__name__)[:ERROR_CHARS]
        elif (finished or self.first_epoch) >= self.epochs:
            status = "completed"
        else:
            status = "stopped_early"
        self.events.write("end", status=status, **fields)


CHECKPOINTS = ("best.pt", "last.pt", "mid.pt")


def weights_sha256(folder: Path) -> dict[str, str]:
    """The sha256 of each of :data:`CHECKPOINTS` in ``folder`` (those there), for the end event: what the run
    delivered, checkable against any copy of it."""
    return {name: file_sha256(folder / name) for name in CHECKPOINTS if (folder / name).is_file()}


def start(
    save_dir: str | Path,
    cfg: Cfg,
    world: World,
    device: torch.device,
    *,
    first_epoch: int,
    step: int,
    resumed_from: str | None,
    datasets: Iterable[Any],
) -> RunTrace:
    """Gather the world's layout (every rank calls this) and record the start on rank 0 (see the module)."""
    layout = gather_layout(world, device)  # collective: every rank's place
    trace = RunTrace(save_dir, world.is_main, cfg.train.epochs, first_epoch, layout, world.restart_count)
    trace.voice = NodeVoice.of(world.rank, layout)
    if trace.voice is not None:
        trace.voice.joined(cfg.train.epochs, first_epoch)
    trace.record_start(cfg, step, resumed_from, datasets)
    # collective: the ranks wait for rank 0's manifest, under prepare_timeout: listing a large dataset's files for the
    # fingerprint can outlast a training collective's timeout
    dist.barrier("run manifest written", cfg.distributed.prepare_timeout)
    return trace


@contextmanager
def ended(owner: Any) -> Iterator[None]:
    """Around a training run: writes the end event of ``owner.trace`` (once it exists) however the run ends, and
    ends the experiment trackers of ``owner.loggers`` (once they exist) of a run that raised as FAILED (KILLED for
    Ctrl-C or a signal)."""
    try:
        yield
    except BaseException as e:
        trace = getattr(owner, "trace", None)
        if trace is not None:
            trace.end(e)
        loggers = getattr(owner, "loggers", None)
        if loggers is not None:
            with contextlib.suppress(Exception):  # the run's own error is the one to report
                loggers.close("KILLED" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "FAILED")
        raise
    trace = getattr(owner, "trace", None)
    if trace is not None:
        trace.end(None, getattr(owner, "metrics", None))
