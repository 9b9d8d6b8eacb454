"""Several "hosts" on this machine: one torchrun per host, each with --nnodes=H --nproc_per_node=P, meeting through the
tandem-relay rendezvous (a relay subprocess, tests/support/relay_harness.py) or torchrun's stock c10d one. Used by
tests/e2e/test_host_links.py and bench/host_links.py."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.relay_harness import PAIRING, TOKEN
from tests.support.tiny_models import REPO, free_port, kill_launch


def host_command(node: int, hosts: int, per_host: int, rendezvous: list[str], *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts}", f"--nproc_per_node={per_host}",
            *rendezvous, "--max_restarts=0", str(REPO / "train_free_infer.py"), *args]


def start_hosts(tmp: Path, hosts: int, per_host: int, args: list[str], relay=None, run_id: str = "hosts",
                env: dict | None = None) -> dict[int, subprocess.Popen]:
    """One torchrun per host, the last node rank first; through `relay` (a RelayProcess: the tandem-relay
    rendezvous, node ranks pinned) or, without one, torchrun's c10d rendezvous on a free port (node ranks in the
    order the agents come). Each in a session of its own (kill_launch)."""
    token, pairing = tmp / "relay-token", tmp / "pairing"
    token.write_bytes(TOKEN)
    pairing.write_bytes(PAIRING)
    base = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                TANDEM_RELAY_TOKEN_FILE=str(token), TANDEM_SECRET_FILE=str(pairing), **(env or {}))
    base.pop("TANDEM_NODE_RANK", None)
    port = free_port()
    procs = {}
    for node in reversed(range(hosts)):
        if relay is not None:
            rendezvous = ["--rdzv_backend=tandem-relay", f"--rdzv_endpoint={relay.addr}", f"--rdzv_id={run_id}",
                          f"--rdzv_conf=node_rank={node},join_timeout=90"]
        else:
            rendezvous = ["--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={run_id}"]
        procs[node] = subprocess.Popen(host_command(node, hosts, per_host, rendezvous, *args), env=base, cwd=REPO,
                                       text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    return dict(sorted(procs.items()))


def finish(procs: dict[int, subprocess.Popen], timeout_s: float) -> dict[int, tuple[str, str]]:
    """Each host's (stdout, stderr) once it ends; every host is killed, with its ranks, past `timeout_s`."""
    out = {}
    try:
        for node, p in procs.items():
            out[node] = p.communicate(timeout=timeout_s)
    finally:
        kill_all(procs)
    return out


def kill_all(procs: dict[int, subprocess.Popen]) -> None:
    for p in procs.values():
        kill_launch(p)


def paired_ring_links(relay_log: str, run_id: str) -> list[str]:
    """The ring links the relay carried for `run_id` (its own log: one "ranks paired" line per session pairing), as
    `run_id/ringN`: under the tandem-relay rendezvous a link's session also names the rendezvous round
    (`run_id/<round>/ringN`, launch.transport), which this leaves out."""
    return [f"{run_id}/{ring}" for ring in
            re.findall(rf"session {re.escape(run_id)}/(?:[0-9a-f]{{8}}/)?(ring\d+): ranks paired", relay_log)]
