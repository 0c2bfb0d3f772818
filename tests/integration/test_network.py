"""network: what a run listens on, the key that picks the interface, and the run id that keeps two jobs apart.

Real launches are gloo workers on 127.0.0.1 (``_dist_workers.listeners``); the sockets a process listens on are
read from /proc (``_sockets.listening``). The run id's check is exercised on a real store in this process, and
end to end with two ``detrain train`` "nodes" of different jobs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import _dist_workers as workers
import pytest
import torch.distributed as tdist
from _processes import RUN_SECRET
from _sockets import listening

from detrain.config.cfg import make_cfg
from detrain.data.synthetic import generate_shapes
from detrain.distributed import dist
from detrain.distributed.launch import netif, run_identity
from detrain.distributed.launch.launcher import launch, parse_device
from detrain.distributed.launch.master_store import host_store
from detrain.distributed.world import World
from detrain.errors import ConfigError, DistributedError

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"
needs_proc_net = pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads /proc/PID/net/tcp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    """A child environment outside any launcher, with this checkout importable."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["DETRAIN_RUN_SECRET"] = RUN_SECRET  # the nodes of one run share its secret
    return env


# ------------------------------------------------------------------------------ what a run listens on


@needs_proc_net
@pytest.mark.parametrize(("backend", "ifname"), [(None, ""), ("c10d", "lo")])
def test_a_single_machine_run_listens_on_loopback_only(backend: str | None, ifname: str) -> None:
    """The launcher's rendezvous store, each worker's gloo and (c10d) rank 0's own store: every one of them on
    127.0.0.1, none on 0.0.0.0 or :: (torch's store binds the wildcard address when left alone)."""
    if ifname and ifname not in netif.interfaces():
        pytest.skip(f"no interface {ifname} here")
    ranks = launch(workers.listeners, {}, parse_device("cpu,cpu"), rdzv_backend=backend, socket_ifname=ifname)
    assert ranks is not None and [r["rank"] for r in ranks] == [0, 1]
    everything = ranks[0]["launcher"] + [sock for r in ranks for sock in r["listening"]]
    assert ranks[0]["launcher"], "the launcher hosts the rendezvous store, so it listens"
    assert all(r["listening"] for r in ranks), "each worker's gloo listens for its peers"
    assert {ip for ip, _ in everything} == {LOOPBACK}, everything
    gloo = netif.interface_of(LOOPBACK)
    for r in ranks:  # derived from master_addr, or given by socket_ifname: the same interface here
        assert r["env"]["GLOO_SOCKET_IFNAME"] == gloo and r["env"]["NCCL_SOCKET_IFNAME"] == f"={gloo}"


@needs_proc_net
def test_the_env_store_of_srun_and_torchrun_listens_on_master_addr_only() -> None:
    """Without an elastic agent's store (srun, plain env://, detrain's c10d rounds) rank 0 hosts the store."""
    port = _free_port()
    world = World(rank=0, world_size=1, master_addr=LOOPBACK, master_port=port, agent_store=False)
    args = dist._store_args(world, timedelta(seconds=10))
    assert (args["rank"], args["world_size"]) == (0, 1)
    args["store"].set("k", "v")
    assert (LOOPBACK, port) in listening(os.getpid())
    assert all(ip == LOOPBACK for ip, p in listening(os.getpid()) if p == port)


def test_a_hosts_entry_that_makes_the_node_name_loopback_is_not_bound_across_machines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Attack on the address: ``127.0.1.1 gpu07`` in /etc/hosts. Binding there would lock the other nodes out, so
    torch's default binding stays; on one machine, or for 127.0.0.1 / localhost as such, loopback is right."""
    real = socket.getaddrinfo

    def fake(host: str, *a: Any, **k: Any) -> Any:
        if host == "gpu07":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        return real(host, *a, **k)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert netif.listen_address("gpu07", whole_world_here=False) is None
    assert netif.transport_env("gpu07", whole_world_here=False) == {}
    assert netif.listen_address("gpu07", whole_world_here=True) == "127.0.1.1"
    assert netif.listen_address(LOOPBACK, whole_world_here=False) == LOOPBACK


def test_an_address_that_is_not_this_machines_is_one_line() -> None:
    with pytest.raises(
        DistributedError,
        match=r"master_addr='192.0.2.250' \(192.0.2.250\) is not an address of "
        r"this machine.*127\.0\.0\.1",
    ) as err:
        host_store("192.0.2.250", 0, bind="192.0.2.250", timeout=timedelta(seconds=5))
    assert "\n" not in str(err.value)


