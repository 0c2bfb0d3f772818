"""The TorchScript code check (detrain/engine/script_check.py): what a traced detrain export writes passes; what
reaches a file, defines a load-time hook or calls anything but tensor operators is one line naming the file, the
line and the call. Pure text: nothing here is loaded by torch."""

from __future__ import annotations

import pytest

from detrain.engine.script_check import ScriptRefused, check_script_source

pytestmark = pytest.mark.unit

TRACED = """class Conv(Module):
  __parameters__ = ["weight", ]
  weight : Tensor
  def forward(self: __torch__.Conv,
    x: Tensor) -> Tensor:
    weight = self.weight
    _0 = torch._convolution(x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True, True)
    _1 = ops.prim.NumToTensor(torch.size(_0, 2))
    _2 = (self.act).forward(torch.silu(_0), )
    return torch.cat([_2, torch.mul(_2, annotate(float, 2.0))], 1)
  def forward1(self: __torch__.Conv, x: Tensor) -> Tensor:
    return torch.reshape(x, [int(torch.size(x, 0)), -1])
"""


def test_what_a_trace_writes_passes() -> None:
    check_script_source(TRACED, "m.torchscript")


@pytest.mark.parametrize(
    ("line", "found"),
    [
        ("t = torch.from_file(self.p, True, 4, dtype=0)", "calls torch.from_file"),
        ("t = torch.ops.aten.from_file(self.p)", "calls torch.ops.aten.from_file"),
        ("t = ops.aten.from_file(self.p)", "calls ops.aten.from_file"),
        ("t = ops.prim.Print(x)", "calls ops.prim.Print"),
        ("f = torch.from_file", "calls torch.from_file"),  # reached, not called: still refused
        ("t = torch.save(x, 'a')", "calls torch.save"),
        ("t = open('a')", "calls open"),
        ("t = (self.conv).save(x)", "calls self.conv.save"),
        ("t = [x][0](x)", "calls a computed function"),
        ("import os", "holds import, which a trace never writes"),
    ],
)
def test_anything_but_tensor_math_is_refused(line: str, found: str) -> None:
    source = f"class M(Module):\n  def forward(self, x: Tensor) -> Tensor:\n    {line}\n    return x\n"
    with pytest.raises(ScriptRefused, match=r"^m\.torchscript line 3 ") as info:
        check_script_source(source, "m.torchscript")
    assert found in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("method", ["__setstate__", "__getstate__", "helper", "__init__"])
def test_a_method_other_than_forward_is_refused(method: str) -> None:
    source = f"class M(Module):\n  def {method}(self, s: List[str]) -> NoneType:\n    return None\n"
    with pytest.raises(ScriptRefused, match=f"line 2 defines {method}, which a detrain export never does"):
        check_script_source(source, "m.torchscript")


def test_code_that_is_not_python_syntax_is_refused() -> None:
    with pytest.raises(ScriptRefused, match="code that is not TorchScript's printed form"):
        check_script_source("def forward(self:\n", "m.torchscript")
