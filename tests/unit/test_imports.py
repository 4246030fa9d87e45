"""The floors of the package, checked from the source (ast; nothing is imported).

weights/ and models/ sit below train/: they read the parallel layout through the ground floor's
`dapo_megatron/parallel.py`, never `dapo_megatron.train`, not even inside a function (a local
import would only hide the upward arrow). Module-level imports form no cycle, and no function-local
import closes one. Only train/ and the layout interface read Megatron's parallel_state. Function-local imports of our own package stay within a per-module
allowance, each with its reason (LOCAL_IMPORTS).

    python tests/unit/test_imports.py    # prints the offending edges and cycles, if any
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dapo_megatron", "checkpoint_tools")
BELOW_TRAIN = ("dapo_megatron.weights", "dapo_megatron.models")  # must never import train/
TRAIN = "dapo_megatron.train"
# The config is read by every role: it imports none of the roles' packages, not even inside a
# function (a rule that needs one of their names takes it from a leaf, e.g. toolcall_formats).
CONFIG = "dapo_megatron.config"
ROLES = tuple(f"dapo_megatron.{p}" for p in ("driver", "rollout", "train", "toolcall", "reward", "tools"))
# Megatron's parallel state: read by train/ (init, teardown, forkserver preload) and the layout
# interface only; everyone else goes through dapo_megatron.parallel.
PARALLEL_STATE = "megatron.core.parallel_state"
PARALLEL_STATE_READERS = ("dapo_megatron.parallel", TRAIN)


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported module (a submodule when `from pkg import submodule`)
    line: int
    local: bool  # inside a function body: runs when called, not at import time

    def __str__(self) -> str:
        return f"{self.src}:{self.line} -> {self.dst}{' (function-local)' if self.local else ''}"


def module_files() -> dict[str, Path]:
    """Module name -> file, for every .py under PACKAGES (a package is its __init__.py)."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The module names `node` imports (`from pkg import name` names pkg.name when that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package that holds `module`
        anchor = module.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    if not _under(base, PACKAGES):  # outside: `from megatron.core import parallel_state` is a module
        return [f"{base}.{a.name}" for a in node.names]
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def _walk(node: ast.AST, local: bool):
    """(import node, inside a function) for every import under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, local
        inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def import_edges() -> list[Edge]:
    """Every import in PACKAGES, to our modules and to outside ones (megatron, torch, ...)."""
    files = module_files()
    known = set(files)
    edges = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, local in _walk(tree, local=False):
            for dst in _imported(node, module, path.name == "__init__.py", known):
                edges.append(Edge(module, dst, node.lineno, local))
    return edges


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def upward_edges(edges: list[Edge]) -> list[Edge]:
    """weights/ or models/ -> train/ and config/ -> a role's package (at any level), and
    parallel_state outside its readers."""
    return [e for e in edges
            if (_under(e.src, BELOW_TRAIN) and _under(e.dst, (TRAIN,)))
            or (_under(e.src, (CONFIG,)) and _under(e.dst, ROLES))
            or (_under(e.dst, (PARALLEL_STATE,)) and not _under(e.src, PARALLEL_STATE_READERS))]


def import_cycles(edges: list[Edge], local: bool = False) -> list[list[str]]:
    """Cycles among module-level imports of our modules (`local`: function-local ones too): the
    strongly connected components of more than one module (or a module importing itself)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if (local or not e.local) and _under(e.dst, PACKAGES):
            graph.setdefault(e.src, set()).add(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan; the graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


# Function-local imports of our own package, per module, each kind of reason in a word: 22 in
# all (159 before #72 split the commands' command line from their work and moved the rest to the
# top of their modules). A new one needs its module's count raised here with a reason.
COMMAND = "a command's work, loaded once its arguments parse: --help and a usage error stay instant"
HEAVY = "transformers, PIL or Ray, only on the path that needs them (the role's start stays light)"
OPTIONAL = "an optional path (VL, a device kind, tiny:// assets) loads only when taken"
SANDBOX = "the tool sandbox's interpreter imports toolcall and must not load torch (the config does)"
LOCAL_IMPORTS = {
    "dapo_megatron.convert": (1, COMMAND),
    "dapo_megatron.evaluate": (1, COMMAND),
    "dapo_megatron.tools.check_sync": (1, COMMAND),
    "checkpoint_tools.inspect": (1, COMMAND),
    "dapo_megatron.tools.from_verl": (2, COMMAND),  # the config (torch) only for --yaml / a translation
    "dapo_megatron.main": (3, HEAVY),  # Ray and the data readers after the config checks out
    "dapo_megatron.train.worker": (1, HEAVY),  # the asset resolver (transformers) for model.tokenizer_path
    "dapo_megatron.device": (4, OPTIONAL),  # Megatron's and vLLM's CPU patches, on a CPU only
    "dapo_megatron.rollout.features": (3, OPTIONAL),  # images (PIL, the VL processor) for a VL model
    "dapo_megatron.driver.setup": (1, OPTIONAL),  # the VL processor for a VL model
    "dapo_megatron.assets.build": (2, OPTIONAL),  # the VL bundle's builder
    "dapo_megatron.plan.__main__": (1, OPTIONAL),  # tiny:// models' builders
    "dapo_megatron.toolcall.registry": (1, SANDBOX),
}


def local_imports(edges: list[Edge]) -> dict[str, int]:
    """module -> its function-local import statements of our packages."""
    out: dict[str, int] = {}
    for src, _ in {(e.src, e.line) for e in edges if e.local and _under(e.dst, PACKAGES)}:
        out[src] = out.get(src, 0) + 1
    return out


def test_edges_are_found():
    # The checks below are only as good as the parser: it must see both kinds of import.
    edges = import_edges()
    assert any(e.src == "dapo_megatron.weights.load" and e.dst == "dapo_megatron.parallel" and not e.local
               for e in edges)
    assert any(e.src == "dapo_megatron.train.parallel" and e.dst == PARALLEL_STATE and e.local for e in edges)
    a, b = "dapo_megatron.a", "dapo_megatron.b"
    assert import_cycles([Edge(a, b, 1, False), Edge(b, a, 1, True)]) == []
    assert import_cycles([Edge(a, b, 1, False), Edge(b, a, 1, True)], local=True) == [[a, b]]


def test_no_upward_imports():
    assert [str(e) for e in upward_edges(import_edges())] == []


def test_no_module_level_import_cycle():
    assert import_cycles(import_edges()) == []


def test_no_cycle_closed_by_a_function_local_import():
    # A local import that closes a circle (assets/build.py <-> assets/tools.py once) only
    # postpones it to the first call: the shared piece belongs a floor down.
    assert import_cycles(import_edges(), local=True) == []


def test_function_local_imports_of_our_package_stay_within_their_allowance():
    counts = local_imports(import_edges())
    over = {m: (n, LOCAL_IMPORTS.get(m, (0, ""))[0]) for m, n in counts.items() if n > LOCAL_IMPORTS.get(m, (0, ""))[0]}
    assert over == {}, f"module: (function-local imports of our package, allowed by LOCAL_IMPORTS): {over}"
    assert sum(n for n, _ in LOCAL_IMPORTS.values()) <= 30  # the bound #72 set: a new one moves another
    a, b = "dapo_megatron.a", "dapo_megatron.b"  # one statement importing two names counts once
    assert local_imports([Edge(a, b, 3, True), Edge(a, b + ".c", 3, True), Edge(a, "torch", 4, True)]) == {a: 1}


if __name__ == "__main__":
    found = import_edges()
    print(f"{len(found)} imports, {sum(e.local for e in found)} function-local")
    for e in upward_edges(found):
        print("upward:", e)
    for c in import_cycles(found):
        print("cycle:", " <-> ".join(c))
    for c in import_cycles(found, local=True):
        print("cycle through function-local imports:", " <-> ".join(c))
    counts = local_imports(found)
    print(f"{sum(counts.values())} function-local imports of our package (allowed: "
          f"{sum(n for n, _ in LOCAL_IMPORTS.values())})")
