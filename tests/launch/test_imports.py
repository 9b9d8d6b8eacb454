"""The layering, read from the source with `ast` (every import statement, module level or inside a
function): the libraries (speculative/, kvcache/, model_parallel/, netbridge/) never import launch/ or
the entry; kvcache/ needs nothing but torch and the standard library; netbridge/ carries bytes and
knows no model code. Within launch/, the serving layer (launch/serve/) and torchrun's plugins
(launch/torchrun/) sit on top: the rest of launch/ never imports them, and neither imports the other."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support.imports import dotted_imports
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


def modules_of(path: Path) -> set[str]:
    return modules_of_at(path, REPO)


def modules_of_at(path: Path, root: Path) -> set[str]:
    """The full dotted names of every module `path` (under `root`) imports (a relative import resolved against
    its package; `from a import b` gives a.b as well, since b may be a module)."""
    return dotted_imports(path, ".".join(path.relative_to(root).parent.parts))


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


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
    nested = tmp_path / "launch" / "serve"
    nested.mkdir(parents=True)
    (nested / "m.py").write_text("from launch.torchrun import rendezvous\n\ndef f():\n    from . import tools\n"
                                 "    from ..build import x\n")
    found = {n for n in modules_of_at(nested / "m.py", tmp_path)}
    assert {"launch.torchrun.rendezvous", "launch.serve.tools", "launch.build"} <= found


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


def test_the_rest_of_launch_never_imports_the_serving_layer_or_the_torchrun_plugins():
    """launch/serve/ and launch/torchrun/ build on launch/ (the config, the build, telemetry), never the other way:
    the entry (train_free_infer.py), not launch/ranks.py, decides to serve."""
    bad = {}
    for path in sorted((REPO / "launch").glob("*.py")):
        hits = sorted(n for n in modules_of(path) if under(n, "launch.serve") or under(n, "launch.torchrun"))
        if hits:
            bad[path.name] = hits
    assert bad == {}
    assert any(under(n, "launch.serve") for n in modules_of(REPO / "train_free_infer.py"))


@pytest.mark.parametrize("package, other", [("launch/serve", "launch.torchrun"), ("launch/torchrun", "launch.serve")])
def test_the_serving_layer_and_the_torchrun_plugins_do_not_import_each_other(package, other):
    files = sorted((REPO / package).rglob("*.py"))
    assert len(files) > 1, package
    bad = {str(f.relative_to(REPO)): sorted(n for n in modules_of(f) if under(n, other)) for f in files}
    assert {f: hits for f, hits in bad.items() if hits} == {}


def test_the_terminal_client_needs_only_the_standard_library():
    """tandem-chat (launch/serve/chat.py) runs where Tandem is not installed with its dependencies."""
    names = {n.split(".")[0] for n in modules_of(REPO / "launch" / "serve" / "chat.py")}
    assert {n for n in names if n not in sys.stdlib_module_names and n != "__future__"} == set()
