"""What the relay adds: small-message round trips and 10 MB throughput, relay vs a direct socket, loopback.

    .venv/bin/python bench/relay_latency.py [--rounds 2000] [--store]

Both paths run the same code (RelayChannel over a LinkSocket: encode, link frame, heartbeats thread);
"direct" connects the two processes to each other, "relay" connects both to a `tandem-relay`
subprocess. So the difference is the relay hop: one more process, two more socket passes per direction.
A round trip = Channel.send of a 16-token int64 tensor and Channel.recv of the echo (decode included).
Throughput = a 10 MB fp32 tensor's frame (encoded once, beforehand) one way, answered by a tiny ack;
the small-message RTT is subtracted. Encoding/decoding that tensor (netbridge.frames, the same for
every transport) is timed and printed separately.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from netbridge.frames import Message, decode, encode  # noqa: E402
from netbridge.relay_channel import LinkSocket, RelayChannel  # noqa: E402

SECRET = b"bench-secret"  # the relay's token
PAIRING = b"bench-pairing-secret"  # the nodes' pairing secret
BULK = torch.randn(2_621_440)  # 10 MB (10,485,760 bytes) of fp32
BULK_FRAME = encode(Message("bulk", {}, {"x": BULK}))


def echo(mode: str, addr: str) -> None:
    if mode == "direct":
        host, port = addr.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = RelayChannel(LinkSocket(sock, addr, 60), 1, "direct", 60, secret=PAIRING)
    else:
        c = RelayChannel.connect(addr, "bench", 1, SECRET, PAIRING, timeout_s=60)
    while True:
        frame = c.recv_frame()
        if len(frame) > 1 << 20:  # the bulk frame: acknowledged without decoding
            c.send("ack", {"n": len(frame)})
            continue
        m = decode(frame)
        if m.kind == "stop":
            break
        c.send("pong", x=m.tensors["x"])
    c.close()


def measure(mode: str, addr_or_listener, rounds: int, bulk_reps: int) -> dict:
    if mode == "direct":
        listener = addr_or_listener
        addr = "127.0.0.1:%d" % listener.getsockname()[1]
    else:
        addr = addr_or_listener
    peer = subprocess.Popen([sys.executable, __file__, "--echo", mode, addr], cwd=REPO)
    if mode == "direct":
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = RelayChannel(LinkSocket(sock, addr, 60), 0, "direct", 60, secret=PAIRING)
    else:
        c = RelayChannel.connect(addr, "bench", 0, SECRET, PAIRING, timeout_s=60)
    x = torch.arange(16)
    rtts = []
    for i in range(rounds + 200):
        t0 = time.perf_counter()
        c.send("ping", x=x)
        c.recv("pong")
        if i >= 200:  # warm-up excluded
            rtts.append(time.perf_counter() - t0)
    rtt = statistics.median(rtts)
    bulk = []
    for _ in range(bulk_reps + 1):
        t0 = time.perf_counter()
        c.send_frame(BULK_FRAME)
        assert c.recv("ack").meta["n"] == len(BULK_FRAME)
        bulk.append(time.perf_counter() - t0)
    bulk_s = statistics.median(bulk[1:]) - rtt
    c.send("stop")
    peer.wait(30)
    c.close()
    return {"rtt_us": rtt * 1e6, "p90_us": statistics.quantiles(rtts, n=10)[-1] * 1e6, "bulk_s": bulk_s,
            "mb_s": len(BULK_FRAME) / bulk_s / 1e6, "rounds": rounds}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2000, help="small-message round trips per path (>= 1000)")
    p.add_argument("--bulk-reps", type=int, default=20)
    p.add_argument("--store", action="store_true", help="start the relay with its rendezvous store (torch) as deployed")
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"), help="the relay's event loop")
    p.add_argument("--echo", nargs=2, metavar=("MODE", "ADDR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.echo:
        return echo(*a.echo)
    torch.set_num_threads(1)
    print(f"hardware: {cpu_name()}, {os.cpu_count()} cores shared by client, echo and relay processes; "
          f"Python {platform.python_version()}, torch {torch.__version__}; loopback TCP")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    direct = measure("direct", listener, a.rounds, a.bulk_reps)
    listener.close()
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_bytes(SECRET)
        cmd = [sys.executable, "-m", "netbridge.relay", "--host", "127.0.0.1", "--port", "0", "--secret-file", str(secret_file),
               "--log-level", "warning", "--loop", a.loop, *(() if a.store else ("--no-store",))]
        relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO)
        ready = relay.stdout.readline()
        port = int(re.search(r":(\d+) ", ready).group(1))
        loop_name = "uvloop" if "uvloop" in ready else "asyncio"
        try:
            via = measure("relay", f"127.0.0.1:{port}", a.rounds, a.bulk_reps)
            rss = _rss(relay.pid)
        finally:
            relay.terminate()
            relay.wait(10)
    added = via["rtt_us"] - direct["rtt_us"]
    print(f"small-message round trip (median of {a.rounds}): direct {direct['rtt_us']:.0f} us (p90 {direct['p90_us']:.0f}), "
          f"relay {via['rtt_us']:.0f} us (p90 {via['p90_us']:.0f})")
    print(f"relay adds {added:.0f} us per round trip = {via['rtt_us'] / direct['rtt_us']:.2f}x direct")
    print(f"10 MB tensor one way (median of {a.bulk_reps}): direct {direct['bulk_s'] * 1e3:.1f} ms = {direct['mb_s']:.0f} MB/s, "
          f"relay {via['bulk_s'] * 1e3:.1f} ms = {via['mb_s']:.0f} MB/s ({via['mb_s'] / direct['mb_s']:.2f}x direct)")
    enc, dec = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        frame = encode(Message("bulk", {}, {"x": BULK}))
        enc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode(frame)
        dec.append(time.perf_counter() - t0)
    print(f"on top, for every transport: netbridge.frames encode {statistics.median(enc) * 1e3:.1f} ms, "
          f"decode {statistics.median(dec) * 1e3:.1f} ms for that tensor (median of 5)")
    print(f"relay peak RSS {rss:.1f} MB ({'with' if a.store else 'without'} the rendezvous store; event loop {loop_name})")


def _rss(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main()
