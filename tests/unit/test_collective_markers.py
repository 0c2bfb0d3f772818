"""Every place the engine meets the other ranks is marked: each use of a communicating function of
:mod:`detrain.distributed.dist` under ``detrain/engine`` carries a ``# collective:`` comment on its line, or in the
comment block right above it (docs/architecture.md promises it). A reader then finds every point where ranks wait for
each other, and could disagree, by searching for one word.

Which functions communicate is read from ``dist.py`` itself: those that call one of torch's collectives (or the store
barrier), directly or through another function of the module. A new collective there is checked here at once.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

DETRAIN = Path(__file__).resolve().parents[2] / "detrain"
ENGINE = DETRAIN / "engine"
DIST = DETRAIN / "distributed" / "dist.py"

# torch.distributed's calls that wait for other ranks (a process group's or the store's)
TORCH_COLLECTIVES = {
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "init_process_group",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "scatter_object_list",
    "send",
}
# what the engine calls today; the set read from dist.py must hold at least these
KNOWN = {"setup", "all_reduce_sum", "reduce_mean", "all_gather_object", "broadcast_object", "agree", "barrier"}
MARKER = re.compile(r"#\s*collective:")


def communicating(source: str) -> set[str]:
    """The public functions of ``source`` (dist.py) that communicate: they call one of torch's collectives
    (``tdist.X``), the store barrier (``_barriers.wait``), or another function of the module that does."""
    functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    calls: dict[str, set[str]] = {}
    talks: set[str] = set()
    for name, fn in functions.items():
        calls[name] = set()
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                torch_collective = f.value.id == "tdist" and f.attr in TORCH_COLLECTIVES
                if torch_collective or (f.value.id, f.attr) == ("_barriers", "wait"):
                    talks.add(name)
            elif isinstance(f, ast.Name) and f.id in functions:
                calls[name].add(f.id)
    changed = True
    while changed:  # through the module's own calls: reduce_mean -> all_reduce_sum, setup -> barrier
        grown = {name for name, callees in calls.items() if callees & talks} - talks
        talks |= grown
        changed = bool(grown)
    return {name for name in talks if not name.startswith("_")}


def uses(source: str, collectives: set[str]) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every use of a function in ``collectives`` of detrain's ``dist`` module in
    ``source``, however imported, called or handed on; a call's lines run to its closing parenthesis."""
    tree = ast.parse(source)
    modules: set[str] = set()  # local names of detrain.distributed.dist
    direct: dict[str, str] = {}  # local name -> dist's function, for `from detrain.distributed.dist import barrier`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "detrain.distributed":
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == "dist"}
        elif isinstance(node, ast.ImportFrom) and node.module == "detrain.distributed.dist":
            direct |= {alias.asname or alias.name: alias.name for alias in node.names if alias.name in collectives}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name == "detrain.distributed.dist" and a.asname}
    ends = {id(n.func): n.end_lineno or n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in collectives:
            owner = ast.unparse(node.value)
            name = node.attr if owner in modules or owner == "detrain.distributed.dist" else None
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in direct:
            name = direct[node.id]
        if name is not None:
            found.append((node.lineno, ends.get(id(node), node.end_lineno or node.lineno), name))
    return sorted(found)


def unmarked(source: str, collectives: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every use (:func:`uses`) without a ``# collective:`` comment on one of its lines, on the line
    right above it, or in the block of comment lines right above it."""
    lines = source.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    marked = {t.start[0] for t in tokens if t.type == tokenize.COMMENT and MARKER.search(t.string)}
    out = []
    for first, last, name in uses(source, collectives):
        top = first - 1  # the line above, and the comment lines above that
        while top > 1 and lines[top - 1].lstrip().startswith("#") and lines[top - 2].lstrip().startswith("#"):
            top -= 1
        if not marked & set(range(max(top, 1), last + 1)):
            out.append((first, name))
    return out


def test_the_communicating_functions_are_read_from_dist() -> None:
    found = communicating(DIST.read_text())
    assert found >= KNOWN
    assert not found & {"rank", "world_size", "local_rank", "is_main", "is_distributed", "cleanup", "info"}


def test_the_check_sees_every_spelling_and_accepts_the_marker_where_it_is_promised() -> None:
    source = "\n".join(
        [
            "from detrain.distributed import dist",  # 1
            "from detrain.distributed import dist as d",  # 2
            "from detrain.distributed.dist import barrier as wait_all",  # 3
            "x = dist.agree(1)",  # 4: unmarked
            "y = dist.agree(1)  # collective: rank 0's word",  # 5
            "# collective: every rank's part,",  # 6
            "# gathered",  # 7
            "z = d.all_gather_object(2)",  # 8: the block above is marked
            "wait_all('end')",  # 9: unmarked
            "reduce = dist.all_reduce_sum",  # 10: handed on, unmarked
            "w = dist.broadcast_object(",  # 11
            "    3,",  # 12
            ")  # collective: rank 0's on every rank",  # 13: marked at the call's last line
            "r = dist.rank()",  # 14: not a collective
            "v = 1  # collective: the line below's",  # 15
            "u = dist.barrier('x')",  # 16: marked on the line above
            "# collective: only the next line's",  # 17
            "t = 0",  # 18
            "s = dist.barrier('y')",  # 19: unmarked (the marked comment is not right above)
        ]
    )
    assert unmarked(source, KNOWN) == [(4, "agree"), (9, "barrier"), (10, "all_reduce_sum"), (19, "barrier")]


def test_every_collective_in_the_engine_is_marked() -> None:
    collectives = communicating(DIST.read_text())
    missing, seen = [], set()
    for path in sorted(ENGINE.rglob("*.py")):
        source = path.read_text()
        seen |= {name for _, _, name in uses(source, collectives)}
        where = path.relative_to(DETRAIN.parent)
        missing += [
            f"{where}:{line} dist.{name} has no '# collective:'" for line, name in unmarked(source, collectives)
        ]
    assert not missing, "\n".join(missing)
    assert seen >= KNOWN  # the scan finds the engine's collectives: it is not looking at nothing
