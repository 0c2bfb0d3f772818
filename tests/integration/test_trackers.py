"""MLflow and Weights & Biases, read back for real: a tiny run with ``mlflow=true wandb=true`` leaves a local MLflow
file store and a W&B offline run folder that hold the run's arguments, every results.csv column at each epoch and
best.pt; a run that raises ends its MLflow run as FAILED; a tracker that is not installed is the install line
before anything starts; and the Python process opens no network connection to do any of it.

The trackers run in this process (W&B's own service process is told offline, and writes only into the run folder).
"""

from __future__ import annotations

import csv
import ipaddress
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import _wandb_records as wb
import pytest
from _processes import one_thread  # noqa: F401 (a fixture)

from detrain import Model
from detrain.config.cfg import make_cfg
from detrain.data.synthetic import generate_shapes
from detrain.errors import ConfigError
from detrain.run.preflight import check_inputs

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

TINY = dict(epochs=2, imgsz=64, batch=8, nbs=8, device="cpu", workers=0, warmup_epochs=0, close_mosaic=0)
TINY |= dict(plots=False, verbose=False, seed=0, exist_ok=True, name="run")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate_shapes(tmp_path_factory.mktemp("trk") / "shapes", n_train=8, n_val=2, imgsz=64, seed=0)
    return root / "data.yaml"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No tracker setting of the machine's: detrain's defaults (a local MLflow store, W&B offline)."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    return tmp_path


class _Connections:
    """Every connect and name lookup this process makes, seen through Python's audit hooks (a hook cannot be
    removed, so it only records while ``on``)."""

    def __init__(self) -> None:
        self.on = False
        self.seen: list[str] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if not self.on:
            return
        if event == "socket.connect" and not _local(args[1]):
            self.seen.append(f"connect {args[1]!r}")
        elif event == "socket.getaddrinfo" and not _local((args[0], 0)):
            self.seen.append(f"lookup {args[0]!r}")


def _local(address: object) -> bool:
    if isinstance(address, (str, bytes)):  # a unix socket
        return True
    host = address[0] if isinstance(address, tuple) and address else address
    if host in (None, "localhost", "", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host if isinstance(host, str) else host.decode()).is_loopback
    except ValueError:
        return False


@pytest.fixture(scope="module")
def connections() -> _Connections:
    return _Connections()


@pytest.fixture
def watched(connections: _Connections) -> Iterator[_Connections]:
    connections.on, connections.seen = True, []
    yield connections
    connections.on = False


def test_a_run_is_read_back_from_mlflows_file_store_and_the_wandb_offline_folder(
    data: Path, env: Path, watched: _Connections
) -> None:
    metrics = Model("n.yaml").train(data=str(data), project=str(env / "runs"), mlflow=True, wandb=True, **TINY)
    run = Path(metrics.save_dir)
    with open(run / "results.csv") as f:
        rows = [{k.strip(): v for k, v in r.items()} for r in csv.DictReader(f)]
    columns = [c for c in rows[0] if c != "epoch"]
    assert len(rows) == 2 and {"train/box_loss", "metrics/mAP50-95", "node0/cpu_pct"} <= set(columns)

    client = mlflow.tracking.MlflowClient((env / "runs" / "mlflow").as_uri())
    experiment = client.get_experiment_by_name("detrain")
    (found,) = client.search_runs([experiment.experiment_id])
    assert (found.info.run_name, found.info.status) == ("run", "FINISHED")
    assert found.data.params["epochs"] == "2" and found.data.params["imgsz"] == "64"
    assert found.data.params["mlflow"] == "True"
    for column in columns:
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, column))
        assert [s for s, _ in history] == [1, 2]  # results.csv keeps 6 significant digits
        assert [v for _, v in history] == pytest.approx([float(r[column]) for r in rows], rel=1e-5, abs=1e-9)
    names = {a.path for a in client.list_artifacts(found.info.run_id)}
    assert {"best.pt", "results.csv", "args.yaml"} <= names

    (record,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    logged = [r for r in wb.history(record) if set(columns) & set(r)]
    assert [r["_step"] for r in logged] == [1, 2]
    for row, got in zip(rows, logged):
        assert {c: got[c] for c in columns} == pytest.approx({c: float(row[c]) for c in columns}, rel=1e-5, abs=1e-9)
    config = wb.config(record)
    assert (config["epochs"], config["imgsz"], config["data"]) == (2, 64, str(data))
    ((_, kind, files),) = wb.artifacts(record)
    assert (kind, files) == ("model", ["best.pt"])

    assert watched.seen == []  # not one connection or name lookup beyond this machine


def _raise_after_epoch_1(info) -> None:
    raise RuntimeError("stop here")


def test_a_run_that_raises_ends_its_mlflow_run_as_failed(data: Path, env: Path) -> None:
    model = Model("n.yaml")
    model.add_callback("on_fit_epoch_end", _raise_after_epoch_1)
    with pytest.raises(RuntimeError, match="stop here"):
        model.train(data=str(data), project=str(env / "runs"), mlflow=True, **TINY)
    client = mlflow.tracking.MlflowClient((env / "runs" / "mlflow").as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("detrain").experiment_id])
    assert found.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(found.info.run_id, "train/box_loss")] == [1]


@pytest.mark.parametrize(("key", "extra"), [("mlflow", "mlflow"), ("wandb", "wandb")])
def test_a_tracker_that_is_not_installed_is_the_install_line_before_anything_starts(
    key: str, extra: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, key, None)  # import mlflow / import wandb now raise ImportError
    cfg = make_cfg({key: True, "data": "coco8.yaml", "project": str(tmp_path)}, "train")
    with pytest.raises(ConfigError, match=rf'^{key}=true needs .*: pip install "detrain\[{extra}\]"$'):
        check_inputs("train", cfg)
    assert not any(tmp_path.iterdir())


def test_the_local_address_check_tells_loopback_from_the_network() -> None:
    assert _local(("127.0.0.1", 80)) and _local(("::1", 80, 0, 0)) and _local("/tmp/s.sock")
    assert not _local(("10.0.0.1", 80)) and not _local(("api.wandb.ai", 443))
    assert socket.AF_UNIX  # the unix-socket branch is the one W&B's service uses on Linux
