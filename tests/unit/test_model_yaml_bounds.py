"""Hostile model yamls (issue 25, item 1): each attack is one ConfigError line naming the yaml and the key or
layer, in well under a second, with nothing allocated; the plan's parameter and module counts are exactly what the
builder makes for every packaged and Ultralytics detect yaml at every scale, so the parameter bound judges the real
model.

The attacks are the issue's (widths, repeats or reg_max in the millions that asked torch for 129 GB to 5.7 TB,
wrongly typed fields, non-integer class keys) and their neighbours found while writing the checks.
"""

from __future__ import annotations

import contextlib
import copy
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from detrain.engine.build import architecture
from detrain.errors import ConfigError
from detrain.nn import yaml_plan
from detrain.nn.model import DetectionModel, build_layers, check_architecture, class_names, load_model_yaml
from detrain.nn.yaml_plan import MAX_CHANNELS, MAX_MODULES, MAX_PARAMETERS, plan_layers

ULTRALYTICS_MODELS = Path("/opt/ulib/ultralytics/cfg/models")
# the Ultralytics 8.4.190 detect yamls detrain builds (every other one names a module detrain does not build)
ULTRALYTICS_DETECT = ["v8/yolov8.yaml", "v8/yolov8-p2.yaml", "11/yolo11.yaml", "26/yolo26.yaml", "26/yolo26-p2.yaml"]
ULTRALYTICS_DETECT += ["26/yolo26-p6.yaml"]
PACKAGED = ["yolov8.yaml", "yolo11.yaml", "yolo26.yaml"]


def _yaml(name: str = "yolov8.yaml") -> dict[str, Any]:
    d, _ = load_model_yaml(name)
    return d


def _rows(d: dict[str, Any]) -> list[list[Any]]:
    return d["backbone"] + d["head"]


def _changed(change: Any, name: str = "yolov8.yaml") -> dict[str, Any]:
    d = _yaml(name)
    d["scale"] = "n"
    change(d)
    return d


