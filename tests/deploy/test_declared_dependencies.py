"""Every third-party module tracegen's code imports is a declared dependency of the project, and every declared
dependency nothing imports says who needs it.

A module that only arrives with another package (numpy through pandas, paramiko through the SSH provider) works
until that package drops it; declared, it is pinned and installed whatever the others do. The project's
dependencies are requirements.txt, which pyproject.toml reads.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("include", "dags", "plugins")


def _imported_modules() -> dict[str, set[str]]:
    """Each absolute import of a module outside the standard library and tracegen: module -> files."""
    found: dict[str, set[str]] = {}
    for folder in SCANNED:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "tracegen":
                        found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def _distributions(module: str) -> set[str]:
    """The distributions that may provide `module`. Airflow's namespace is shared by core and every provider:
    `airflow.providers.ssh...` is apache-airflow-providers-ssh, `airflow.providers.common.compat...`
    apache-airflow-providers-common-compat, the rest is apache-airflow's."""
    parts = module.split(".")
    if parts[0] == "airflow":
        if len(parts) > 2 and parts[1] == "providers":
            provider = parts[2:4] if parts[2] == "common" and len(parts) > 3 else parts[2:3]
            return {canonicalize_name("apache-airflow-providers-" + "-".join(provider))}
        return {"apache-airflow"}
    return {canonicalize_name(d) for d in importlib.metadata.packages_distributions().get(parts[0], [])}


def _declared_file() -> Path:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    files = pyproject["tool"]["setuptools"]["dynamic"]["dependencies"]["file"]
    assert files == ["requirements.txt"], files
    return ROOT / files[0]


def _declared() -> dict[str, str]:
    """Each declared distribution -> the comment block just above its line."""
    declared, comment = {}, []
    for line in _declared_file().read_text().splitlines():
        if line.startswith("#"):
            comment.append(line)
        elif line.strip():
            declared[canonicalize_name(Requirement(line).name)] = "\n".join(comment)
            comment = []
    return declared


def test_the_project_declares_what_its_code_imports() -> None:
    declared = _declared()
    undeclared = {}
    for module, files in _imported_modules().items():
        providers = _distributions(module)
        if not providers & declared.keys():
            undeclared[module] = (sorted(providers) or ["not installed"], sorted(files)[:2])
    assert not undeclared, f"imported but not in requirements.txt (module: distributions, files): {undeclared}"


def test_a_dependency_nothing_imports_says_who_needs_it() -> None:
    imported = set().union(*(_distributions(module) for module in _imported_modules()))
    silent = [name for name, comment in _declared().items()
              if name not in imported and not re.search(r"Not imported by tracegen: \S", comment)]
    assert not silent, f"declared, never imported, and no 'Not imported by tracegen: <who needs it>': {silent}"
