"""``parallel=hsdp`` (hybrid sharding: torch's ``fully_shard`` on a 2-D mesh, replicated across the nodes and sharded
within one) with real processes: 2 nodes of 2 gloo workers on 127.0.0.1 train one epoch, and what they train is what
4 DDP workers on one node train at the same global batch (16 images, one update, sync_bn: tests/_exact.py).

Checked: rank 0 says the mesh (2 x 2, replicate x shard); the loss columns within 2e-5 relative of DDP's (the
same weights, the sums of a sharded backward in another order); every weight, EMA weight and buffer of last.pt and
every momentum buffer within 1e-5 absolute and 1e-4 relative (the tolerances of tests/integration/test_fsdp.py);
last.pt in DDP's format (whole tensors, optimizer state by parameter index, the generators of all 4 ranks), so
that any parallelism resumes it (a resume under hsdp: test_fsdp.py's ``ddp-to-hsdp``). A shard's rows taken from the
wrong mesh dimension, gradients not all-reduced across the nodes or a data shard read twice move them by far more.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import _exact
import pytest
import torch
from _processes import child_env, free_port, run_together

from detrain.data.synthetic import generate_shapes

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 400
EXACT = {**_exact.EXACT, "exist_ok": True, "epochs": 1}


def _cli(args: dict) -> list[str]:
    return [sys.executable, "-m", "detrain.cli", "train", *[f"{k}={v}" for k, v in args.items()]]


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def _last(run: Path) -> dict:
    return torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], list[tuple[int, str]]]:
    """One epoch under hsdp on 2 nodes x 2 workers (two launchers) and under DDP on one node of 4 workers, side by
    side: ({kind: run folder}, each launcher's (exit code, output): hsdp node 0, hsdp node 1, ddp)."""
    root = tmp_path_factory.mktemp("hsdp")
    data = generate_shapes(root / "shapes", n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"
    common = {**EXACT, "data": data, "project": root}
    port = free_port()
    hsdp = {**common, "parallel": "hsdp", "name": "hsdp", "device": "cpu,cpu", "nnodes": 2}
    nodes = [{**hsdp, "node_rank": r, "master_addr": "127.0.0.1", "master_port": port} for r in (0, 1)]
    ddp = {**common, "parallel": "ddp", "name": "ddp", "device": "cpu,cpu,cpu,cpu"}
    ends = run_together([_cli(a) for a in (*nodes, ddp)], child_env(), REPO, LIMIT_S)
    for name, (code, out) in zip(("hsdp node 0", "hsdp node 1", "ddp"), ends, strict=True):
        assert code == 0, f"{name}: exit {code}\n{out[-3000:]}"
    return {"hsdp": root / "hsdp", "ddp": root / "ddp"}, ends


def test_two_nodes_of_two_workers_shard_within_a_node_and_replicate_across(runs) -> None:
    _, ends = runs
    out = ends[0][1]
    assert "parallel: hsdp on a 2x2 mesh (replicate x shard)" in out, out[-3000:]
    assert "4 worker(s) on cpu" in out


def test_hsdp_trains_what_ddp_trains_at_the_same_global_batch(runs) -> None:
    folders, _ = runs
    a, b = _last(folders["ddp"]), _last(folders["hsdp"])
    for part in ("model", "ema"):
        one, two = a[part]["state_dict"], b[part]["state_dict"]
        assert one.keys() == two.keys()
        for name, x in one.items():
            assert two[name].shape == x.shape, name  # whole tensors, gathered from the shards
            if x.is_floating_point():
                torch.testing.assert_close(two[name], x, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
            else:
                assert torch.equal(x, two[name]), name
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for k, x in a["optimizer"]["state"].items():
        torch.testing.assert_close(
            b["optimizer"]["state"][k]["momentum_buffer"], x["momentum_buffer"], atol=1e-5, rtol=1e-4
        )
    assert a["rng_per_rank"].keys() == b["rng_per_rank"].keys() == {"0", "1", "2", "3"}
    (r1,), (r2,) = _rows(folders["ddp"]), _rows(folders["hsdp"])
    for col in ("train/box_loss", "train/cls_loss", "train/dfl_loss"):
        assert float(r2[col]) == pytest.approx(float(r1[col]), rel=2e-5), col