@contextlib.contextmanager
def _address_space_cap(extra: int = 1 << 30) -> Iterator[None]:
    """At most ``extra`` more bytes of address space meanwhile: should a check regress, the build's allocation
    fails (and the test with it) instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _refusal(d: dict[str, Any], tmp_path: Path, **kwargs: Any) -> str:
    """Build ``d`` from a file: the one ConfigError line, reached without allocating (under an address-space cap, and
    the peak resident size grows by less than 100 MB)."""
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError) as err, _address_space_cap():
        DetectionModel(str(path), **kwargs)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: under 100 MB more
    message = str(err.value)
    assert "\n" not in message and len(message) < 400, message
    assert str(path) in message, message  # the file is named
    return message


def _set_row(index: int, row: list[Any]) -> Any:
    def change(d: dict[str, Any]) -> None:
        part, at = ("backbone", index) if index < len(d["backbone"]) else ("head", index - len(d["backbone"]))
        d[part][at] = row

    return change


def _set_arg(index: int, position: int, value: Any) -> Any:
    def change(d: dict[str, Any]) -> None:
        _rows(d)[index][3][position] = value

    return change


def _set_field(index: int, position: int, value: Any) -> Any:
    def change(d: dict[str, Any]) -> None:
        _rows(d)[index][position] = value

    return change


ATTACKS: list[tuple[str, Any, str]] = [
    # the allocations: widths, repeats, reg_max in the millions
    ("width-1e6", lambda d: d["scales"].update(n=[0.33, 1e6, 1024]), "multiples up to 16"),
    ("depth-1e6", lambda d: d["scales"].update(n=[1e6, 0.25, 1024]), "multiples up to 16"),
    ("channels-1e6", lambda d: (d["scales"].update(n=[0.33, 0.25, 1e9]), _set_arg(0, 0, 10**6)(d)), "250000 output"),
    ("channels-after-width", lambda d: d["scales"].update(n=[0.33, 16, 4096]), f"at most {MAX_CHANNELS} per layer"),
    ("repeats-1e6", _set_field(2, 1, 10**6), "330000 repeats; detrain builds 0 to 32"),
    ("repeats-2**100", _set_field(2, 1, 2**100), "repeats; detrain builds 0 to 32"),
    ("reg-max-1e6", lambda d: d.update(reg_max=10**6), "reg_max must be a whole number of DFL bins (1 to 64)"),
    ("nc-1e7", lambda d: d.update(nc=10**7), "nc must be a whole number from 1 to 100000"),
    ("head-width-1e7", lambda d: d.update(head_cls_channels=10**7), "head_cls_channels must be a whole number"),
    ("kernel-1e4", _set_arg(0, 1, 10**4), "argument 2 (kernel) must be a whole number from 1 to 31, got 10000"),
    ("sppf-kernel-1e5", _set_arg(9, 1, 10**5), "argument 2 (kernel) must be a whole number from 1 to 31"),
    ("upsample-1e30", _set_arg(10, 0, 1e30), "scale factor must be a number from 1 to 8"),
    # wrongly typed fields
    ("nc-text", lambda d: d.update(nc="x"), "nc must be a whole number from 1 to 100000, got 'x'"),
    ("nc-float", lambda d: d.update(nc=80.5), "nc must be a whole number"),
    ("nc-true", lambda d: d.update(nc=True), "nc must be a whole number"),
    ("width-nan", lambda d: d["scales"].update(n=[0.33, float("nan"), 1024]), "expected [depth, width, max_channels]"),
    ("width-inf", lambda d: d["scales"].update(n=[0.33, float("inf"), 1024]), "expected [depth, width, max_channels]"),
    ("scales-list", lambda d: d.update(scales=[[0.33, 0.25, 1024]]), "'scales' must map scale names"),
    ("reg-max-text", lambda d: d.update(reg_max="16"), "reg_max must be a whole number"),
    ("end2end-text", lambda d: d.update(end2end="yes"), "end2end must be True or False"),
    ("channels-nan", _set_arg(0, 0, float("nan")), "output channels) must be a whole number >= 1, got nan"),
    ("channels-text", _set_arg(0, 0, "wide"), "output channels) must be a whole number >= 1, got 'wide'"),
    ("stride-0", _set_arg(0, 2, 0), "argument 3 (stride) must be a whole number from 1 to 8, got 0"),
    ("stride-float", _set_arg(0, 2, 2.5), "argument 3 (stride) must be a whole number"),
    ("shortcut-text", _set_arg(2, 1, "False"), "argument 2 (shortcut) must be True or False, got 'False'"),
    ("from-text", _set_field(1, 0, "a"), "'from' must be one layer index, got 'a'"),
    ("from-float", _set_field(1, 0, 0.5), "'from' must be one layer index, got 0.5"),
    ("from-future", _set_field(11, 0, [-1, 10**30]), "which is not built yet (valid: -11 to 10)"),
    ("from-before-image", _set_field(3, 0, -9), "it reads layer -9, which is not built yet (valid: -3 to 2)"),
    ("from-list-for-conv", _set_field(1, 0, [-1, 0]), "'from' must be one layer index"),
    ("concat-from-int", _set_field(11, 0, -1), "'from' must be a list of 1 to 16 layer indices"),
    ("repeats-text", _set_field(2, 1, "3"), "repeats must be a whole number, got '3'"),
    ("repeats-negative", _set_field(2, 1, -2), "-2 repeats"),
    ("conv-repeated", _set_field(1, 1, 9), "3 repeats of Conv; detrain builds it once"),
    ("module-number", _set_field(1, 2, 7), "unknown module 7"),
    ("args-dict", _set_field(0, 3, {"a": 1}), "args must be a list, got {'a': 1}"),
    ("args-nested", _set_arg(2, 1, [[1]]), "argument 2 is [[1]], not a number"),
    ("args-too-many", _set_field(0, 3, [64, 3, 2, 1]), "detrain builds Conv from at most 3 arguments"),
    ("row-short", _set_row(1, [-1, 1, "Conv"]), "must be [from, repeats, module, args]"),
    ("row-text", _set_row(1, "Conv"), "must be [from, repeats, module, args]"),
    ("upsample-mode", _set_field(10, 3, [None, 2, "bogus"]), "the mode must be one of nearest"),
    ("concat-dim", _set_arg(11, 0, 7), "Concat joins channels (dimension 1), not dimension 7"),
    ("detect-in-the-middle", _set_row(5, [[4], 1, "Detect", ["nc"]]), "Detect must be the last layer"),
    ("after-detect", lambda d: d["head"].append([-1, 1, "Conv", [64, 3, 1]]), "Detect must be the last layer"),
    ("no-detect", _set_row(22, [-1, 1, "Conv", [64, 3, 1]]), "the last model layer must be Detect"),
    ("layers-300", lambda d: d["backbone"].extend([[-1, 1, "Conv", [64, 3, 1]]] * 300), "detrain builds at most 256"),
]


@pytest.mark.parametrize(("change", "fragment"), [a[1:] for a in ATTACKS], ids=[a[0] for a in ATTACKS])
def test_each_hostile_yaml_is_one_line_naming_the_file(change: Any, fragment: str, tmp_path: Path) -> None:
    message = _refusal(_changed(change), tmp_path)
    assert fragment in message, message


def test_the_c3k2_expansion_and_attention_split_are_checked(tmp_path: Path) -> None:
    message = _refusal(_changed(_set_arg(2, 2, 1e9), "yolo11.yaml"), tmp_path)
    assert "argument 3 (expansion) must be a number in (0, 1], got 1000000000.0" in message
    # 200 channels cannot split into 3 heads of 64: the forward would fail on the first batch
    message = _refusal(_changed(_set_field(10, 3, [800]), "yolo11.yaml"), tmp_path)
    assert "C2PSA keeps its width" in message
    d = _changed(lambda d: None, "yolo11.yaml")
    d["scales"]["n"] = [0.5, 1.0, 400]  # C2PSA of 400 channels: attention over 200 in 3 heads
    assert "attention over 200 channels in 3 heads" in _refusal(d, tmp_path)


def test_a_model_past_the_parameter_bound_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """Every layer within its bounds, the whole 12.9e9 parameters (52 GB of float32): refused from the plan."""
    wide = [[-1, 1, "Conv", [MAX_CHANNELS, 3, 1]]] * 20
    d = {"scale": "n", "backbone": [[-1, 1, "Conv", [64, 3, 2]], *wide], "head": [[[-1], 1, "Detect", ["nc"]]]}
    message = _refusal(d, tmp_path)
    assert "describes a model of 12,878,194,656 parameters" in message
    assert f"at most {MAX_PARAMETERS:,} parameters" in message


def test_a_model_past_the_module_bound_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """Small layers, but 12 of 32 attention blocks each: about 12,800 torch modules (seconds to construct; 256 such
    layers, which the layer and repeat bounds allow, would take minutes)."""
    block = [-1, 32, "C3k2", [128, False, 0.5, True]]
    d = {"scale": "n", "backbone": [[-1, 1, "Conv", [128, 3, 2]], *[block] * 12], "head": [[[-1], 1, "Detect", [2]]]}
    message = _refusal(d, tmp_path)
    assert "modules; detrain builds" in message and f"{MAX_MODULES:,} modules" in message


def test_a_checkpoint_style_dict_is_refused_without_a_file_name() -> None:
    """A dict (a checkpoint's yaml) keeps the messages ``model layer N`` the caller prefixes with the file."""
    with pytest.raises(ConfigError, match=r"^model layer 0 \(Conv \[64, 10000, 2\]\) cannot be built: argument 2"):
        DetectionModel(_changed(_set_arg(0, 1, 10**4)))
    with pytest.raises(ConfigError, match=r"^model yaml: reg_max must be"):
        DetectionModel(_changed(lambda d: d.update(reg_max=0)))


def test_a_hostile_yaml_on_the_command_line_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """``architecture`` (the preflight of every command) checks a yaml on disk as the builder would."""
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(_changed(lambda d: d["scales"].update(n=[0.33, 1e6, 1024]))))
    with pytest.raises(ConfigError, match="multiples up to 16"):
        architecture(str(path))
    assert architecture("yolo11s.yaml")[1] == "s"


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        ({"a": "cat"}, "key 'a' is not one"),
        ({0.5: "cat"}, "key 0.5 is not one"),
        ({True: "cat"}, "key True is not one"),
        ({0: "cat", 2: "dog"}, "key 2 is not one"),
        ({-1: "cat"}, "key -1 is not one"),
        (["cat"], "must be a dict of index -> name"),
    ],
)
def test_class_names_with_other_keys_are_one_line(names: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        DetectionModel(nc=len(names), names=names)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert class_names({"1": "dog", 0: "cat"}) == {1: "dog", 0: "cat"}  # digits as text still count, order kept


def _cases() -> list[tuple[str, str]]:
    cases = [(name, scale) for name in PACKAGED for scale in "nsmlx"]
    if ULTRALYTICS_MODELS.is_dir():
        for rel in ULTRALYTICS_DETECT:
            cases += [(str(ULTRALYTICS_MODELS / rel), scale) for scale in "nsmlx"]
    return cases


def _case_id(name: str, scale: str) -> str:
    return f"{'ultralytics-' if name.startswith('/') else ''}{Path(name).stem}-{scale}"


@pytest.mark.parametrize(("name", "scale"), _cases(), ids=[_case_id(*case) for case in _cases()])
def test_the_plan_counts_exactly_what_the_builder_makes(name: str, scale: str) -> None:
    """Parameters and modules, with 80 classes and with 3: the estimate the bound judges is the model itself."""
    d = yaml.safe_load(Path(name).read_text()) if name.startswith("/") else _yaml(name)
    for nc in (80, 3):
        with torch.device("meta"):
            model = DetectionModel(copy.deepcopy(d), scale=scale, nc=nc)
        plan = plan_layers(copy.deepcopy(model.yaml), scale, nc)
        assert plan.params == sum(p.numel() for p in model.parameters())
        assert plan.modules == len(list(model.modules()))
        assert plan.params < MAX_PARAMETERS / 10 and plan.modules < MAX_MODULES / 5  # far inside the bounds


def test_the_bounds_sit_far_above_the_largest_real_detectors() -> None:
    largest = check_architecture(_yaml("yolov8.yaml"), "x")
    assert largest.params == 68_229_648 and max(layer.c_out for layer in largest.layers) == 1280  # a Concat
    assert 10 * largest.params <= yaml_plan.MAX_PARAMETERS and MAX_CHANNELS >= 6 * 1280
    assert yaml_plan.MAX_REPEATS == 32 and yaml_plan.MAX_REG_MAX == 64 and yaml_plan.MAX_CLASSES == 100_000


def test_build_layers_still_builds_from_a_dict() -> None:
    layers, save, strides = build_layers(_yaml("yolo26.yaml"), "s", 3)
    assert len(layers) == 24 and strides == [8.0, 16.0, 32.0] and 16 in save
