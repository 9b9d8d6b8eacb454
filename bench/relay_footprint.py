"""The relay's memory while it pairs nodes and forwards: peak RSS (VmHWM) of a `tandem-relay` subprocess.

    .venv/bin/python bench/relay_footprint.py [--relay CMD] [--relay-repo PATH] [--sessions 4] [--mb 64]

The relay is started by `--relay` (a command line, e.g. `/tmp/relayvenv/bin/tandem-relay`, the relay installed alone
with `pip install ./relay`; run without PYTHONPATH so it imports its own copy) or, by default, as
`python -m netbridge.relay` from `--relay-repo` (this checkout; another one, e.g. `git archive` of an older commit,
for a before/after). `--sessions` pairs of RelayChannels (this process, the nodes' side) pair through it one after
another, each forwarding `--mb` MB in 4 MB tensors, rank 0 to rank 1, and a small reply. Printed: the relay's VmRSS
once it listens, its VmHWM (peak) at the end, and the bytes forwarded. Loopback only.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from netbridge.relay_channel import RelayChannel  # noqa: E402

TOKEN = b"footprint-token-" + secrets.token_hex(8).encode()
PAIRING = b"footprint-pairing-" + secrets.token_hex(8).encode()


def status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def start_relay(args, workdir: Path) -> tuple[subprocess.Popen, str]:
    secret_file = workdir / "token"
    secret_file.write_bytes(TOKEN + b"\n")
    secret_file.chmod(0o600)
    flags = ["--host", "127.0.0.1", "--port", "0", "--secret-file", str(secret_file)]
    if args.relay:
        cmd = [*shlex.split(args.relay), *flags]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed relay's own modules
    else:
        cmd = [sys.executable, "-m", "netbridge.relay", *flags]
        env = dict(os.environ, PYTHONPATH=str(args.relay_repo))
    log = open(workdir / "relay.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=args.relay_repo or workdir)
    line = proc.stdout.readline()  # "tandem-relay listening on 127.0.0.1:PORT (...)"; the relay prints it once ready
    m = re.search(r"listening on (\S+:\d+)", line)
    if not m:
        proc.kill()
        sys.exit(f"the relay did not start: {line!r}\n{(workdir / 'relay.log').read_text()[-2000:]}")
    return proc, m.group(1)


def pair(addr: str, session: str) -> tuple[RelayChannel, RelayChannel]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("c1", RelayChannel.connect(addr, session, 1, TOKEN, PAIRING, timeout_s=30)))
    t.start()
    c0 = RelayChannel.connect(addr, session, 0, TOKEN, PAIRING, timeout_s=30)
    t.join(30)
    return c0, box["c1"]


def forward(c0: RelayChannel, c1: RelayChannel, mb: int) -> None:
    chunk = torch.randn(1_048_576)  # 4 MB of fp32
    for i in range(max(1, mb // 4)):
        t = threading.Thread(target=lambda: c1.recv("x"))
        t.start()
        c0.send("x", {"i": i}, x=chunk)
        t.join(60)
    c1.send("y", h=chunk[:4])
    c0.recv("y")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--relay", default=None, help="command line that starts the relay (its flags are appended)")
    p.add_argument("--relay-repo", type=Path, default=REPO, help="checkout whose netbridge.relay runs (without --relay)")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--mb", type=int, default=64, help="MB forwarded per session")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = start_relay(args, Path(tmp))
        try:
            at_start = status_mb(proc.pid, "VmRSS")
            t0 = time.perf_counter()
            for s in range(args.sessions):
                c0, c1 = pair(addr, f"footprint-{s}")
                try:
                    forward(c0, c1, args.mb)
                finally:
                    c0.close()
                    c1.close()
            elapsed = time.perf_counter() - t0
            peak = status_mb(proc.pid, "VmHWM")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
    print(f"relay {args.relay or f'python -m netbridge.relay from {args.relay_repo}'}: VmRSS {at_start:.1f} MB when "
          f"listening, peak (VmHWM) {peak:.1f} MB after {args.sessions} pairings forwarding {args.sessions * args.mb} MB "
          f"in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
