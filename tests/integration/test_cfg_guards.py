"""Keys a ``cfg=`` file cannot set to lift a guard, beside ``download_anywhere``, ``trust_export`` and an exported
``model:`` (tests/integration/test_export_attacks.py): issue 37 item 3.

* ``master_addr`` on one machine (``nnodes`` 1): the rendezvous store listens on it, so a file's 0.0.0.0 or public
  address would open the group to the network. From a file only loopback (127.0.0.0/8, ::1, localhost) is taken
  there; several nodes need a reachable address, and take the file's.
* ``project``: a run writes its folder there. From a file only a folder inside the current working folder (links
  resolved), or the project the file's own run folder lies in (a run's ``<project>/<name>/args.yaml`` read back).

Given on the command line or in the API, each is taken; each refusal is one line naming the file and the key.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from detrain.config.cfg import make_cfg
from detrain.errors import ConfigError
from detrain.system.text import path_excerpt


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder of its own (``tmp_path/work``), with the cfg file's folder beside it."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def _cfg(folder: Path, text: str, name: str = "args.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------ master_addr


@pytest.mark.parametrize("addr", ["0.0.0.0", "10.0.0.1", "gpu07", "::"])
def test_a_cfg_file_cannot_open_a_one_machine_group_to_the_network(here: Path, addr: str) -> None:
    cfg = _cfg(here, f"master_addr: '{addr}'\nepochs: 3\n")
    with pytest.raises(ConfigError) as info:
        make_cfg({"cfg": str(cfg)}, "train")
    said = str(info.value)
    assert said.startswith("cfg=") and "\n" not in said
    assert f"args.yaml: master_addr: {addr} lifts a safety guard: on one machine (nnodes=1)" in said
    assert f"(detrain ... master_addr={addr})" in said
    assert make_cfg({"cfg": str(cfg), "master_addr": addr}, "train").distributed.master_addr == addr  # given: taken
    with pytest.raises(ConfigError, match=r"master_addr: .* lifts a safety guard"):
        make_cfg({"cfg": str(cfg), "nnodes": "1:1"}, "train")  # one node at most is one machine too


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_from_a_cfg_file_is_taken(here: Path, addr: str) -> None:
    cfg = _cfg(here, f"master_addr: '{addr}'\n")
    assert make_cfg({"cfg": str(cfg)}, "train").distributed.master_addr == addr


def test_several_nodes_take_the_files_address(here: Path) -> None:
    """A run of two nodes (from the file or the command line) needs an address the other node reaches."""
    cfg = _cfg(here, "master_addr: 10.0.0.1\nnnodes: 2\n")
    assert make_cfg({"cfg": str(cfg)}, "train").distributed.master_addr == "10.0.0.1"
    cfg = _cfg(here, "master_addr: 10.0.0.1\n")
    assert make_cfg({"cfg": str(cfg), "nnodes": "1:2"}, "train").distributed.master_addr == "10.0.0.1"
    with pytest.raises(ConfigError, match="lifts a safety guard"):  # the command line's nnodes=1 decides
        make_cfg({"cfg": str(_cfg(here, "master_addr: 10.0.0.1\nnnodes: 2\n")), "nnodes": "1"}, "train")


# ------------------------------------------------------------------ project


@pytest.mark.parametrize("far", ["/elsewhere/runs", "../outside", "runs/../../outside", "~/runs"])
def test_a_cfg_file_cannot_send_the_run_outside_the_working_folder(here: Path, far: str) -> None:
    target = {"/elsewhere/runs": here.parent / "elsewhere" / "runs"}.get(far, far)
    cfg = _cfg(here.parent / "downloads", f"project: {target}\nname: .ssh\nexist_ok: true\n")
    if far == "~/runs":  # a folder named '~' inside the working folder: detrain does not expand it
        assert make_cfg({"cfg": str(cfg)}, "train").output.project == far
        return
    with pytest.raises(ConfigError) as info:
        make_cfg({"cfg": str(cfg)}, "train")
    said = str(info.value)
    assert said.startswith("cfg=") and "\n" not in said
    shown = path_excerpt(target, 80)
    assert f"args.yaml: project: {shown} is outside the current folder {path_excerpt(here, 80)}: " in said
    assert said.endswith(f"(detrain ... project={shown})")
    assert not (here.parent / "elsewhere").exists() and not (here.parent / "outside").exists()
    assert make_cfg({"cfg": str(cfg), "project": str(target)}, "train").output.project == str(target)  # given


def test_a_folder_inside_the_working_folder_is_taken(here: Path) -> None:
    cfg = _cfg(here.parent / "downloads", "project: runs/a/../b\nname: x\n")
    assert make_cfg({"cfg": str(cfg)}, "train").output.project == "runs/a/../b"
    cfg = _cfg(here.parent / "downloads", f"project: {here / 'runs'}\n")  # absolute, inside
    assert make_cfg({"cfg": str(cfg)}, "train").output.project == str(here / "runs")


def test_a_link_out_of_the_working_folder_counts_where_it_leads(here: Path) -> None:
    (here.parent / "elsewhere").mkdir()
    (here / "link").symlink_to(here.parent / "elsewhere")
    cfg = _cfg(here, "project: link/runs\n")
    with pytest.raises(ConfigError, match="project: link/runs is outside the current folder"):
        make_cfg({"cfg": str(cfg)}, "train")


def test_a_runs_own_args_yaml_reruns_from_anywhere(here: Path) -> None:
    """``<project>/<name>/args.yaml`` names its own project: read back from another folder, it is taken (the
    README's ``detrain train cfg=runs/train/exp/args.yaml``, with project= an absolute folder); its project with
    another run name is not the file's own run folder."""
    project = here.parent / "experiments"
    for name in ("exp2", ""):
        cfg = _cfg(project / "exp2", f"project: {project}\nname: '{name}'\n")
        assert make_cfg({"cfg": str(cfg)}, "train").output.project == str(project)
    cfg = _cfg(project / "exp2", f"project: {project}\nname: other\nexist_ok: true\n")
    with pytest.raises(ConfigError, match="is outside the current folder"):
        make_cfg({"cfg": str(cfg)}, "train")
    downloads = _cfg(here.parent / "home" / "Downloads", f"project: {here.parent / 'home'}\nname: .ssh\n")
    with pytest.raises(ConfigError, match="is outside the current folder"):  # the file's grandparent, another name
        make_cfg({"cfg": str(downloads)}, "train")


def test_the_cli_refuses_in_one_line(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from detrain import cli

    cfg = _cfg(here, "master_addr: 0.0.0.0\n")
    with pytest.raises(SystemExit) as done:
        cli.main(["train", f"cfg={cfg}", "device=cpu", "data=missing.yaml"])  # broken: stops there, not training
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cfg=") and err.count("\n") == 1
    assert "args.yaml: master_addr: 0.0.0.0 lifts a safety guard" in err
    assert os.listdir(here) == ["args.yaml"]  # nothing started, nothing written
