"""The import graph of converters/ and service/ has no cycle, counting every import: module-level, inside
functions, under TYPE_CHECKING, and the names a package surface loads lazily (``_EXPORTS``). A deferred import
of the project's own modules is allowed only in service/, only to keep a heavy library out of start-up, and says
why on its line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("converters", "service")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def _known(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` refers to (``pkg.mod.attr`` -> ``pkg.mod``), if it is one of ours."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            # a lazy package surface: {"name": "module"}; loading the name imports the module
            names.update(value.value for value in node.value.values if isinstance(value, ast.Constant))
    targets = {_known(name, known) for name in names}
    return {target for target in targets if target and target != module}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_among_converters_and_service():
    known = _modules()
    graph = {module: _imported(module, path, known) for module, path in known.items()}
    assert sum(len(targets) for targets in graph.values()) > 300  # the walk sees the imports at all
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _deferred_project_imports() -> list[tuple[Path, int, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").split("\n")
            for function in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                        text = "\n".join(lines[node.lineno - 1:node.end_lineno])
                        found.append((path.relative_to(ROOT), node.lineno, text))
    return found


def test_deferred_imports_of_our_modules_only_keep_heavy_libraries_out_of_the_service_and_say_so():
    deferred = _deferred_project_imports()
    assert not [entry for entry in deferred if entry[0].parts[0] == "converters"]
    unexplained = [f"{path}:{line}" for path, line, text in deferred if "#" not in text]
    assert not unexplained, "a deferred import needs a one-line reason (the heavy library it keeps out)"


def test_every_lazily_exported_name_is_defined_where_its_package_says():
    """A package surface's ``_EXPORTS`` names the module each public name loads from; a name moved to another
    module without its entry would fail only when a user first imports it."""
    import importlib

    missing = []
    for path in sorted((ROOT / "converters").rglob("__init__.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
                for key, value in zip(node.value.keys, node.value.values, strict=True):
                    if not hasattr(importlib.import_module(value.value), key.value):
                        missing.append(f"{path.relative_to(ROOT)}: {key.value} is not in {value.value}")
    assert missing == []


def test_the_workers_and_the_model_check_children_load_no_web_framework_and_no_migration_tool():
    """A worker, its fork server and conversion children (``service.workers.child``) and the API's model-check
    children (``service.api.analyze_pool``) serve no HTTP and change no schema: fastapi (about 0.2 s of imports)
    stays with the API (``service.api.error_responses``) and alembic with the schema's upgrade, off every one of
    those process starts."""
    code = ("import sys, service.workers.child, service.workers.worker, service.api.analyze_pool; "
            "print(sorted(name for name in ('fastapi', 'starlette', 'alembic') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.split() == ["[]"]
