"""The import graph keeps the layering docs/architecture.md describes: no import cycle between
the project's modules (imports inside functions count: a deferred import hides a cycle, it does
not remove it; `if TYPE_CHECKING:` imports do not run and do not count), and `scheduler/` and
`kvcache/` stay pure (the standard library and numpy; no torch, no server, no engine)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "engine", "scheduler", "kvcache", "triton_compat", "benchmarks")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module name `path` imports at run time (any depth, TYPE_CHECKING blocks left out;
    `from a.b import c` names a.b and a.b.c, since c may be a module)."""
    tree = ast.parse(path.read_text())
    hidden = {id(node) for block in ast.walk(tree)
              if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
              for stmt in block.body for node in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, 1972)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    graph = _graph()
    assert len(graph) > 100                       # the walk found the project
    cycles = _cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in cycles]
    assert cycles == [], f"import cycles (module -> the cycle's modules it imports): {detail}"


def test_the_cycle_check_sees_deferred_imports():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    tree_imports = _imports(ROOT / "api" / "cli.py")
    assert "api.launch" in tree_imports           # imported inside main()


def test_scheduler_and_kvcache_stay_pure():
    allowed_roots = {"scheduler", "kvcache", "numpy", "__future__"} | set(sys.stdlib_module_names)
    for name, path in _modules().items():
        if name.split(".")[0] in ("scheduler", "kvcache"):
            roots = {target.split(".")[0] for target in _imports(path)}
            assert roots <= allowed_roots, f"{path.relative_to(ROOT)} imports {roots - allowed_roots}"


def test_the_triton_core_never_imports_its_front_end():
    """Triton's layering: the protocols (`triton_compat.frontend`) sit on the models
    (`triton_compat.core`); the core, and what both share, never reach up."""
    for name, path in _modules().items():
        if name.startswith(("triton_compat.core", "triton_compat.errors", "triton_compat.trace")):
            up = {t for t in _imports(path) if t.startswith("triton_compat.frontend")}
            assert not up, f"{path.relative_to(ROOT)} imports {sorted(up)}"


def test_the_api_process_loads_without_torch():
    """`continuum serve`'s app module imports neither torch, transformers nor the engine core
    (docs/architecture.md, start-up): the engine's process starts first and imports them, and
    the API process's own start would otherwise pay seconds for them before it."""
    import subprocess
    code = ("import sys, api.server; print(sorted(m for m in ('torch', 'transformers', "
            "'engine.core', 'engine.core_proc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
