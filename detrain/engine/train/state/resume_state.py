"""Where a training run starts, afresh or from one of its checkpoints, agreed by every rank.

Nodes share no disk, and only rank 0 writes files. At every start the first process of each node looks on its
own disk for the furthest checkpoint of this run (rank 0 also for ``resume=``'s); all of them report what they
found, and the one that holds the furthest (rank 0 on a tie) sends that checkpoint to every rank over the process
group: model, EMA, optimizer, scaler, schedule, epoch, batch position, RNG, waiting gradients. Whether a start is
a resume, from which file, epoch and batch, is the same decision on every rank. A node that never held the run
folder, a restarted worker and a node that joins a group that never failed all resume alike: nothing here reads a
rank's own restart count.

Under detrain's launcher rank 0 is always on node_rank 0, which holds the run folder (see
:func:`detrain.distributed.launch.launcher.rendezvous_address`). Under torchrun or srun, rank 0 may be on another node
than the checkpoint (the group re-formed with the nodes numbered otherwise); that node then also sends the run's
record (:mod:`detrain.engine.train.state.run_record`), which rank 0 puts in its own run folder before it goes on there.

A checkpoint is *this run's* when it carries this launch's id (``launch_id``), or, after a SLURM requeue, this
job's (``job_id``). The id makes the difference between a restarted group, which must continue, and a new run
given ``exist_ok=True``, which must not pick up an older run's ``last.pt`` from the same folder:

* detrain's launcher: node 0's launcher draws an id per launch and picks the run folder before any worker
  starts; every start of a worker group under it (after any restart, or a membership change that raised no
  restart count) looks in that folder;
* torchrun (or any elastic agent that does not give an id): the agent process's host, pid and start time, which
  its restarts keep; the folder is the newest of project/name's (``name``, ``name2``, ...) or ``name`` itself;
* a SLURM requeue (``SLURM_RESTART_COUNT`` > 0): any checkpoint of the job in those folders;
* ``resume=path`` (or True, rank 0 only): that checkpoint, or ``mid.pt`` beside a ``last.pt`` when it is further
  on and of the same launch, unless this launch has written a checkpoint of its own since (a restart after the
  resume), on any node.

Of the candidates (``weights/mid.pt`` and ``weights/last.pt``), the one furthest on wins.
"""

from __future__ import annotations

import io
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detrain.config.cfg import LAUNCH_KEYS, SPECS_DEFAULTS, Cfg, make_cfg
from detrain.data.memory.process_owner import start_ticks
from detrain.distributed import dist
from detrain.distributed.parallel import sync_buffers_next_forward
from detrain.distributed.world import World
from detrain.engine.telemetry.events import EventLog
from detrain.engine.train.reproduce import find_resume_checkpoint, rng_state
from detrain.engine.train.state import rank_state, run_record
from detrain.errors import CheckpointError, DetrainError
from detrain.log import console
from detrain.system.text import excerpt
from detrain.weights.checkpoint import PREVIOUS, load_checkpoint

MID, LAST = "mid.pt", "last.pt"


@dataclass(frozen=True)
class Launch:
    """This start's identity, as rank 0 sees it: which checkpoints are this run's, and where to look for them."""

    id: str | None  # this launch's (kept by its restarts); None: a plain process, whose checkpoints nobody resumes
    job: str | None  # the SLURM job's, kept by a requeue
    requeued: int  # SLURM_RESTART_COUNT
    restarts: int  # TORCHELASTIC_RESTART_COUNT (for the message only)
    search_series: bool  # the run folder was not handed over: look in project/name's newest folders

    @classmethod
    def here(cls, world: World, given: str | None = None) -> Launch:
        """The identity of this process's launch in ``world``: ``given`` by detrain's launcher, else its elastic
        agent's."""
        job = f"slurm:{world.slurm_job_id}" if world.slurm_job_id else None
        requeued = world.slurm_requeues if job else 0
        agent = given is None and world.run_id is not None  # torchrun: no launcher of ours picked a folder
        launch_id = given if given is not None else (_agent_identity() if agent else None)
        return cls(launch_id, job, requeued, world.restart_count, agent or requeued > 0)

    def owns(self, ckpt: dict[str, Any]) -> bool:
        """Whether ``ckpt`` was written by this launch (or, after a requeue, by this job).

        >>> Launch("a", None, 0, 0, False).owns({"launch_id": "a"}), Launch("a", None, 0, 0, False).owns({})
        (True, False)
        """
        mine = ckpt.get("launch_id")
        if self.id is not None and isinstance(mine, str) and mine == self.id:
            return True
        job = ckpt.get("job_id")
        return bool(self.requeued and self.job is not None and isinstance(job, str) and job == self.job)

    def stamp(self) -> dict[str, str | None]:
        """What a checkpoint records of its launch."""
        return {"launch_id": self.id, "job_id": self.job}

    def reason(self) -> str:
        """Why a checkpoint of this run is there to resume from, for the one line rank 0 prints."""
        if self.restarts:
            return f"restart {self.restarts}"
        if self.requeued:
            return f"requeue {self.requeued}"
        return "group restarted"


