"""Reading what a module imports from its source (ast, nothing imported): the layering tests
(tests/launch/test_imports.py) and the relay's torch-free closure (tests/netbridge/test_relay_install.py)."""
from __future__ import annotations

import ast
from pathlib import Path


def dotted_imports(path: Path, package: str) -> set[str]:
    """The full dotted names of every module the source at `path` imports, at any level (module, function,
    try/except); a relative import resolved against `package` (the package the file is in), and `from a import b`
    gives a.b as well, since b may be a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            found |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return found
