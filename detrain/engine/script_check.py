"""What a TorchScript archive's code may do before ``torch.jit.load`` runs any of it.

A ``.torchscript`` file is a zip whose ``code/`` folder holds TorchScript source (Python syntax). ``torch.jit.load``
runs a class's ``__setstate__`` while loading, and ``forward`` at every call, and TorchScript reaches torch's file
operators: ``torch.from_file(path, shared=True)`` maps any file the user can write, read-write. So before the archive
is loaded its code is read here with Python's :mod:`ast` (nothing is executed) and refused, one line naming the file
and the first thing found, unless every function is a ``forward`` (what a trace writes: ``forward``, ``forward1``
...) and every name it reaches in ``torch`` or ``ops`` is one of :data:`TENSOR_OPS` / :data:`PRIM_OPS`: the tensor
operators detrain's exports of YOLOv8, YOLO11 and YOLO26 use, and a margin of other pure tensor math. None of them
reads or writes a file, starts a process or touches storage outside its tensors.

``trust_export=true`` (command line or API only, never a ``cfg=`` file) loads an archive without this check: a
TorchScript written by another tool, or by a custom module, that the user vouches for.

>>> check_script_source("def forward(self, x: Tensor) -> Tensor:\\n  return torch.silu(x)\\n", "code/m.py")
>>> check_script_source("def forward(self, x: Tensor) -> Tensor:\\n  return torch.from_file('/etc/x')\\n", "m.py")
Traceback (most recent call last):
...
detrain.engine.script_check.ScriptRefused: m.py line 2 calls torch.from_file, which a detrain export never uses
"""

from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

from detrain.errors import ConfigError
from detrain.system.text import excerpt, shown

__all__ = ["ScriptRefused", "check_script_source", "check_torchscript"]

# The tensor operators a traced detrain export calls as ``torch.<op>`` (YOLOv8, YOLO11 and YOLO26, NMS or top-k
# heads), then more of the same kind (activations, reductions, shapes, comparisons) so that a retrace by another
# torch release still passes. Nothing here touches a file, a process or memory outside its tensors.
TENSOR_OPS = frozenset(
    """
    _convolution add amax arange cat chunk contiguous device div expand flatten floor_divide full gather matmul
    max_pool2d meshgrid mul numpy_T remainder reshape sigmoid silu size slice softmax split_with_sizes stack sub sum
    to topk transpose unsqueeze upsample_nearest2d view
    abs adaptive_avg_pool2d addmm amin argmax avg_pool2d batch_norm bmm ceil clamp clamp_min clone constant_pad_nd
    conv2d dim div_ dropout eq exp expand_as floor ge gelu gt hardsigmoid hardswish index_select layer_norm le
    leaky_relu linear log log_softmax lt max mean min mm mul_ narrow ne neg numel ones ones_like pad permute pow
    relu repeat round rsqrt scaled_dot_product_attention select sign split sqrt squeeze tanh type_as unbind where
    zeros zeros_like sort index masked_fill logical_and logical_or logical_not detach floor_ add_ sub_ copy_
    """.split()
)
# ``ops.prim.<op>`` calls a trace writes for sizes and constants
PRIM_OPS = frozenset("NumToTensor device dtype layout min max unchecked_unwrap_optional".split())
# plain calls the serialized code uses (builtins of TorchScript's printer)
BUILTINS = frozenset("getattr int float bool annotate len range unchecked_cast uninitialized isinstance".split())
FORWARD = re.compile(r"forward\d*\Z")
MAX_CODE_BYTES = 64 << 20  # a YOLO export's code is about 1 MB; an archive with more is no detrain export


class ScriptRefused(ConfigError):
    """The archive's code does something a detrain export never does."""


def check_torchscript(path: str | Path) -> None:
    """Refuse the TorchScript archive ``path`` (one :class:`ScriptRefused` line naming it and the first finding)
    when its code may do more than tensor math: see the module docstring. Reads the zip's ``code/`` records only;
    nothing is unpickled or run."""
    name = shown(str(path))
    try:
        with zipfile.ZipFile(path) as archive:
            records = [i for i in archive.infolist() if _is_code(i.filename)]
            if sum(i.file_size for i in records) > MAX_CODE_BYTES:
                raise ScriptRefused(f"{name}: its code is over {MAX_CODE_BYTES >> 20} MB, no detrain export")
            if not records:
                raise ScriptRefused(f"{name}: no TorchScript code in the archive")
            for info in records:
                source = archive.read(info).decode("utf-8", errors="replace")
                check_script_source(source, f"{name} ({excerpt(_inner(info.filename), 60, quote=False)})")
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ConfigError(f"{name}: not a readable TorchScript archive ({type(e).__name__})") from None


def _is_code(member: str) -> bool:
    parts = member.split("/")
    return "code" in parts[:2] and member.endswith(".py")


def _inner(member: str) -> str:
    """A record's name below the archive's top folder (``code/__torch__/...``)."""
    return member.split("/", 1)[-1]


def check_script_source(source: str, where: str) -> None:
    """Refuse one file of TorchScript code (``where`` names it in the line) unless it only defines ``forward``
    methods and reaches only the operators of :data:`TENSOR_OPS`, :data:`PRIM_OPS` and :data:`BUILTINS`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ScriptRefused(f"{where}: code that is not TorchScript's printed form") from None
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not FORWARD.match(node.name):
            raise ScriptRefused(
                f"{where} line {line} defines {excerpt(node.name, 40, quote=False)}, which a detrain export never "
                "does (a trace writes forward only; __setstate__ runs at load)"
            )
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Lambda, ast.Global, ast.Nonlocal)):
            raise ScriptRefused(f"{where} line {line} holds {type(node).__name__.lower()}, which a trace never writes")
        if isinstance(node, ast.Call):
            _check_call(node, where)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            _check_reach(node, where)


def _check_call(node: ast.Call, where: str) -> None:
    func = node.func
    if isinstance(func, ast.Name):
        if func.id not in BUILTINS:
            _refuse(where, node.lineno, func.id)
    elif isinstance(func, ast.Attribute):
        dotted = _dotted(func)
        root = dotted.split(".", 1)[0] if dotted else ""
        if root in ("torch", "ops"):
            _check_reach(func, where)
        elif not FORWARD.match(func.attr):  # a submodule's method: (self.conv).forward(x)
            _refuse(where, node.lineno, dotted or f"<expression>.{func.attr}")
    else:
        _refuse(where, node.lineno, "a computed function")


def _check_reach(node: ast.Attribute, where: str) -> None:
    """``torch.<op>`` must name a tensor operator, ``ops.prim.<op>`` a prim one; any other path into ``torch`` or
    ``ops`` (``torch.ops.aten.from_file``, ``ops.aten.save``) is refused."""
    dotted = _dotted(node)
    if dotted is None:
        return
    parts = dotted.split(".")
    if parts[0] == "torch" and not (len(parts) == 2 and parts[1] in TENSOR_OPS):
        _refuse(where, node.lineno, dotted)
    prim = parts[1:2] == ["prim"] and (len(parts) == 2 or (len(parts) == 3 and parts[2] in PRIM_OPS))
    if parts[0] == "ops" and not prim:  # ``ops.prim`` alone: the head of a chain checked as a whole
        _refuse(where, node.lineno, dotted)


def _dotted(node: ast.expr) -> str | None:
    """``torch.ops.aten.x`` for that chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _refuse(where: str, line: int, what: str) -> None:
    raise ScriptRefused(
        f"{where} line {line} calls {excerpt(what, 60, quote=False)}, which a detrain export never uses"
    )
