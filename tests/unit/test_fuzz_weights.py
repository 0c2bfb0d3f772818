"""scripts/fuzz_weights.py: a few hundred seeded cases must each load or be refused, and the harness must
really see a crash, a hang and a runaway allocation (else a clean table would prove nothing)."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import _fuzz_pickle as fp  # noqa: E402
import _fuzz_zip as fz  # noqa: E402
import fuzz_weights as fw  # noqa: E402
from _fuzz_sandbox import run_isolated  # noqa: E402

YOLOV8N = REPO.parent / "shared" / "weights" / "yolov8n.pt"


@pytest.fixture(scope="module", autouse=True)
def _one_thread_before_forks():
    """Each case runs in a forked child that builds a model: a child of a process whose OpenMP pool has run threads
    can wait forever on a lock no thread will release (seen: a case hung until the suite's time ran out). One
    thread here, as scripts/fuzz_weights.py does, keeps the children single-threaded."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


needs_weights = pytest.mark.skipif(not YOLOV8N.is_file(), reason="shared/weights/yolov8n.pt is not present")


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[fw.Base]:
    folder = tmp_path_factory.mktemp("fuzz_bases")
    return [fw.Base.read("yolov8n", YOLOV8N), fw.Base.read("detrain", fw.make_detrain_base(YOLOV8N, folder))]


# --------------------------------------------------------------------------------------------------
# The harness sees every bad end
# --------------------------------------------------------------------------------------------------


def _segfault() -> str:
    ctypes.string_at(0)
    return "unreachable"


def _spin() -> str:
    while True:
        pass


def _allocate_2gb() -> str:
    return str(len(bytearray(2 << 30)))


def _raise_key_error() -> str:
    raise KeyError("model")


def _sleep() -> str:
    os.read(os.pipe()[0], 1)  # blocks forever without using CPU
    return "unreachable"


@pytest.mark.parametrize(
    ("target", "kind", "detail"),
    [
        (lambda: "fine", "ok", "fine"),
        (lambda: int("x"), "refused", "ValueError: invalid literal"),
        (_raise_key_error, "error", "KeyError: 'model'"),
        (_segfault, "crash", "killed by SIGSEGV"),
        (lambda: os.abort(), "crash", "killed by SIGABRT"),
        (_allocate_2gb, "memory", "MemoryError"),
        (_spin, "hang", "used more than 1 s of CPU time"),
        (_sleep, "hang", "still running after 2 s of wall-clock time"),
    ],
    ids=["ok", "refused", "error", "segfault", "abort", "memory", "cpu-hang", "blocked"],
)
def test_the_sandbox_tells_every_end_apart(target, kind: str, detail: str) -> None:
    # the CPU-time limit must come first for the spinning child however busy the machine is (on a loaded 2-core
    # machine it got 0.7 s of CPU in 2 s), so only the child that blocks without using CPU meets the wall limit
    wall_s = 60 if detail.startswith("used more than") else 2
    outcome = run_isolated(target, (ValueError,), cpu_s=1, mem_bytes=256 << 20, wall_s=wall_s)
    assert outcome.kind == kind and detail in outcome.detail, outcome
    assert outcome.acceptable == (kind in ("ok", "refused"))


_HELD: list[mmap.mmap] = []  # in a forked child: what it allocated, kept until it exits


def test_the_sandbox_measures_what_a_child_allocates() -> None:
    def touch_64mb() -> str:
        # fresh pages, each written: a malloc'd block may reuse freed memory that is resident already (this
        # process may have raised glibc's trim threshold, as loader workers do), and a zeroed block only read maps
        # the shared zero page; kept until the child exits, where some kernels record the peak
        block = mmap.mmap(-1, 64 << 20)
        for at in range(0, len(block), mmap.PAGESIZE):
            block[at] = 1
        _HELD.append(block)
        return str(sum(block[at] for at in range(0, len(block), mmap.PAGESIZE)) * mmap.PAGESIZE)

    outcome = run_isolated(touch_64mb, (), cpu_s=5, mem_bytes=256 << 20, wall_s=60)
    assert outcome.kind == "ok" and outcome.detail == str(64 << 20)
    assert outcome.peak_growth_mb >= 60 and outcome.cpu_s > 0


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------


@needs_weights
def test_cases_are_deterministic_and_every_mutation_changes_the_file(bases: list[fw.Base]) -> None:
    assert fw.make_case(bases, 3, 17) == fw.make_case(bases, 3, 17)
    assert fw.make_case(bases, 3, 17).data != fw.make_case(bases, 4, 17).data
    yolo = bases[0]
    original = fz.write_zip(yolo.records)
    for name, mutate in fp.MUTATIONS.items():
        changed = [fz.write_zip(yolo.with_pickle(mutate(random.Random(i), yolo.pickle))) != original for i in range(5)]
        assert any(changed), name
    for name, mutate in fz.MUTATIONS.items():
        changed = [mutate(random.Random(i), yolo.records) != original for i in range(5)]
        assert any(changed), name


@needs_weights
def test_the_parsed_pickle_finds_every_storage(bases: list[fw.Base]) -> None:
    """yolov8n.pt has 359 storages: each one's type, key and size must be found, or the aimed mutations miss."""
    pkl = bases[0].pickle
    assert len(pkl.storage_keys) == len(pkl.storage_sizes) == len(pkl.storage_types) == len(pkl.storages) == 359
    assert {kind for kind, _ in pkl.storages.values()} == {"HalfStorage", "FloatStorage", "LongStorage"}
    record_sizes = {name.rsplit("/", 1)[-1]: len(data) for name, data in bases[0].records if "/data/" in name}
    itemsize = {"HalfStorage": 2, "FloatStorage": 4, "LongStorage": 8}
    assert all(record_sizes[k] == numel * itemsize[kind] for k, (kind, numel) in pkl.storages.items())


@needs_weights
def test_100_fuzzed_files_each_load_or_are_refused(bases: list[fw.Base], tmp_path: Path) -> None:
    tally = fw.run_cases(bases, seed=2026, indices=range(100), folder=tmp_path, cpu_s=5, mem_mb=1024, wall_s=120)
    total = tally.total()
    assert sum(total.values()) == 100
    assert not tally.failures, [(c.index, c.mutations, o.kind, o.detail) for c, o in tally.failures[:5]]
    assert total["ok"] > 0 and total["refused"] > 0
    assert tally.counts["recompress"]["ok"] == sum(tally.counts["recompress"].values()) > 0  # still valid files
    assert set(tally.counts) >= {*fp.MUTATIONS, *fz.MUTATIONS}  # every mutation ran
    assert "| **total**        |   100 |" in fw.table(tally)


@needs_weights
def test_hostile_yaml_values_and_non_finite_weights_meet_the_model_checks(bases: list[fw.Base], tmp_path: Path) -> None:
    """The two mutations aimed at the readers behind the unpickler (issue 25): a value of the recorded model yaml
    made hostile must be refused in one line by the model-yaml or shape checks (or build a model that still fits
    the weights), NaN or infinity written into a tensor by the finiteness check, each in its sandbox."""
    from detrain.errors import CheckpointError

    ends: dict[str, list[str]] = {"yaml_value": [], "weight_nonfinite": []}
    fw.warm_up(bases, tmp_path)
    for index in range(40):
        base = bases[index % 2]
        rng = random.Random(f"aimed/{index}")
        if index % 4:
            name = "yaml_value"
            data = fz.write_zip(base.with_pickle(fp.MUTATIONS[name](rng, base.pickle)))
        else:
            name = "weight_nonfinite"
            data = fz.MUTATIONS[name](rng, base.records)
        path = tmp_path / f"{base.name}.pt"
        path.write_bytes(data)
        outcome = run_isolated(fw.load_target(path), (CheckpointError,), cpu_s=5, mem_bytes=1 << 30, wall_s=120)
        assert outcome.acceptable, (index, name, outcome)
        ends[name].append(f"{outcome.kind}: {outcome.detail}")
    yaml_checks = [e for e in ends["yaml_value"] if "cannot build the model it records" in e or "does not fit" in e]
    assert len(yaml_checks) >= len(ends["yaml_value"]) // 2, ends["yaml_value"]
    assert all("holds NaN or infinite values" in e for e in ends["weight_nonfinite"] if e.startswith("refused")), ends
    assert sum("holds NaN or infinite values" in e for e in ends["weight_nonfinite"]) >= 6, ends["weight_nonfinite"]