@dataclass(frozen=True)
class Start:
    """What every rank agreed on: the arguments, rank 0's run folder (None: still to be made; on ranks > 0 it
    is only informative) and the checkpoint to resume from (None: a fresh start)."""

    cfg: Cfg
    save_dir: str | Path | None
    ckpt: dict[str, Any] | None
    launch: Launch


def agree(cfg: Cfg, save_dir: str | Path | None, launch: Launch, world: World) -> Start:
    """Every node's first process finds the furthest checkpoint of this run on its own disk; every rank gets the
    furthest of all from the rank that holds it (see the module).

    A collective in the group of ``world`` (call on every rank). A bad checkpoint or resume argument on any node
    raises the same one-line error on every rank."""
    found: tuple[Path, dict[str, Any], bool] | None = None
    report: tuple[Any, ...] = ("none",)
    if world.local_rank == 0:  # one process per node reads that node's disk
        try:
            found = _choose(cfg, save_dir, launch, explicit=world.is_main)
            if found is not None:
                path, ckpt, auto = found
                report = ("found", _furthest_key(ckpt), str(path), auto, socket.gethostname(), describe(ckpt))
        except DetrainError as e:
            report = ("error", e, socket.gethostname())
        except OSError as e:  # an unreadable folder or file on this node's disk
            report = (
                "error",
                CheckpointError(f"cannot read {e.filename or 'the run folder'}: {e.strerror}"),
                socket.gethostname(),
            )
    reports = _gather(report, cfg.distributed.prepare_timeout, world)
    holder = _holder(reports)  # the same on every rank
    if holder is None:
        return Start(cfg, save_dir, None, launch)
    _, _, where_from, auto, host, at = reports[holder]
    if world.is_main:
        by = "" if holder == 0 else f" (held by rank {holder} on {host}; its run record comes with it)"
        console.print(
            f"{launch.reason()}: resuming from {where_from} at {at}{by}"
            if auto
            else f"resuming from {where_from} at {at}{by}"
        )
    mine, found = (found if world.rank == holder else None), None  # another node's find is not needed any more
    ckpt, record = _send(mine, holder, cfg.distributed.prepare_timeout, world)
    path = Path(where_from)
    # rank 0 goes on in its own run folder (the holder's, where it is rank 0 or was handed none)
    folder = Path(save_dir) if save_dir and holder != 0 else path.parent.parent
    if world.is_main and holder != 0:
        run_record.restore(folder, record)
    # a resumed run keeps its own arguments; only the devices and the process layout (this rank's) may change
    keep = {k: cfg.get(k) for k in LAUNCH_KEYS}
    if world.is_main:
        _say_ignored(cfg, ckpt["train_args"], folder)
    # a checkpoint from before lr_scale existed trained with lr0 whatever the batch: it goes on with that recipe
    resumed = make_cfg({"lr_scale": "none", **ckpt["train_args"], **keep, "resume": str(path)})
    return Start(resumed, folder, ckpt, launch)


