"""World: the environment each launcher gives a process (none, detrain's, torchrun, srun) -> one frozen object,
and each bad value -> one line naming the variable; the launcher adds the device, which the environment never
carries. Engine code reads no environment variable at all."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest
import torch

from detrain.distributed.world import World
from detrain.errors import DistributedError

ENGINE = Path(__file__).resolve().parents[2] / "detrain" / "engine"

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}
SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODEID": "1",
    "SLURM_NNODES": "2",
    "SLURM_JOB_ID": "1234",
    "SLURM_RESTART_COUNT": "1",
}


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_a_plain_process_is_rank_0_of_1_on_the_cpu() -> None:
    assert World.from_env({}) == World()
    assert World.from_env({}).launcher == "none" and not World.from_env({}).launched


def test_rank_world_size_and_local_rank_alone_mean_a_launcher_started_us() -> None:
    assert World.from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).launched


def test_torchrun_gives_every_field() -> None:
    w = World.from_env(TORCHRUN)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size) == (3, 4, 1, 2)
    assert (w.node_rank, w.nnodes, w.restart_count, w.run_id) == (1, 2, 2, "job7")
    assert (w.launcher, w.master_addr, w.master_port, w.agent_store) == ("torchrun", "10.0.0.1", 29500, True)
    assert w.distributed and not w.is_main and not w.whole_world_here and w.device == "cpu"


def test_torchrun_on_a_cuda_machine_takes_the_gpu_of_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert World.from_env(TORCHRUN).device == "cuda:1"


def test_detrains_launcher_marks_its_workers_and_hands_them_their_device() -> None:
    w = World.from_env({**TORCHRUN, "DETRAIN_LAUNCHER": "detrain", "DETRAIN_DEVICE": "cuda:3"})
    assert (w.launcher, w.device) == ("detrain", "cpu")  # a device in the environment is not read
    assert w.on("cuda:3") == dataclasses.replace(w, device="cuda:3")  # the launcher's, from its device plan
    # the mark alone (the launching process, where the agent runs) is no world
    assert World.from_env({"DETRAIN_LAUNCHER": "detrain"}).launcher == "none"


def test_the_thread_count_a_launcher_or_the_user_set_is_kept_as_given() -> None:
    assert World.from_env({}).omp_threads == ""  # unset: a CPU worker takes its share of the cores
    assert World.from_env({**TORCHRUN, "OMP_NUM_THREADS": "1"}).omp_threads == "1"  # torchrun's default
    assert World.from_env({"OMP_NUM_THREADS": "4,2"}).omp_threads == "4,2"  # OpenMP's nested form, left to OpenMP


def test_srun_tasks_are_translated_without_touching_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (*TORCHRUN, "DETRAIN_IGNORE_SLURM", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SRUN.items():
        monkeypatch.setenv(key, value)
    w = World.from_env()  # os.environ
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ
    assert (w.launcher, w.rank, w.world_size, w.local_rank, w.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert (w.node_rank, w.nnodes, w.slurm_job_id, w.slurm_requeues) == (1, 2, "1234", 1)
    assert (w.master_addr, w.master_port) == ("gpu07", 15000 + 1234 % 20000)


def test_torchs_variables_win_over_slurms_and_slurm_can_be_ignored() -> None:
    assert World.from_env({**SRUN, **TORCHRUN}).launcher == "torchrun"
    assert World.from_env({**SRUN, **TORCHRUN}).rank == 3
    ignored = World.from_env({**SRUN, "DETRAIN_IGNORE_SLURM": "1"})
    assert (ignored.launcher, ignored.world_size, ignored.slurm_job_id) == ("none", 1, "1234")


def test_a_world_of_one_is_rank_0_whatever_stray_variables_say() -> None:
    w = World.from_env({"RANK": "3", "WORLD_SIZE": "1", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "5"})
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.launcher) == (0, 1, 0, 1, "torchrun")
    assert World.from_env({"RANK": "7"}) == World()  # RANK alone: no launcher started this process


def test_it_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        World().rank = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**TORCHRUN, "RANK": "x"}, "environment variable RANK='x' is not an integer"),
        ({**TORCHRUN, "WORLD_SIZE": "1e3"}, "environment variable WORLD_SIZE='1e3' is not an integer"),
        ({**TORCHRUN, "RANK": "4"}, "environment variable RANK=4 is not a rank of WORLD_SIZE=4; ranks run from 0 to 3"),
        ({**TORCHRUN, "RANK": "-1"}, "RANK=-1 is not a rank of WORLD_SIZE=4"),
        ({**TORCHRUN, "RANK": "9" * 30}, "is not a rank of WORLD_SIZE=4"),
        ({**TORCHRUN, "LOCAL_RANK": "-2"}, "LOCAL_RANK=-2 and LOCAL_WORLD_SIZE=2 do not describe a rank on this node"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_RANK=1 and LOCAL_WORLD_SIZE=0 do not describe"),
        ({**TORCHRUN, "MASTER_PORT": "http"}, "environment variable MASTER_PORT='http' is not an integer"),
        ({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "one"}, "TORCHELASTIC_RESTART_COUNT='one' is not an integer"),
        ({**SRUN, "SLURM_NTASKS": "four"}, "environment variable SLURM_NTASKS='four' is not an integer"),
        ({**SRUN, "SLURM_RESTART_COUNT": "two"}, "SLURM_RESTART_COUNT='two' is not an integer"),
        ({**SRUN, "SLURM_PROCID": "8"}, "RANK=8 is not a rank of WORLD_SIZE=8"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistributedError, match=re.escape(message)) as err:
        World.from_env(env)
    assert "\n" not in str(err.value)


def test_values_that_only_inform_are_ignored_when_malformed() -> None:
    """GROUP_RANK and SLURM_NODEID only number nodes in the run's record: a path, a unicode digit or a sign there
    (what a hostile or broken job script might set) leaves the node unnumbered instead of stopping the run."""
    for bad in ("../1", "²", "-1", " 1", ""):
        w = World.from_env({**TORCHRUN, "GROUP_RANK": bad, "GROUP_WORLD_SIZE": bad})
        assert (w.node_rank, w.nnodes) == (None, None)
    assert World.from_env({"SLURM_RESTART_COUNT": "two"}).slurm_requeues == 0  # outside a job: not read
    assert World.from_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "x"}).master_port is None


def environment_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every use of the process environment in ``source``: ``os.environ``, ``os.environb``,
    ``os.getenv``, ``os.putenv``, ``os.unsetenv``, ``env_int`` (detrain's reader of launcher variables), however
    imported or called (``from os import environ``, ``import os as o; o.getenv``)."""
    env_names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv", "env_int"}
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in env_names:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in env_names:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"import {alias.name}") for alias in node.names if alias.name in env_names]
            if node.module == "detrain.distributed.env":
                found.append((node.lineno, "detrain.distributed.env"))
    return sorted(set(found))


def test_the_scan_finds_every_spelling_of_the_environment() -> None:
    source = (
        "import os\nfrom os import environ as e, getenv\nfrom detrain.distributed.env import env_int\n"
        "a = os.environ['X']\nb = os.getenv('Y')\nc = env_int('Z', 0)\nos.environ.setdefault('W', '1')\n"
    )
    assert [n for n, _ in environment_uses(source)] == [2, 2, 3, 3, 4, 5, 6, 7]
    assert environment_uses("import os\nx = os.cpu_count()\n") == []


def test_engine_code_reads_no_environment_variable_itself() -> None:
    """The world (World.from_env, once per process) and the config (make_cfg) are the engine's only inputs: no
    module under detrain/engine reads or writes the environment (settings made for other programs, such as
    cuBLAS's workspace or git's variables, live in detrain.system.process_env)."""
    uses = [
        f"{path.relative_to(ENGINE.parent)}:{line} uses the environment ({what})"
        for path in sorted(ENGINE.rglob("*.py"))
        for line, what in environment_uses(path.read_text())
    ]
    assert not uses, "\n".join(uses)
