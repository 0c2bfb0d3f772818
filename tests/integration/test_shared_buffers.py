"""BatchNorm statistics at an update: every rank's EMA takes rank 0's (parallel.share_main_buffers), so the ranks
validate with the weights ``best.pt`` holds and a checkpoint needs no rank's buffers but rank 0's."""

from __future__ import annotations

import _dist_workers as workers
import pytest

from detrain.distributed.launch.launcher import launch, parse_device


@pytest.mark.parametrize("share", [True, False])
def test_every_rank_s_ema_holds_rank_0_s_batchnorm_statistics(share: bool) -> None:
    got = launch(workers.ema_buffers, {"share": share}, parse_device("cpu,cpu"))
    rank0, rank1 = got["ema"]
    assert rank0 != got["own"]  # the EMA moved (tau 1: nearly the model's)
    if share:
        assert rank1 == rank0  # rank 1's own images are gone from its EMA
    else:  # what the EMA took before: each rank's own statistics (the test would pass without the share otherwise)
        assert rank1 != rank0
