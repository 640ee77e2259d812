"""The package's layering, checked in fresh interpreters: read-only tools do not load the GPU-facing
side, and no module imports one that imports it back."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "include" / "tracegen"
# What generating rows needs and reading a ledger does not.
GPU_SIDE = ("tracegen.generate", "tracegen.fleet", "tracegen.sglang", "tracegen.simulator", "httpx")
# The fleet by reference, which run records hold: its package loads nothing else until asked for more.
FLEET_REF = ("tracegen.fleet", "tracegen.fleet.ref")


def _loaded_by(module: str) -> list[str]:
    probe = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["tracegen.status", "tracegen.watch", "tracegen.export", "tracegen.review",
                                    "tracegen.run.run_report", "tracegen.run.run_record", "tracegen.params"])
def test_read_only_tools_load_no_engine_fleet_or_client(module: str) -> None:
    loaded = _loaded_by(module)
    assert module in loaded
    pulled = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in GPU_SIDE) and m not in FLEET_REF]
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


# The package's layers, top to bottom, as docs/architecture.md states them. A module may import its own
# layer and the layers below it, never one above: the adapters (CLI, Airflow tasks, pages) sit on the run,
# the run on the audit and the fleet, and everything on the output root's storage and the config.
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    {"__main__", "sample_data"},
    {"cli", "demo"},
    {"steps"},
    {"tasks"},
    {"review", "review_gate", "status", "watch", "export"},
    {"generate"},
    {"run"},
    {"audit", "fleet"},
    {"simulator", "params"},
    {"dataset", "sglang"},
    {"store", "config", "common"},
))


def _layer_of(unit: str) -> int:
    for depth, layer in enumerate(LAYERS):
        if unit in layer:
            return depth
    raise AssertionError(f"tracegen.{unit} is in no layer: add it to LAYERS and to docs/architecture.md")


def climbs(package: Path = PACKAGE) -> list[str]:
    """Every import of a package or top-level module from one above it."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).with_suffix("")
        unit = rel.parts[0]
        for imported in sorted(_imports(path)):
            parts = imported.split(".")
            target = parts[1] if len(parts) > 1 else None
            if target is None or target == unit or not (package / target).exists() and not (
                    package / f"{target}.py").exists():
                continue
            if _layer_of(target) < _layer_of(unit) and not any(f.startswith(f"{rel}: imports tracegen.{target} ")
                                                                for f in found):
                found.append(f"{rel}: imports tracegen.{target} (layer {_layer_of(target)}) from layer {_layer_of(unit)}")
    return found


def test_no_package_imports_one_above_it() -> None:
    assert climbs() == []


def _package_copy(tmp_path: Path) -> Path:
    """The package's source copied under `tmp_path`, to plant an import in (data files left out)."""
    copy = tmp_path / "tracegen"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.jsonl.gz", "*.json", "*.npz"))
    return copy


def test_the_layer_check_catches_a_planted_climb(tmp_path: Path) -> None:
    copy = _package_copy(tmp_path)
    (copy / "store" / "planted.py").write_text("from tracegen.run.run_record import read_run_record\n")
    assert climbs(copy) == ["store/planted: imports tracegen.run (layer 6) from layer 10"]


# Imports the layers allow but the design does not: the SGLang client returns what the server said, and
# `tracegen.generate.rows` turns it into ledger rows, so nothing in sglang/ knows the ledger's format.
FORBIDDEN: dict[str, tuple[str, ...]] = {"sglang": ("store",)}


def forbidden_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of a package that FORBIDDEN keeps from the importing one."""
    found = []
    for unit, banned in FORBIDDEN.items():
        for path in sorted((package / unit).rglob("*.py")):
            rel = path.relative_to(package).with_suffix("")
            hits = sorted({m.split(".")[1] for m in _imports(path) if len(m.split(".")) > 1} & set(banned))
            found.extend(f"{rel}: imports tracegen.{target}" for target in hits)
    return found


def test_the_sglang_client_imports_nothing_of_the_store() -> None:
    assert forbidden_imports() == []


def test_the_forbidden_import_check_catches_a_planted_import(tmp_path: Path) -> None:
    copy = _package_copy(tmp_path)
    (copy / "sglang" / "planted.py").write_text("def f():\n    from tracegen.store.records import GeneratedRow\n")
    assert forbidden_imports(copy) == ["sglang/planted: imports tracegen.store"]


# The stand-in serves the tests and the demo. What drives real SGLang imports nothing of it, so a change to
# the stand-in cannot change how production validates, launches or reads a fleet.
STAND_IN_IMPORTERS = frozenset({"simulator", "cli", "demo"})


def stand_in_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of tracegen.simulator from outside STAND_IN_IMPORTERS."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).with_suffix("")
        if rel.parts[0] in STAND_IN_IMPORTERS:
            continue
        if any(m == "tracegen.simulator" or m.startswith("tracegen.simulator.") for m in _imports(path)):
            found.append(f"{rel}: imports tracegen.simulator")
    return found


def test_production_code_imports_nothing_of_the_stand_in() -> None:
    assert stand_in_imports() == []


def test_the_stand_in_check_catches_a_planted_import(tmp_path: Path) -> None:
    copy = _package_copy(tmp_path)
    (copy / "fleet" / "planted.py").write_text("def f():\n    from tracegen.simulator.batching import Batch\n")
    assert stand_in_imports(copy) == ["fleet/planted: imports tracegen.simulator"]
