"""``cache=ram`` in a real 2-rank launch (gloo on 127.0.0.1): one copy of the pixels per node, filled by local
rank 0, mapped by the other rank and by every loader worker, removed at the end; and 2 ranks x 4 see the same
pixels as 1 rank x 8. The memory this saves is measured by ``scripts/bench_ram_cache.py``, not here."""

from __future__ import annotations

import gc
import glob
import os
from pathlib import Path

import _dist_workers as workers
import pytest
import torch

from detrain.data.synthetic import generate_shapes
from detrain.distributed.launch.launcher import launch, parse_device

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="cache=ram needs /dev/shm")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = generate_shapes(tmp_path_factory.mktemp("shapes"), n_train=16, n_val=4, imgsz=64)
    return str(root / "data.yaml")


def test_two_ranks_share_one_ram_cache(data: str) -> None:
    before = set(glob.glob(f"/dev/shm/detrain-{os.geteuid()}*/detrain-ram-*"))
    two = launch(workers.ram_cache_batches, {"data": data, "batch": 8}, parse_device("cpu,cpu"))
    assert two is not None
    r0, r1 = two
    assert not glob.glob(f"{r0['stem']}*")  # the spawned rank 0 removed its files when it ended
    one = launch(workers.ram_cache_batches, {"data": data, "batch": 8}, parse_device("cpu"))
    assert one is not None

    # one cache for the node: the same file in both ranks, filled by rank 0 only, no second copy, in this user's
    # private folder (mode 0700), the file 0600
    assert os.path.basename(os.path.dirname(r0["stem"])).startswith(f"detrain-{os.geteuid()}")
    assert r0["modes"] == (0o700, 0o600)
    assert r0["stem"] == r1["stem"]
    assert r0["owner_pid"] == r0["pid"] and r1["owner_pid"] is None
    assert r0["files"] == r1["files"]
    assert [f for f in r0["files"] if f not in before] == [f"{r0['stem']}.bin"]
    # loader workers are forked from their rank (not spawned, as the launcher's ranks are) and read the same file
    assert r0["start_method"] == r1["start_method"] == "fork"
    assert all(r0["worker_maps_cache"]) and all(r1["worker_maps_cache"])

    # rank r's slice of every global batch, from the shared cache, is what one rank sees at the same global batch
    for step in range(2):
        assert torch.equal(torch.cat([r0["batches"][step], r1["batches"][step]]), one[0]["batches"][step])

    # this process (the 1-rank run) removed its files when its cache went
    gc.collect()
    assert not glob.glob(f"{one[0]['stem']}*")
