"""A relay host without torch, in a test: the relay started in a Python that can import only the standard library,
netbridge and what the relay's own distribution declares (relay/pyproject.toml: its dependencies and extras).
Everything else (torch, transformers, numpy, cryptography, the model code, ...) raises ModuleNotFoundError, as on a
host where only `pip install ./relay` ran, and each blocked import is written to stderr (the relay's log) so a
test can also see an import that the relay caught and survived.

    with start_relay_without_torch(tmp_path, "--handshake-timeout-s", "2") as relay:   # a RelayProcess
        ...
        assert blocked_imports(relay.log()) == []

The block is a meta-path finder put first, before netbridge.relay's main runs (`python -c`), so it sees every import
the relay makes; what the interpreter imported at start-up (site, .pth files) is standard library only. `org` goes
to the usual finders (which find nothing): copy and pickle probe for Jython's org.python.core.
"""
from __future__ import annotations

import re
import sys
import tomllib
from contextlib import contextmanager
from pathlib import Path

from tests.support.relay_harness import relay_process
from tests.support.tiny_models import REPO

RELAY_PYPROJECT = REPO / "relay" / "pyproject.toml"
BLOCKED_LINE = "relay_without_torch: blocked import of "

_BLOCKER = """\
import importlib.abc, sys
ALLOWED = {allowed!r}
class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in ALLOWED or top in sys.stdlib_module_names or top.startswith("_sysconfigdata") or top == "org":
            return None
        print({line!r} + name, file=sys.stderr, flush=True)
        raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: this process stands for a relay host "
                                  "with only tandem-relay installed)", name=name)
sys.meta_path.insert(0, _Blocker())
"""


def relay_distribution_requires() -> set[str]:
    """The import names of what relay/pyproject.toml lets a relay host install (dependencies and every extra)."""
    project = tomllib.loads(RELAY_PYPROJECT.read_text())["project"]
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {re.match(r"[A-Za-z0-9_.-]+", s).group(0).replace("-", "_").lower() for s in specs}


def blocking_python(code: str) -> list[str]:
    """argv of a Python that runs `code` with only the standard library, netbridge and the relay's declared
    dependencies importable."""
    allowed = sorted({"netbridge", "__future__"} | relay_distribution_requires())
    return [sys.executable, "-c", _BLOCKER.format(allowed=allowed, line=BLOCKED_LINE) + code]


def relay_command() -> list[str]:
    """argv that runs `python -m netbridge.relay` behind the block (the relay's flags follow it)."""
    return blocking_python("import runpy\nrunpy.run_module('netbridge.relay', run_name='__main__', alter_sys=True)\n")


def blocked_imports(log: str) -> list[str]:
    return [line.split(BLOCKED_LINE, 1)[1] for line in log.splitlines() if BLOCKED_LINE in line]


@contextmanager
def start_relay_without_torch(tmp_path: Path, *extra: str, **kw):
    """relay_harness.relay_process (same flags and keywords: netns, host, secret), torch made unimportable."""
    with relay_process(tmp_path, *extra, command=relay_command(), **kw) as relay:
        yield relay
