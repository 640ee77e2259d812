"""The package's layering, checked in fresh interpreters: read-only tools do not load the GPU-facing
side, and no module imports one that imports it back."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "include" / "tracegen"
# What generating rows needs and reading a ledger does not.
GPU_SIDE = ("tracegen.generate", "tracegen.fleet", "tracegen.sglang", "tracegen.simulator", "httpx")


def _loaded_by(module: str) -> list[str]:
    probe = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["tracegen.status", "tracegen.export", "tracegen.review_app",
                                    "tracegen.audit.run_report", "tracegen.run.records", "tracegen.params"])
def test_read_only_tools_load_no_engine_fleet_or_client(module: str) -> None:
    loaded = _loaded_by(module)
    assert module in loaded
    pulled = [m for m in loaded if m.startswith(GPU_SIDE)]
    assert pulled == [], f"importing {module} pulls in {pulled}"


def test_the_trigger_form_module_loads_neither_pandas_nor_airflow() -> None:
    loaded = _loaded_by("tracegen.params")
    assert not [m for m in loaded if m.split(".")[0] in ("pandas", "numpy", "airflow")]


def _imports(path: Path) -> set[str]:
    """tracegen modules `path` imports, at module level or inside functions (TYPE_CHECKING blocks excepted)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tracegen"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tracegen"))
    return found


def test_no_import_cycles() -> None:
    modules: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        modules[".".join(parts)] = path
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    # A package's __init__ re-exporting its own modules is not a cycle between concepts.
    graph = {n: {m for m in deps if not (modules[n].name == "__init__.py" and m.startswith(n + "."))}
             for n, deps in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # A submodule importing its own package's __init__ (which imports it back) is how Python packages
    # work; only cycles between distinct modules count.
    real = [c for c in cycles if not any(modules[m].name == "__init__.py" for m in c)]
    assert real == [], real
