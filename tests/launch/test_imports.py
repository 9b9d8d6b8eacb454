"""The layering, read from the source with `ast` (every import statement, module level or inside a
function): the libraries (speculative/, kvcache/, model_parallel/, netbridge/) never import launch/ or
the entry; kvcache/ needs nothing but torch and the standard library; netbridge/ carries bytes and
knows no model code."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import REPO

LIBRARIES = ("speculative", "kvcache", "model_parallel", "netbridge")


def project_packages() -> set[str]:
    return {p.parent.name for p in REPO.glob("*/__init__.py")} | {p.stem for p in REPO.glob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (relative imports resolve to its package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(path.parent.name if node.level else node.module.split(".")[0])
    return found


def package_imports(package: str) -> dict[str, set[str]]:
    files = sorted((REPO / package).rglob("*.py"))
    assert files, package
    return {str(f.relative_to(REPO)): imports_of(f) for f in files}


def offenders(package: str, forbidden) -> dict[str, list[str]]:
    bad = {}
    for file, names in package_imports(package).items():
        hits = sorted(n for n in names if forbidden(n))
        if hits:
            bad[file] = hits
    return bad


def test_the_reader_sees_imports_at_every_level(tmp_path):
    """The checks below could fail: the reader finds module-level, function-level, dotted and
    relative imports."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("import os.path\nfrom launch.build import x\n\ndef f():\n    import transformers\n"
                              "    from . import sibling\n    from .other import y\n")
    assert imports_of(pkg / "m.py") == {"os", "launch", "transformers", "pkg"}
    assert {"model_parallel", "netbridge"} <= package_imports("speculative")["speculative/rounds.py"]
    assert {"launch", "speculative"} <= project_packages()


@pytest.mark.parametrize("package", LIBRARIES)
def test_libraries_do_not_import_launch_or_the_entry(package):
    entries = {p.stem for p in REPO.glob("*.py")}  # train_free_infer and any other top-level script
    assert offenders(package, lambda n: n == "launch" or n in entries) == {}


def test_kvcache_needs_only_torch():
    project = project_packages()

    def foreign(name):
        if name in ("torch", "kvcache", "__future__"):
            return False
        return name in project or name not in sys.stdlib_module_names
    assert offenders("kvcache", foreign) == {}


def test_netbridge_knows_no_model_code():
    model_code = {"model_parallel", "speculative", "kvcache", "transformers", "launch"}
    assert offenders("netbridge", lambda n: n in model_code) == {}
