"""The relay host needs no torch (issue 43): what `tandem-relay` imports, read from the source, is the standard
library, netbridge's relay modules and the dependencies relay/pyproject.toml declares; that distribution holds every
module the relay imports; and the relay runs, pairs nodes and forwards in a process where torch cannot be imported
(tests/support/relay_without_torch.py) and from a fresh venv with only `pip install ./relay` (slow)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from tests.support.imports import dotted_imports
from tests.support.relay_harness import PAIRING, TOKEN, pair, relay_process, run_in_thread
from tests.support.relay_without_torch import (RELAY_PYPROJECT, blocked_imports, blocking_python, relay_distribution_requires,
                                                start_relay_without_torch)
from tests.support.tiny_models import REPO, ids_arg, kill_launch, reference_greedy

RELAY_ENTRY = "netbridge.relay"  # tandem-relay = netbridge.relay:main


# ---- the import closure, read from the source -------------------------------------------------------------------
def module_file(root: Path, name: str) -> Path | None:
    """The source file of a project module (a package's __init__.py), or None when `name` is not one."""
    if not name:
        return None
    base = root.joinpath(*name.split("."))
    for f in (base / "__init__.py", base.with_name(base.name + ".py")):
        if f.is_file():
            return f
    return None


def imports_of(root: Path, name: str) -> set[str]:
    """Dotted names of every module `name`'s source imports, at any level (module, function, try/except):
    a relative import resolved, and `from a import b` as a.b too (b may be a module)."""
    path = module_file(root, name)
    return dotted_imports(path, name if path.name == "__init__.py" else name.rpartition(".")[0])


def closure(root: Path, *entries: str) -> dict[str, set[str]]:
    """Every project module reachable from `entries` (importing a.b.c runs a and a.b too) -> the modules outside
    the project it imports."""
    outside: dict[str, set[str]] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in outside or module_file(root, name) is None:
            continue
        outside[name] = set()
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for imported in imports_of(root, name):
            if module_file(root, imported):
                todo.append(imported)
            elif module_file(root, imported.rpartition(".")[0]) is None:  # not `from package import name`
                outside[name].add(imported)
    return outside


def third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top != "__future__" and top not in sys.stdlib_module_names


def distribution_modules(root: Path) -> set[str]:
    """The modules relay/pyproject.toml puts in the tandem-relay wheel: its packages whole (every .py in them, as
    setuptools' build_py does), its py-modules and their packages' __init__."""
    setup = tomllib.loads((root / "relay" / "pyproject.toml").read_text())["tool"]["setuptools"]
    src = (root / "relay" / setup.get("package-dir", {}).get("", ".")).resolve()
    found = set()
    for package in setup.get("packages", []):
        folder = src.joinpath(*package.split("."))
        found |= {package} | {f"{package}.{f.stem}" for f in folder.glob("*.py") if f.stem != "__init__"}
    for module in setup.get("py-modules", []):
        parent = module.rpartition(".")[0]
        found |= {module} | ({parent} if parent else set())
    return found


def test_the_closure_reader_follows_every_kind_of_import(tmp_path):
    """What the checks below read could miss nothing: function-level, relative, `from package import module`,
    parent packages, and only the outside names that are not the project's."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {"pkg/__init__.py": "import json\n",
             "pkg/entry.py": "from . import helper\nfrom pkg.sub import deep\n\ndef f():\n    import torch.distributed\n",
             "pkg/helper.py": "try:\n    import uvloop\nexcept ImportError:\n    pass\n",
             "pkg/sub/__init__.py": "",
             "pkg/sub/deep.py": "from ..helper import x\nfrom numpy import array\n",
             "pkg/unused.py": "import transformers\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    found = closure(tmp_path, "pkg.entry")
    assert set(found) == {"pkg", "pkg.entry", "pkg.helper", "pkg.sub", "pkg.sub.deep"}
    assert found["pkg.entry"] == {"torch.distributed"} and found["pkg.helper"] == {"uvloop"}
    assert found["pkg.sub.deep"] == {"numpy", "numpy.array"} and found["pkg"] == {"json"}


def test_the_relay_imports_nothing_beyond_the_standard_library_and_its_declared_dependencies():
    """Every module the relay imports, and every module its distribution ships, at any level: a lazy `import torch`
    in a function the relay can reach would need torch on the relay host."""
    allowed = relay_distribution_requires()
    assert "torch" not in allowed and "cryptography" not in allowed
    modules = set(closure(REPO, RELAY_ENTRY)) | distribution_modules(REPO)
    reached = closure(REPO, *modules)
    bad = {m: sorted(n for n in names if third_party(n) and n.split(".")[0] not in allowed) for m, names in reached.items()}
    assert {m: names for m, names in bad.items() if names} == {}, (
        "a relay host installs only relay/pyproject.toml's dependencies: import these lazily where the relay never "
        "reaches them, or declare them there")


def test_the_relay_distribution_ships_every_module_the_relay_imports():
    needed = set(closure(REPO, RELAY_ENTRY))
    assert {"netbridge.relay.cli", "netbridge.auth", "netbridge.link"} <= needed
    assert needed - distribution_modules(REPO) == set(), "add these to relay/pyproject.toml's py-modules (or packages)"


def test_the_relay_distribution_matches_the_main_one():
    """One version and the same console script, so a relay installed from a checkout is that checkout's relay."""
    relay = tomllib.loads(RELAY_PYPROJECT.read_text())["project"]
    main = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert relay["version"] == main["version"] and relay["requires-python"] == main["requires-python"]
    assert relay["scripts"] == {"tandem-relay": main["scripts"]["tandem-relay"]}
    assert set(relay["optional-dependencies"]["uvloop"]) == set(main["optional-dependencies"]["relay"])


# ---- the import blocker -----------------------------------------------------------------------------------------
def test_the_blocker_refuses_torch_and_lets_the_standard_library_and_netbridge_through():
    ok = subprocess.run(blocking_python("import json, asyncio, netbridge.relay\nprint('imported')"), capture_output=True,
                        text=True, cwd=REPO, timeout=60)
    assert ok.returncode == 0 and "imported" in ok.stdout, ok.stderr[-2000:]
    first_blocked = {"torch": "torch", "transformers": "transformers", "numpy": "numpy", "cryptography": "cryptography",
                     "netbridge.frames": "torch", "launch.config": "launch"}
    for module, blocked in first_blocked.items():
        proc = subprocess.run(blocking_python(f"import {module}"), capture_output=True, text=True, cwd=REPO, timeout=60)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, (module, proc.stderr[-2000:])
        assert blocked_imports(proc.stderr)[:1] == [blocked], (module, proc.stderr[-2000:])


# ---- the relay without torch, running -----------------------------------------------------------------------------
def exchange(c0, c1) -> None:
    """A big tensor one way, a small one back, exactly."""
    big = torch.randn(1_048_576)  # 4 MB of fp32: more than the socket buffers on the way
    t, box = run_in_thread(c1.recv, "x")
    c0.send("x", {"round": 1}, big=big)
    t.join(30)
    assert "value" in box, f"rank 1's receive: {box.get('error')!r}"
    assert torch.equal(box["value"].tensors["big"], big)
    c1.send("y", h=big[:5] * 2)
    assert torch.equal(c0.recv("y").tensors["h"], big[:5] * 2)


def rendezvous(addr: str, tmp_path: Path, run_id: str, monkeypatch) -> None:
    """torchrun's rendezvous of two nodes through the relay, in process (the handlers torchrun's agents use): node 0
    hosts the store, node 1 reaches it through the relay, and a key set on one end is read on the other."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from launch.torchrun.relay_rendezvous import RelayRendezvousHandler
    monkeypatch.setenv("TANDEM_RELAY", addr)  # the handlers set these for their workers
    monkeypatch.setenv("TANDEM_NODE_RANK", "")
    token = tmp_path / "rdzv-token"
    token.write_bytes(TOKEN)
    handlers = [RelayRendezvousHandler(RendezvousParameters("tandem-relay", addr, run_id, 2, 2, relay_token_file=str(token),
                                                            node_rank=str(r), join_timeout="30")) for r in (0, 1)]
    try:
        t, box = run_in_thread(handlers[1].next_rendezvous)
        info0 = handlers[0].next_rendezvous()
        t.join(60)
        assert "value" in box, f"node 1's rendezvous: {box.get('error')!r}"
        info1 = box["value"]
        assert (info0.rank, info1.rank, info0.world_size) == (0, 1, 2)
        info1.store.set("from-node-1", b"through the relay")
        assert info0.store.get("from-node-1") == b"through the relay"
    finally:
        for h in handlers:
            h.shutdown()


@pytest.mark.slow  # a torchrun launch of 6-10 s: the default suite keeps under 5 minutes
def test_a_relay_that_cannot_import_torch_pairs_two_nodes_and_their_rendezvous(tmp_path, monkeypatch):
    """A relay subprocess, a 4 MB exchange and a rendezvous: about 0.5 s, so in the default run."""
    with start_relay_without_torch(tmp_path, "--handshake-timeout-s", "2") as relay:
        c0, c1 = pair(relay, "no-torch")
        try:
            exchange(c0, c1)
        finally:
            c0.close()
            c1.close()
        rendezvous(relay.addr, tmp_path, "no-torch-rdzv", monkeypatch)
        assert relay.alive(), relay.log()[-2000:]
        assert blocked_imports(relay.log()) == [], relay.log()[-2000:]
        print(f"\nrelay without torch: paired and forwarded, peak RSS {relay.rss_mb():.1f} MB")


@pytest.mark.slow  # a venv, a wheel build and an install from the package index: about 10-30 s
def test_the_relay_distribution_installs_alone_and_relays(tmp_path, monkeypatch):
    """`pip install ./relay` into a fresh venv from a copy of only relay/ and netbridge/ (what the wheel may read):
    no torch there, `tandem-relay --help` works, and that relay pairs two nodes and their rendezvous."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "relay", src / "relay", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    shutil.copytree(REPO / "netbridge", src / "netbridge", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "relayvenv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # only the venv's own modules
    run = lambda *cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)  # noqa: E731
    made = run(sys.executable, "-m", "venv", "--without-pip", str(venv))  # this pip installs into it: no ensurepip
    assert made.returncode == 0, made.stderr[-2000:]
    pip = (sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"))
    installed = run(*pip, "install", "-q", str(src / "relay"))
    if installed.returncode != 0 and "Could not find a version that satisfies the requirement setuptools" in installed.stderr:
        pytest.skip("no package index reachable for the build's setuptools")
    assert installed.returncode == 0, installed.stderr[-3000:]
    packages = json.loads(run(*pip, "list", "--format=json").stdout)
    assert {p["name"] for p in packages} == {"tandem-relay"}, packages
    assert run(str(venv / "bin" / "python"), "-c", "import torch").returncode != 0
    where = run(str(venv / "bin" / "python"), "-c", "import netbridge.relay; print(netbridge.relay.__file__)")
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    helped = run(str(venv / "bin" / "tandem-relay"), "--help")
    assert helped.returncode == 0 and "--secret-file" in helped.stdout, helped.stderr[-2000:]
    command = ["env", "-u", "PYTHONPATH", str(venv / "bin" / "tandem-relay")]
    with relay_process(tmp_path, command=command) as relay:
        c0, c1 = pair(relay, "installed")
        try:
            exchange(c0, c1)
        finally:
            c0.close()
            c1.close()
        rendezvous(relay.addr, tmp_path, "installed-rdzv", monkeypatch)
        print(f"\ntandem-relay from its own venv: paired, forwarded and a rendezvous, peak RSS {relay.rss_mb():.1f} MB")


# ---- torchrun's rendezvous through a relay without torch ----------------------------------------------------------
PROMPT = [11, 42, 7, 250, 3, 99, 180, 5]
NEW_TOKENS = 12


def torchrun_node(relay_addr: str, rank: int, model: Path, out: Path, secrets_dir: Path, session: str) -> subprocess.Popen:
    """One node's torchrun on loopback, meeting the other at the relay for the rendezvous and the data."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=tandem-relay",
           f"--rdzv_endpoint={relay_addr}", f"--rdzv_id={session}", f"--rdzv_conf=node_rank={rank},join_timeout=60",
           "--max_restarts=0", str(REPO / "train_free_infer.py"), f"model.target={model}", "model.dtype=float32",
           "draft.kind=none", f"prompt_ids={ids_arg(PROMPT)}", "chat=false", f"gen.max_new_tokens={NEW_TOKENS}",
           f"output.json={out}", "output.stream=false", "transport.kind=relay", "transport.timeout_s=60"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false",
               TANDEM_RELAY_TOKEN_FILE=str(secrets_dir / "token"), TANDEM_SECRET_FILE=str(secrets_dir / "pairing"))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)


@pytest.mark.slow  # two torchruns and a tiny model: about 15-30 s
def test_torchrun_meets_through_a_relay_that_cannot_import_torch_and_matches_generate(tiny_qwen, tmp_path):
    """The whole run through the relay: torchrun's rendezvous (its store on node 0's agent, reached through the
    relay) and the ranks' data; the tokens equal single-process transformers generate() in fp32."""
    expected = reference_greedy(tiny_qwen, PROMPT, NEW_TOKENS)
    secrets_dir = tmp_path / "node-secrets"
    secrets_dir.mkdir()
    for name, value in (("token", TOKEN), ("pairing", PAIRING)):
        (secrets_dir / name).write_bytes(value)
        (secrets_dir / name).chmod(0o600)
    out = tmp_path / "out.json"
    with start_relay_without_torch(tmp_path) as relay:
        procs = [torchrun_node(relay.addr, rank, tiny_qwen, out, secrets_dir, "no-torch-run") for rank in (1, 0)]
        try:
            results = [p.communicate(timeout=240) for p in procs]
        finally:
            for p in procs:
                kill_launch(p)
        for p, (_, err) in zip(procs, results):
            assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{err[-4000:]}\nrelay log:\n{relay.log()[-2000:]}"
        assert json.loads(out.read_text())["token_ids"] == expected
        assert relay.alive() and blocked_imports(relay.log()) == [], relay.log()[-2000:]
        assert "rendezvous of 2 nodes complete" in relay.log()
        print(f"\ntorchrun through a relay without torch: {NEW_TOKENS} tokens equal generate(); relay peak RSS "
              f"{relay.rss_mb():.1f} MB")
