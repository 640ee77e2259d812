"""The order `make test` hands modules to its workers (tests/conftest.py `LONG_MODULES`) names modules that exist,
and the Makefile keeps xdist from reordering them: a renamed module would silently fall back to the end. And
`make test` and `make demo` compile tracegen's bytecode before they start the processes that import it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _long_modules() -> tuple[str, ...]:
    # Read from the file: several conftest.py exist, so `import conftest` may give another one.
    for node in ast.parse((ROOT / "tests" / "conftest.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["LONG_MODULES"]:
            return ast.literal_eval(node.value)
    raise AssertionError("tests/conftest.py defines no LONG_MODULES")


def test_every_long_module_exists_and_make_test_keeps_the_order() -> None:
    long_modules = _long_modules()
    # A folder (ending in "/") stands for the modules in it that run as one unit (tests/conftest.py).
    missing = [m for m in long_modules if not ((ROOT / m).is_dir() if m.endswith("/") else (ROOT / m).is_file())]
    assert not missing, f"tests/conftest.py LONG_MODULES names modules that do not exist: {missing}"
    assert len(set(long_modules)) == len(long_modules)
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert recipe and "--dist loadfile --no-loadscope-reorder" in recipe.group(1), recipe


def test_the_modules_sharing_a_cluster_exist_and_ask_for_it() -> None:
    """A renamed module would start a cluster of its own, on whichever worker gets it."""
    from e2e.shared_cluster import SHARED_CLUSTER_MODULES

    for module in SHARED_CLUSTER_MODULES:
        assert (ROOT / module).is_file(), f"e2e.shared_cluster names a module that does not exist: {module}"
        assert "shared_cluster" in (ROOT / module).read_text(), f"{module} does not use the shared cluster"


def test_make_test_and_demo_compile_tracegens_bytecode_first() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in ("test", "demo"):
        prerequisites = re.search(rf"^{target}:(.*)$", makefile, re.M)
        assert prerequisites and "bytecode" in prerequisites.group(1).split(), target
    recipe = re.search(r"^bytecode:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and "compileall" in recipe.group(1) and {"include", "dags", "plugins"} <= set(recipe.group(1).split())
