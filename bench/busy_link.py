"""A frame's round trip between two ranks of one host that compute between frames: gloo against the direct link.

    .venv/bin/python -m bench.busy_link [--rounds 500] [--busy-ms 0 1 3]

Two processes (torchrun, one host) play a round: rank 0 sends a small frame and computes `busy` ms before it
waits for the answer; rank 1 receives, computes `busy` ms, answers. The ideal round trip is busy + the link's
own (the frame crosses while rank 0 computes). Links: `gloo` (netbridge.channel.GlooChannel: a sender thread
that needs its process's GIL, two rendezvous with the peer per frame), `direct` (netbridge.loopback_channel: a
loopback TCP socket, the kernel's send). Busy = small torch matmuls in a loop, as a rank's forward and engine do.
Prints p10 / p50 / p90 of the round trip per link and busy time (issue 45: why transport.local_links=auto links
the ranks of one host directly).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def compute(ms: float, w: torch.Tensor, x: torch.Tensor) -> None:
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1000 < ms:
        (x @ w).relu_().sum()


def open_link(kind: str, rank: int):
    import torch.distributed as dist
    from netbridge.channel import GlooChannel
    from netbridge.loopback_channel import LoopbackChannel, LoopbackListener
    if kind == "gloo":
        return GlooChannel(1 - rank, 30.0)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        listener = LoopbackListener()
        store.set("busy-link", f"{listener.port} {listener.token.hex()}")
        return listener.accept(30.0)
    store.wait(["busy-link"])
    port, token = store.get("busy-link").decode().split()
    return LoopbackChannel.connect(int(port), bytes.fromhex(token), 30.0)


def worker(kind: str, rounds: int, busy_ms: float) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    link = open_link(kind, rank)
    w, x, hidden = torch.randn(64, 64), torch.randn(4, 64), torch.randn(1, 5, 64)
    trips = []
    for i in range(rounds + 20):  # the first 20: warm-up
        t0 = time.perf_counter()
        if rank == 0:
            link.send("round", {"i": i}, hidden=hidden)
            compute(busy_ms, w, x)
            link.recv("reply")
        else:
            link.recv("round")
            compute(busy_ms, w, x)
            link.send("reply", {"i": i}, hidden=hidden)
        trips.append((time.perf_counter() - t0) * 1000)
    if rank == 0:
        trips = sorted(trips[20:])
        p = lambda q: trips[min(len(trips) - 1, int(q * len(trips)))]  # noqa: E731
        print(f"| {kind} | {busy_ms:g} | {p(0.1):.2f} | {p(0.5):.2f} | {p(0.9):.2f} |", flush=True)
    link.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "BUSY_MS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        torch.set_num_threads(1)
        return worker(a.worker[0], a.rounds, float(a.worker[1]))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {a.rounds} round trips each")
    print("| link | busy ms each side | p10 ms | p50 ms | p90 ms |\n|---|---|---|---|---|", flush=True)
    from bench.ports import free_port
    for busy in a.busy_ms:
        for kind in ("gloo", "direct"):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                            f"--master_port={free_port()}", str(Path(__file__).resolve()), "--worker", kind, str(busy),
                            "--rounds", str(a.rounds)], cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