def ignored_keys(given: dict[str, Any], recorded: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The keys given to a resumed run (set away from their defaults) that differ from what its checkpoint recorded
    and that it does not take (it keeps its own arguments; only the launch keys may change): key -> (given, kept).

    >>> ignored_keys({"batch": 512, "epochs": 100, "device": "cpu", "resume": "x"}, {"batch": 16, "epochs": 100})
    {'batch': (512, 16)}
    """
    return {
        k: (v, recorded[k])
        for k, v in given.items()
        if k in recorded and k not in LAUNCH_KEYS and k != "resume" and v != SPECS_DEFAULTS.get(k) and v != recorded[k]
    }


def _say_ignored(cfg: Cfg, recorded: dict[str, Any], folder: Path) -> None:
    """Rank 0: one line, and a ``resume_ignored`` event, for keys given to a resumed run that it does not take
    (a different ``batch`` above all: the run goes on with the batch, and so the learning-rate recipe, it was
    planned with; a new run from its weights, ``model=.../last.pt``, is how to change them)."""
    ignored = ignored_keys(cfg.to_dict(), recorded)
    if not ignored:
        return
    listed = ", ".join(f"{k}={excerpt(v, 30)} (kept: {excerpt(was, 30)})" for k, (v, was) in ignored.items())
    console.print(
        f"note: a resumed run keeps its own arguments and its learning-rate recipe; not taken: {listed}; to change "
        "them, start a new run from its weights (model=.../weights/last.pt)"
    )
    EventLog(folder / "events.jsonl").write("resume_ignored", keys=sorted(ignored))


def describe(ckpt: dict[str, Any]) -> str:
    """Where a checkpoint continues, for people: the epoch it runs next (1-based, as the log counts them), and
    how much of it is done already.

    >>> mid = {"next_batch": 5, "step_images": 16, "mean_items": torch.zeros(3), "n_images": 80}
    >>> describe({"epoch": 1}), describe({"epoch": 0, "batches_per_epoch": 8, "mid_epoch": mid})
    ('epoch 3', 'epoch 2, 5/8 batches done')
    """
    epoch, batch = position(ckpt)
    done = f", {batch}/{ckpt['batches_per_epoch']} batches done" if batch else ""
    return f"epoch {epoch + 1}{done}"


def position(ckpt: dict[str, Any], path: str | Path = "checkpoint") -> tuple[int, int]:
    """(epoch, batch) a checkpoint continues from, both 0-based: ``last.pt`` of epoch e gives (e + 1, 0), a
    ``mid.pt`` saved after batch b of epoch e (e, b + 1). Bigger is further on. Bad fields: CheckpointError."""
    epoch = ckpt.get("epoch")
    if type(epoch) is not int or epoch < -1:
        raise CheckpointError(f"{path}: 'epoch' is {str(epoch)[:40]!r}; expected an integer of at least -1")
    mid = ckpt.get("mid_epoch")
    if mid is None:
        return epoch + 1, 0
    check_mid(ckpt, path)
    return epoch + 1, int(mid["next_batch"])


def check_mid(ckpt: dict[str, Any], path: str | Path) -> None:
    """A mid-epoch checkpoint's position fields have their types and ranges (see
    :mod:`detrain.engine.train.state.mid_epoch`)."""
    mid, per = ckpt.get("mid_epoch"), ckpt.get("batches_per_epoch")
    ok = False
    if isinstance(mid, dict) and type(per) is int and per >= 1:
        batch, step, items, images = (mid.get(k) for k in ("next_batch", "step_images", "mean_items", "n_images"))
        ok = (
            type(batch) is int
            and 1 <= batch <= per
            and type(step) is int
            and step >= 1
            and type(images) is int
            and images >= 0
            and isinstance(items, torch.Tensor)
            and items.shape == (3,)
            and items.is_floating_point()
            and bool(torch.isfinite(items).all())
        )
    if not ok:
        raise CheckpointError(
            f"{path}: its mid-epoch position (mid_epoch, batches_per_epoch) is malformed; "
            f"delete it to resume from {LAST}"
        )


def series_folders(project: str, name: str, task: str = "train") -> list[Path]:
    """The run folders ``increment_run_dir`` has handed out for project/name: ``name``, ``name2``, ... up to the
    first one missing (the next run's). The last is the newest run's, the first the one ``exist_ok`` reuses."""
    root = Path(project) if project else Path("runs") / task
    base = name or "exp"
    out, path, n = [], root / base, 2
    while path.is_dir():
        out.append(path)
        path, n = root / f"{base}{n}", n + 1
    return out


def gather_per_rank(world: World) -> dict[str, Any]:
    """What differs between ranks, for the checkpoint rank 0 writes to give back to each (a collective in ``world``'s
    group; the other ranks get an empty dict): their random generators (``rng_per_rank``), about 13 kB a rank.

    BatchNorm statistics are not per rank: every rank takes rank 0's at each update
    (:func:`detrain.distributed.parallel.share_main_buffers`), so its EMA is rank 0's, and what its forward passes
    add between two updates is replaced at the next whatever it was; rank 0's are the checkpoint's own."""
    mine: dict[str, Any] = {"rng": rng_state()}
    # collective: every rank's generators as bytes, on rank 0 alone (rank_state.py: no pickles, and the other
    # ranks receive nothing); only rank 0 writes the checkpoint
    packed = dist.gather_to_main(rank_state.pack(mine))
    if packed is None:
        return {}
    everyone = [mine if r == 0 else rank_state.unpack(t, mine) for r, t in enumerate(packed)]
    return {"rng_per_rank": {str(r): s["rng"] for r, s in enumerate(everyone)}}


def restore_rank_state(model: nn.Module, ckpt: dict[str, Any]) -> None:
    """In a group, once DDP has given every rank rank 0's weights and buffers: DDP's choice to send rank 0's buffers
    before the next forward as it stood when the checkpoint was saved (after an update, yes; between two, no). The
    same on every rank: the checkpoint is. (``buffers_per_rank`` of a checkpoint written before
    :func:`detrain.distributed.parallel.share_main_buffers` existed is left unread: every rank goes on with rank
    0's.)"""
    sync_buffers_next_forward(model, _updated_last(ckpt))


def may_host_rank0(world: World, node_rank: int) -> bool:
    """Whether this process may become global rank 0, which alone reads ``resume``'s checkpoint: the ranks of
    torchrun or srun know their rank; a launcher's node has rank 0 when it is node_rank 0."""
    return world.is_main if world.launched else node_rank == 0


# ------------------------------------------------------------------------------------------------ internals


def _choose(
    cfg: Cfg, save_dir: str | Path | None, launch: Launch, explicit: bool = True
) -> tuple[Path, dict[str, Any], bool] | None:
    """The checkpoint to resume from on this node's disk (path, contents, whether found as this run's own), or
    None; ``explicit``: also ``resume=``'s (rank 0, whose node was given the file)."""
    given = find_resume_checkpoint(cfg) if cfg.train.resume and explicit else None
    folders = [Path(save_dir)] if save_dir else []
    if given is not None:
        folders.append(given.parent.parent)
    if launch.search_series:
        chain = series_folders(cfg.output.project, cfg.output.name)
        folders += chain[:1] + chain[-1:]
    best: tuple[Path, dict[str, Any], tuple[int, int]] | None = None
    seen: set[Path] = set()
    tried: dict[Path, Any] = {}  # each file is read (and a fallback said) once
    for folder in folders:
        for name in (MID, LAST):
            path = folder / "weights" / name
            if not path.is_file() or path.resolve() in seen:
                continue
            seen.add(path.resolve())
            loaded = _load_candidate(path, explicit, (folder / "weights" / LAST).is_file(), tried)
            if loaded is None:
                continue
            path, ckpt = loaded
            if launch.owns(ckpt):
                at = position(ckpt, path)
                if best is None or at > best[2]:
                    best = (path, ckpt, at)
    if best is not None:
        _check_resumable(best[1], best[0])
        return best[0], best[1], True
    if given is None:
        return None
    given, ckpt = _load_candidate(given, explicit, False, tried) or (given, {})  # None only for a skipped mid.pt
    _check_resumable(ckpt, given)
    beside = given.with_name(MID)
    loaded = _load_candidate(beside, explicit, True, tried) if given.name == LAST and beside.is_file() else None
    if loaded is not None:
        mid = loaded[1]
        written_by = ckpt.get("launch_id")
        if (
            isinstance(written_by, str)
            and mid.get("launch_id") == written_by
            and position(mid, beside) > position(ckpt, given)
        ):
            _check_resumable(mid, beside)
            return beside, mid, False
    return given, ckpt, False


def _load_or_previous(path: Path, report: bool) -> tuple[Path, dict[str, Any]]:
    """(path, checkpoint) of ``path``; where ``last.pt`` does not load (damaged: a truncated or bit-flipped zip, a
    refused pickle), of ``last.prev.pt`` beside it, the generation before, with one line (and, ``report``: rank 0,
    an event in the run folder's events.jsonl naming both files and why). Neither loads: ``path``'s own error."""
    try:
        return path, load_checkpoint(path)
    except CheckpointError as e:
        previous = path.with_name(PREVIOUS) if path.name == LAST else None
        if previous is None or not previous.is_file():
            raise
        try:
            ckpt = load_checkpoint(previous)
        except CheckpointError:
            raise e from None  # neither loads: the newer file's reason, as before
        _fell_back(path, previous, e, report)
        return previous, ckpt


def _load_candidate(
    path: Path, report: bool, last_beside: bool, tried: dict[Path, Any]
) -> tuple[Path, dict[str, Any]] | None:
    """:func:`_load_or_previous`, except that a ``mid.pt`` that does not load beside a ``last.pt`` is passed over
    with one line (and event): None, the other candidates decide. ``tried``: the answers so far, by file (a file
    is read once however many ways lead to it)."""
    key = path.resolve()
    if key not in tried:
        try:
            tried[key] = _load_or_previous(path, report)
        except CheckpointError as e:
            if path.name != MID or not last_beside:
                tried[key] = e
            else:
                _fell_back(path, path.with_name(LAST), e, report)
                tried[key] = None
    if isinstance(tried[key], CheckpointError):
        raise tried[key]
    return tried[key]


def _fell_back(damaged: Path, instead: Path, error: CheckpointError, report: bool) -> None:
    """Say that ``damaged`` does not load and ``instead`` is taken (every node that finds it; rank 0 also as a
    ``checkpoint_fallback`` event in the run folder)."""
    console.print(f"warning: {damaged} does not load ({error}); falling back to {instead.name}")
    if report:
        EventLog(damaged.parent.parent / "events.jsonl").write(
            "checkpoint_fallback", damaged=str(damaged), instead=str(instead), reason=str(error)
        )


def _furthest_key(ckpt: dict[str, Any]) -> tuple[int, float]:
    """How far on a checkpoint is, comparable between checkpoints of different world sizes (whose epochs have
    different numbers of batches): its epoch, and the share of the epoch done."""
    epoch, batch = position(ckpt)
    per = ckpt.get("batches_per_epoch")
    return epoch, (batch / per if batch and type(per) is int and per > 0 else 0.0)


def _holder(reports: list[tuple[Any, ...]]) -> int | None:
    """The rank whose checkpoint every rank resumes from (None: a fresh start), from every rank's report: the
    furthest of this run's own on any node (rank 0's on a tie, then the lowest rank's), else rank 0's
    ``resume=``. An error on any node is raised (the lowest rank's; another node's names it)."""
    for r, report in enumerate(reports):
        if report[0] == "error":
            error, host = report[1], report[2]
            raise error if r == 0 else type(error)(f"on {host} (rank {r}): {error}")
    own = [(report[1], -r) for r, report in enumerate(reports) if report[0] == "found" and report[3]]
    if own:
        return -max(own)[1]
    return 0 if reports and reports[0][0] == "found" else None


def _agent_identity() -> str:
    """The elastic agent this worker runs under (its parent): host, pid and start time, which its restarts keep
    and a later agent with the same pid does not (where /proc is missing: host and pid)."""
    ppid = os.getppid()
    started = start_ticks(ppid)
    return f"agent:{socket.gethostname()}:{ppid}:{'?' if started is None else started}"


def _updated_last(ckpt: dict[str, Any]) -> bool:
    """Whether the last batch before the checkpoint ended with an optimizer update."""
    epoch, batch = position(ckpt)
    nb, last_update = ckpt.get("batches_per_epoch"), ckpt.get("last_update")
    if type(nb) is not int or type(last_update) is not int:
        return True  # DDP's own start
    return last_update == epoch * nb + batch - 1


def _check_resumable(ckpt: dict[str, Any], path: Path) -> None:
    if not isinstance(ckpt.get("train_args"), dict) or not isinstance(ckpt.get("optimizer"), dict):
        raise CheckpointError(
            f"{path} holds weights but no training state (train_args, optimizer); resume needs a "
            f"{LAST} or {MID} written by 'detrain train' (start a new run with model={path})"
        )
    position(ckpt, path)


def _gather(report: tuple[Any, ...], wait_s: float, world: World) -> list[tuple[Any, ...]]:
    """Every rank's report (small: no checkpoint in it). The ranks wait for the nodes to read their checkpoints
    for up to ``wait_s`` (prepare_timeout: large files on a slow disk), not the training timeout."""
    if not world.distributed:
        return [report]
    dist.barrier("every node looked for this run's checkpoints", wait_s)  # collective: under prepare_timeout
    return dist.all_gather_object(report)  # collective: every rank's report, on every rank


def _send(
    found: tuple[Path, dict[str, Any], bool] | None, holder: int, wait_s: float, world: World
) -> tuple[dict[str, Any], dict[str, bytes] | None]:
    """The holder's checkpoint (and, where the holder is not rank 0, its run record) on every rank. The
    checkpoint travels as the bytes ``torch.save`` makes of it and is read back with ``weights_only=True``
    (nothing in it can run code)."""
    if not world.distributed:
        assert found is not None
        return found[1], None
    sent = None
    if found is not None:  # this rank is the holder
        path, ckpt, _ = found
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        sent = (buf.getvalue(), run_record.collect(path.parent.parent) if holder != 0 else None)
    dist.barrier(f"rank {holder} packed the checkpoint to resume from", wait_s)  # collective: under prepare_timeout
    shared = dist.broadcast_object(sent, src=holder)  # collective: the holder's checkpoint on every rank
    if found is not None:
        return found[1], shared[1]
    return torch.load(io.BytesIO(shared[0]), map_location="cpu", weights_only=True), shared[1]