def test_a_name_that_does_not_resolve_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown(host: str, *a: Any, **k: Any) -> Any:  # no resolver is asked: tests stay off the network
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(DistributedError, match="master_addr='no-such-host' does not resolve to an address: Name or"):
        launch(workers.report, {}, parse_device("cpu,cpu"), master_addr="no-such-host")


# -------------------------------------------------------------------------------------- socket_ifname


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu"])
def test_an_interface_that_does_not_exist_is_one_line_naming_it_and_the_real_ones(device: str) -> None:
    with pytest.raises(DistributedError) as err:
        launch(workers.report, {}, parse_device(device), socket_ifname="nosuch9")
    msg = str(err.value)
    assert "'nosuch9'" in msg and "\n" not in msg
    for name in netif.interfaces():
        assert name in msg


def test_socket_ifname_through_the_command_line_exits_2(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "detrain.cli",
        "train",
        "device=cpu,cpu",
        "socket_ifname=lo,nosuch9",
        f"project={tmp_path / 'runs'}",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no network interface 'nosuch9'" in lines[0] and "lo" in lines[0]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("hostile", ["eth0;reboot", "../../etc", "eth0 eth1", "a" * 16, "-eth0", "eth0,", "$(id)"])
def test_hostile_interface_names_are_refused_by_the_config(hostile: str) -> None:
    with pytest.raises(ConfigError, match="socket_ifname"):
        make_cfg({"socket_ifname": hostile})


def test_socket_ifname_sets_gloo_and_exact_nccl_names() -> None:
    assert netif.ifname_env("eth1") == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1"}
    assert make_cfg({"socket_ifname": "eth0,ib0"}).distributed.socket_ifname == "eth0,ib0"


# -------------------------------------------------------------------------------------------- run_id


def test_a_derived_run_id_ignores_what_may_differ_per_node_and_nothing_else() -> None:
    base = make_cfg({"epochs": 3, "nnodes": 2}).node_shared()
    own = {"nnodes": 2, "node_rank": 1, "device": "0,1", "workers": 8, "socket_ifname": "eth0", "project": "x"}
    same = make_cfg({"epochs": 3, **own}).node_shared()
    assert run_identity.derive("train", base) == run_identity.derive("train", same)
    assert run_identity.derive("train", base) != run_identity.derive("train", {**base, "epochs": 4})
    assert run_identity.derive("train", base) != run_identity.derive("train", {**base, "cache": "ram"})
    assert run_identity.derive("train", base) != run_identity.derive("val", base)
    assert make_cfg({"run_id": run_identity.derive("train", base)}).distributed.run_id.startswith("auto-")


@pytest.mark.parametrize("hostile", ["a b", "../x", "x" * 65, "-x", "id\nEVIL", "é"])
def test_hostile_run_ids_are_refused_by_the_config(hostile: str) -> None:
    with pytest.raises(ConfigError, match="run_id"):
        make_cfg({"run_id": hostile})


def _master() -> tdist.TCPStore:
    return host_store(LOOPBACK, 0, bind=LOOPBACK, timeout=timedelta(seconds=10))


def _join_in_thread(port: int, run_id: str, args: dict | None = None, wait_go: bool = True) -> dict[str, Any]:
    """``run_identity.join`` from a thread (as another node would); the box gets its error, if any."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            run_identity.join(
                LOOPBACK, port, run_id, 1, args, wait_go=wait_go, connect_timeout_s=10, start_timeout_s=30
            )
        except DistributedError as e:
            box["error"] = str(e)

    box["thread"] = threading.Thread(target=run)
    box["thread"].start()
    return box


def test_nodes_of_one_job_meet_and_are_told_to_go() -> None:
    store = _master()
    run_identity.host(store, "job-a", None)
    box = _join_in_thread(store.port, "job-a")
    run_identity.wait_for_nodes(store, "job-a", None, 1, 30, "here")
    box["thread"].join(30)
    assert not box["thread"].is_alive() and "error" not in box


def test_a_node_of_another_job_is_turned_away_and_both_say_so_naming_both_ids() -> None:
    store = _master()
    run_identity.host(store, "job-a", None)
    box = _join_in_thread(store.port, "job-b")
    with pytest.raises(DistributedError) as err:
        run_identity.wait_for_nodes(store, "job-a", None, 1, 30, "here")
    box["thread"].join(30)
    for msg in (str(err.value), box["error"]):
        assert "'job-a'" in msg and "'job-b'" in msg and "\n" not in msg
    assert "this node does not join it" in box["error"]


def test_an_elastic_master_still_turns_away_a_node_of_another_job() -> None:
    """nnodes=MIN:MAX: the master does not wait for nodes, but a node with another id still never joins."""
    store = _master()
    run_identity.host(store, "job-a", None)
    box = _join_in_thread(store.port, "job-b", wait_go=False)
    box["thread"].join(30)
    assert "differs from run_id='job-a'" in box["error"]


def test_derived_ids_name_the_arguments_that_differ() -> None:
    ours = run_identity.shared_args("train", make_cfg({"epochs": 10}).node_shared())
    theirs = run_identity.shared_args("train", make_cfg({"epochs": 100, "imgsz": 320}).node_shared())
    store = _master()
    run_identity.host(store, run_identity.derive("train", ours), ours)
    box = _join_in_thread(store.port, run_identity.derive("train", theirs), theirs)
    with pytest.raises(DistributedError) as err:
        run_identity.wait_for_nodes(store, run_identity.derive("train", ours), ours, 1, 30, "here")
    box["thread"].join(30)
    assert box["error"].endswith("these differ from the master's: epochs, imgsz)")
    assert str(err.value).endswith("these differ from the node's: epochs, imgsz)")


def test_a_record_that_no_detrain_node_wrote_ends_the_wait_in_one_line() -> None:
    """Attack on the store: another program writes garbage where nodes record their visit."""
    store = _master()
    run_identity.host(store, "job-a", None)
    intruder = tdist.TCPStore(LOOPBACK, store.port, None, False, timedelta(seconds=10))
    intruder.add("detrain/run/arrivals", 1)
    intruder.set("detrain/run/arrival/0", b"\x1b[2J\x00{not json")
    with pytest.raises(DistributedError, match="not a detrain node") as err:
        run_identity.wait_for_nodes(store, "job-a", None, 1, 30, "here")
    assert "\x1b" not in str(err.value) and "\n" not in str(err.value)


def test_a_hostile_master_cannot_write_to_the_terminal() -> None:
    """Attack on the joining node: a "master" whose run id and verdict carry terminal escapes and newlines."""
    store = _master()
    store.set("detrain/run/id", "\x1b]0;owned\x07\nline two")
    box = _join_in_thread(store.port, "job-b", wait_go=False)
    box["thread"].join(30)
    assert "\x1b" not in box["error"] and "\n" not in box["error"] and "\\x1b" in box["error"]
    store = _master()
    store.set("detrain/run/id", "job-a")
    store.set("detrain/run/verdict", "stop: \x1b[31mred\nsecond line")
    box = _join_in_thread(store.port, "job-a")
    box["thread"].join(30)
    assert "stopped before the group formed" in box["error"]
    assert "\x1b" not in box["error"] and "\n" not in box["error"]


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a launcher started with ``start_new_session`` and all it started)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_two_jobs_sharing_a_master_and_port_never_join(tmp_path: Path) -> None:
    """Two `detrain train` nodes on 127.0.0.1 (nnodes=2) of different jobs: both end with the line naming both ids,
    exit 2, no worker starts (nothing trains, no run folder), nothing is left behind. Start-up waits 600 s, so
    ending at all shows the check ended them."""
    data = generate_shapes(tmp_path / "shapes", n_train=4, n_val=2, imgsz=64) / "data.yaml"
    port = _free_port()
    common = [
        f"data={data}",
        "imgsz=64",
        "epochs=1",
        "batch=2",
        "workers=0",
        "device=cpu",
        "nnodes=2",
        f"master_port={port}",
        f"project={tmp_path / 'runs'}",
    ]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "detrain.cli", "train", *common, f"node_rank={r}", f"run_id={job}"],
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r, job in ((0, "job-a"), (1, "job-b"))
    ]
    try:
        errs = [p.communicate(timeout=180)[1] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, err in zip(nodes, errs):
        lines = err.strip().splitlines()
        assert p.returncode == 2, err[-2000:]
        assert len(lines) == 1 and "'job-a'" in lines[0] and "'job-b'" in lines[0], err[-2000:]
        assert _session_pids(p.pid) == []
    assert not (tmp_path / "runs").exists()
