"""compile=: a compiled run trains, keeps the checkpoint names of an eager run, and resumes (still compiled).

Runs use ``compile=aot_eager`` (dynamo and AOTAutograd trace the model, no code is generated): the cheap way to
prove the trainer's compile path on a CPU; inductor's code generation costs minutes on a 2-core machine and is
timed by ``scripts/bench_train.py --compile`` instead.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _processes import one_thread  # noqa: F401 (a fixture)
from torch import nn

from detrain import Model
from detrain.config.cfg import make_cfg
from detrain.data.synthetic import generate_shapes
from detrain.distributed.parallel import unwrap
from detrain.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(data: Path, project: Path, **extra: object) -> dict:
    return dict(
        data=str(data),
        imgsz=64,
        batch=8,
        nbs=8,
        device="cpu",
        workers=0,
        warmup_epochs=0,
        close_mosaic=0,
        optimizer="SGD",
        val=False,
        plots=False,
        verbose=False,
        exist_ok=True,
        project=str(project),
        name="run",
        **extra,
    )


def _state(path: Path, key: str = "model") -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)[key]["state_dict"]


def test_a_compiled_run_keeps_eager_names_and_resumes_exactly(tmp_path: Path) -> None:
    data = generate_shapes(tmp_path / "shapes", n_train=16, n_val=2, imgsz=64, seed=0) / "data.yaml"
    eager = Path(Model("n.yaml").train(**_args(data, tmp_path / "eager", epochs=2)).save_dir)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    straight = Path(
        Model("n.yaml").train(**_args(data, tmp_path / "a", epochs=2, save_period=1, compile="aot_eager")).save_dir
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the forward really was compiled
    compiled = _state(straight / "weights" / "last.pt")
    assert list(compiled) == list(_state(eager / "weights" / "last.pt"))  # no _orig_mod. prefix
    assert list(_state(straight / "weights" / "last.pt", "ema")) == list(compiled)
    for name, tensor in _state(eager / "weights" / "last.pt").items():  # the same training, traced
        assert torch.allclose(tensor.float(), compiled[name].float(), atol=1e-4), name
    # a compiled run that died after epoch 1 resumes compiled (train_args keep compile=) to the same weights
    died = tmp_path / "b" / "run"
    (died / "weights").mkdir(parents=True)
    shutil.copy(straight / "weights" / "epoch1.pt", died / "weights" / "last.pt")
    shutil.copy(straight / "args.yaml", died / "args.yaml")
    shutil.copy(straight / "results.csv", died / "results.csv")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()  # the resumed run compiles afresh, as a new process would
    Model("n.yaml").train(resume=str(died / "weights" / "last.pt"), device="cpu")
    resumed = torch.load(died / "weights" / "last.pt", map_location="cpu", weights_only=True)
    assert resumed["train_args"]["compile"] == "aot_eager" and resumed["epoch"] == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    for key in ("model", "ema"):
        for name, tensor in _state(straight / "weights" / "last.pt", key).items():
            assert torch.equal(tensor, resumed[key]["state_dict"][name]), (key, name)


def test_compile_values() -> None:
    def value(v: object) -> object:
        return make_cfg({"compile": v}).train.compile

    assert [value(v) for v in (False, "false", True, "true", "max-autotune", "AOT_EAGER")] == [
        False,
        False,
        "default",
        "default",
        "max-autotune",
        "aot_eager",
    ]
    assert make_cfg({}).train.compile is False  # off unless asked
    with pytest.raises(ConfigError, match="compile"):
        make_cfg({"compile": "fastest"})


def test_unwrap_sees_through_a_compile_wrapper() -> None:
    bare = nn.Linear(2, 2)
    wrapped = torch.compile(bare, backend="eager")
    assert unwrap(wrapped) is bare and list(unwrap(wrapped).state_dict()) == ["weight", "bias"]
