"""The package's import graph, read with `ast` from the sources (imports under `if TYPE_CHECKING:`
left out): no cycle among tierkv's modules, at module level or through imports inside functions, and
nothing engine-agnostic imports the vLLM integration (`tierkv.integrations.vllm`), which alone may
stand on vLLM; `TieredLLM` finds the vLLM front end by name."""
from __future__ import annotations

import ast
from pathlib import Path

import tierkv

PACKAGE_DIR = Path(tierkv.__file__).parent
VLLM_INTEGRATION = "tierkv.integrations.vllm"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _all_imports(body: list[ast.stmt]):
    """Every import statement, in functions too (a lazy import still ties two modules), except those
    under `if TYPE_CHECKING:` (annotations only)."""
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _all_imports(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _all_imports([c for c in children if isinstance(c, ast.AST)])


def _module_level_imports(body: list[ast.stmt]):
    """Import statements run when the module is imported: the top level, and inside top-level
    `if`/`try`/`with` blocks (not `if TYPE_CHECKING:`); never inside functions or classes."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _module_level_imports(block)
        elif isinstance(node, ast.With):
            yield from _module_level_imports(node.body)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(*, lazy: bool = False) -> dict[str, set[str]]:
    """module -> the tierkv modules it imports at module level, with `lazy` in functions too (a name
    that is a submodule counts as that submodule)."""
    reader = _all_imports if lazy else _module_level_imports
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        for node in reader(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                source = _absolute(node, module, path.name == "__init__.py")
                names = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
            targets.update(n for n in names if n == "tierkv" or n.startswith("tierkv."))
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_the_package():
    graph = import_graph()
    assert len(graph) > 50
    assert "tierkv.sparse.summaries" in graph and "tierkv.integrations.vllm.connector" in graph
    assert "tierkv.integrations.vllm.far_rows" in graph["tierkv.integrations.vllm.connector"]


def test_the_cycle_finder_finds_a_cycle_of_three():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_tierkv_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycles_even_through_imports_inside_functions():
    """A function-level import that closes a loop hides a cycle rather than removing it."""
    assert cycles(import_graph(lazy=True)) == []


def test_the_lazy_reader_sees_imports_inside_functions_but_not_type_checking_blocks():
    source = ast.parse("""
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from tierkv.engine.runtime import KVRuntime
def f():
    if True:
        from tierkv.config import ConfigError
    class C:
        def g(self):
            import tierkv.units
""")
    names = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in _all_imports(source.body)]
    assert names == ["typing", "tierkv.config", "tierkv.units"]


def test_nothing_engine_agnostic_imports_the_vllm_integration():
    offenders = {
        module: sorted(t for t in targets if t == VLLM_INTEGRATION or t.startswith(VLLM_INTEGRATION + "."))
        for module, targets in import_graph(lazy=True).items()  # not even inside a function
        if not (module == VLLM_INTEGRATION or module.startswith(VLLM_INTEGRATION + "."))
    }
    assert {m: t for m, t in offenders.items() if t} == {}


def test_no_two_module_names_differ_by_an_added_letter():
    """`sparse_cache` beside `sparse_cached` reads as one module; `cpu` beside `gpu` does not."""
    names = sorted({p.stem for p in PACKAGE_DIR.rglob("*.py") if p.stem != "__init__"})

    def one_letter_added(a: str, b: str) -> bool:
        short, long = sorted((a, b), key=len)
        return len(long) == len(short) + 1 and any(long[:i] + long[i + 1:] == short for i in range(len(long)))

    assert [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if one_letter_added(a, b)] == []


HOST_ONLY_PACKAGE = "tierkv.scheduler"  # deciding: plain Python, no device work
DEVICE_MODULES = ("torch", "numpy", "triton", "cupy")
DEVICE_SIDE = "tierkv.transfer"  # the doing side: streams, events, copies, device tensors
DEVICE_ATTRIBUTES = {"cuda", "to", "pin_memory", "record_stream", "wait_event", "wait_stream", "synchronize"}
DEVICE_KEYWORDS = {"device", "non_blocking", "pin_memory"}


def host_only_offences(source: str, module: str, is_package: bool = False) -> list[str]:
    """What in `source` could reach a device: an import of torch, numpy, triton, cupy or
    `tierkv.transfer` (inside functions too), a device method or attribute (`.cuda`, `.to(...)`,
    `.pin_memory()`, stream and event calls) or a `device=` / `non_blocking=` / `pin_memory=`
    argument."""
    tree = ast.parse(source)
    names = set()
    for node in _all_imports(tree.body):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        else:
            base = _absolute(node, module, is_package)
            names.update([base] + [f"{base}.{a.name}" for a in node.names])
    offences = sorted(f"import {n}" for n in names if n.split(".")[0] in DEVICE_MODULES
                      or n == DEVICE_SIDE or n.startswith(DEVICE_SIDE + "."))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in DEVICE_ATTRIBUTES:
            offences.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in DEVICE_KEYWORDS:
            offences.append(f"line {node.lineno}: {node.arg}=")
    return offences


def test_the_host_only_check_sees_every_kind_of_device_work():
    """The checker itself: each planted piece of device work is found, plain host code is not."""
    planted = {
        "import torch": "import torch",
        "import numpy.linalg": "import numpy.linalg",
        "def f():\n    from tierkv.transfer.device import to_device_no_sync": "import tierkv.transfer.device",
        "from tierkv import transfer": "import tierkv.transfer",
        "from ..transfer import lookahead": "import tierkv.transfer.lookahead",
        "def f(t):\n    return t.cuda()": "line 2: .cuda",
        "def f(t, d):\n    return t.to(d)": "line 2: .to",
        "x = make(3, device='cuda')": "line 1: device=",
        "def f(t):\n    return t.pin_memory()": "line 2: .pin_memory",
        "def f(s, e):\n    s.wait_event(e)": "line 2: .wait_event",
    }
    for source, offence in planted.items():
        assert offence in host_only_offences(source, "tierkv.scheduler.x"), source
    clean = "from tierkv.scheduler.plan import StepPlan\nfrom typing import TYPE_CHECKING\nx = range(3)\n"
    assert host_only_offences(clean, "tierkv.scheduler.x") == []


def test_the_scheduler_decides_on_the_host_only():
    """Every module of `tierkv.scheduler` (the step plan, the staging ring's chunk order) is plain
    Python: it imports neither torch (nor numpy, triton, cupy) nor `tierkv.transfer`, not even inside
    a function, and calls nothing that moves data to a device; its decisions reach the device through
    `tierkv.transfer` (`step_indices`, `lookahead`)."""
    files = module_files()
    modules = sorted(m for m in files if m == HOST_ONLY_PACKAGE or m.startswith(HOST_ONLY_PACKAGE + "."))
    assert {"tierkv.scheduler.plan", "tierkv.scheduler.staging_ring"} <= set(modules)
    offenders = {}
    for module in modules:
        path = files[module]
        found = host_only_offences(path.read_text(), module, path.name == "__init__.py")
        if found:
            offenders[module] = found
    assert offenders == {}
