"""docs/design.md's code references (`path.py:function`, `path.py:Class`, `path.py:Class.method`) name files that
exist and functions, classes or methods defined in them, so the one-round page stays true as the code moves. Read
with `ast`: nothing is imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
REFERENCE = re.compile(r"`([\w./-]+\.py):([A-Za-z_][\w.]*)`")


def defined(path: Path) -> set[str]:
    """The top-level functions and classes of `path`, and Class.method for each method of a top-level class."""
    names = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def references(text: str) -> list[tuple[str, str]]:
    return REFERENCE.findall(text)


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_the_reader_finds_references_and_definitions(tmp_path):
    """The checks below could fail: a method, a function and a class are found; a missing one is not."""
    module = tmp_path / "m.py"
    module.write_text("class A:\n    def b(self):\n        def inner():\n            pass\n\n\ndef c():\n    pass\n")
    assert defined(module) == {"A", "A.b", "c"}
    assert references("see `m.py:A.b` and `x/y.py:c`, not `m.py` nor m.py:c") == [("m.py", "A.b"), ("x/y.py", "c")]


def test_the_one_round_page_walks_the_round_through_the_code():
    """Both ranks' sides, the wire, the verification and the commit are named on the page, by reference."""
    refs = references(section(DESIGN.read_text(), "One round on one page"))
    files = {path for path, _ in refs}
    assert len(refs) >= 30, refs
    assert {"speculative/session.py", "speculative/blocks.py", "speculative/drafters.py", "model_parallel/stage.py",
            "netbridge/protocol.py", "speculative/rounds.py", "speculative/verify.py", "speculative/streams.py",
            "speculative/output.py", "speculative/scheduler.py", "launch/serve/engine.py"} <= files, files


@pytest.mark.parametrize("path, name", sorted(set(references(DESIGN.read_text()))))
def test_every_code_reference_in_the_design_page_resolves(path, name):
    file = REPO / path
    assert file.is_file(), f"docs/design.md names {path}, which does not exist"
    assert name in defined(file), f"docs/design.md names {path}:{name}, which {path} does not define"
