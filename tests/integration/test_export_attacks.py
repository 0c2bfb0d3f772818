"""Hostile exports (issue 37 item 1) and keys that lift a guard (item 3).

A ``.torchscript`` archive's TorchScript code reaches ``torch.from_file(path, shared=True)``, which maps any file the
user can write, read-write: in ``forward`` it fires at the first prediction, in ``__setstate__`` inside
``torch.jit.load``. detrain reads the archive's code first and refuses it (one line, exit 2) unless
``trust_export=true`` is given on the command line or in the API; a ``cfg=`` file cannot give that key, nor
``download_anywhere: true``, nor name an export as its ``model:``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List  # noqa: UP035 - TorchScript's annotations need typing's List

import cv2
import numpy as np
import pytest
import torch

from detrain import Model
from detrain.config.cfg import make_cfg
from detrain.engine.script_check import ScriptRefused
from detrain.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:FutureWarning")
META = json.dumps({"names": {0: "a"}, "stride": 32, "imgsz": [64, 64], "dynamic": True, "free_size": True})
SAFE = b"safe content\n"


class WritesInForward(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapped = torch.from_file(self.target, shared=True, size=4, dtype=torch.uint8)
        mapped.fill_(88)
        return x.new_zeros(x.shape[0], 5, 84) + mapped.float().sum() * 0


class WritesWhenLoaded(torch.nn.Module):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], 5, 84)

    @torch.jit.export
    def __getstate__(self) -> List[str]:  # noqa: UP006
        return [self.target]

    @torch.jit.export
    def __setstate__(self, state: List[str]) -> None:  # noqa: UP006
        self.target = state[0]
        self.training = False
        self.n = int(torch.from_file(state[0], shared=True, size=4, dtype=torch.uint8).fill_(88).sum())


@pytest.fixture(params=[WritesInForward, WritesWhenLoaded], ids=["forward", "setstate"])
def hostile(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the archive, the file it writes, a picture to predict on)."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SAFE)
    archive = tmp_path / "evil.torchscript"
    torch.jit.save(torch.jit.script(request.param(str(victim))), str(archive), _extra_files={"detrain.json": META})
    picture = tmp_path / "p.png"
    cv2.imwrite(str(picture), np.full((64, 64, 3), 127, np.uint8))
    return archive, victim, picture


def test_the_cli_refuses_the_archive_before_any_of_its_code_runs(hostile: tuple[Path, Path, Path]) -> None:
    archive, victim, picture = hostile
    done = subprocess.run(
        [sys.executable, "-m", "detrain.cli", "predict", f"model={archive}", f"source={picture}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=archive.parent,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {archive} (code/__torch__/") and done.stderr.count("\n") == 1
    assert "which a detrain export never" in done.stderr
    assert victim.read_bytes() == SAFE


def test_the_api_loads_nothing_until_it_serves_and_trust_export_is_the_users_call(
    hostile: tuple[Path, Path, Path],
) -> None:
    archive, victim, picture = hostile
    model = Model(archive)  # reads the recorded names only
    assert model.names == {0: "a"} and victim.read_bytes() == SAFE
    with pytest.raises(ScriptRefused, match="which a detrain export never"):
        model.predict(picture, imgsz=64)
    assert victim.read_bytes() == SAFE
    # what the check stands between: told to trust the file, torch runs its code, and the file is written
    model.predict(picture, imgsz=64, trust_export=True)
    assert victim.read_bytes() != SAFE


@pytest.mark.parametrize(
    ("line", "key"),
    [("trust_export: true", "trust_export"), ("download_anywhere: true", "download_anywhere")],
)
def test_a_cfg_file_cannot_lift_a_guard(tmp_path: Path, line: str, key: str) -> None:
    cfg = tmp_path / "args.yaml"
    cfg.write_text(f"{line}\nepochs: 3\n")
    command = "predict" if key == "trust_export" else "train"
    with pytest.raises(ConfigError, match=f"^cfg=.*args.yaml: {key}: true lifts a safety guard") as info:
        make_cfg({"cfg": str(cfg)}, command)
    assert f"{key}=true" in str(info.value)
    assert getattr(make_cfg({"cfg": str(cfg), key: "true"}, command).inputs, key) is True  # given beside it: taken
    cfg.write_text(f"{key}: false\n")  # a run's args.yaml records the guard down: accepted back
    assert getattr(make_cfg({"cfg": str(cfg)}, command).inputs, key) is False


def test_a_cfg_file_cannot_name_an_export(tmp_path: Path) -> None:
    cfg = tmp_path / "args.yaml"
    cfg.write_text("model: runs/x/best.torchscript\n")
    with pytest.raises(ConfigError, match="is an exported file, which runs as a program: name it on the command"):
        make_cfg({"cfg": str(cfg)}, "predict")
    assert make_cfg({"cfg": str(cfg), "model": "best.onnx"}, "predict").inputs.model == "best.onnx"
