"""The lockout scenario of issue 12 at full size: can idle, unauthenticated sockets keep honest pairs out?

    .venv/bin/python bench/relay_flood.py [--idle 500] [--burst 130] [--period-s 3] [--tries 10] [--within-s 5]
                                          [--scenario one-source|many-sources|shared-address|all] [--relay-repo PATH]

A `tandem-relay` subprocess with its default limits (--no-store unless --store) gets `--idle` idle
connections (connect, then never send or read) plus a flood thread that every `--period-s` closes its
`--burst` oldest sockets and opens as many new ones. Meanwhile `--tries` honest sessions, one a second,
each pair two RelayChannels (rank 1 from a thread) and close them. Printed per scenario: how many paired
within `--within-s`, each pairing time, the relay's RSS (VmRSS before, VmHWM = peak, VmRSS at the end,
read from /proc/<relay pid>/status) and the relay's own counts (accepted, shed, turned away).

Scenarios (the flood's source addresses; honest clients always dial from 127.0.0.1):
  one-source      all flood sockets from 127.0.0.2: --max-pending-per-source turns most away
  many-sources    spread over 127.0.0.2-127.0.0.65 (8 each, under the per-source bound): the full
                  handshake table sheds its oldest entries
  shared-address  the flood from 127.0.0.1 too, the honest clients' own address (a flooder behind the
                  same NAT): the per-source bound is then shared with the flooder
`--relay-repo PATH` runs the relay from another checkout (e.g. the previous commit, for a before/after).
Loopback only; everything stops by itself.
"""
from __future__ import annotations

import argparse
import re
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from netbridge.relay_channel import RelayChannel  # noqa: E402

SECRET = b"flood-bench-" + secrets.token_hex(8).encode()  # the relay's token
PAIRING = b"flood-bench-pairing-" + secrets.token_hex(8).encode()  # the nodes' pairing secret
SCENARIO_SOURCES = {
    "one-source": ["127.0.0.2"],
    "many-sources": [f"127.0.0.{i}" for i in range(2, 66)],
    "shared-address": ["127.0.0.1"],
}


# ---- the relay under test ------------------------------------------------------------------------
class Relay:
    def __init__(self, repo: Path, workdir: Path, store: bool):
        secret_file = workdir / "secret"
        secret_file.write_bytes(SECRET + b"\n")
        self.log_path = workdir / f"relay-{secrets.token_hex(3)}.log"
        cmd = [sys.executable, "-m", "netbridge.relay", "--host", "127.0.0.1", "--port", "0", "--secret-file", str(secret_file),
               "--log-level", "info", *(() if store else ("--no-store",))]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on \S+:(\d+)", line)
        if not m:
            self.proc.kill()
            sys.exit(f"relay did not start: {line!r}\n{self.log_path.read_text()[-2000:]}")
        self.port = int(m.group(1))
        self.addr = f"127.0.0.1:{self.port}"

    def memory_mb(self, field: str) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> str:
        """SIGTERM; returns the relay's closing summary line (its counts), if it printed one."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        summary = [line for line in self.log_path.read_text().splitlines() if "stopping:" in line]
        return summary[-1].split("INFO ", 1)[-1] if summary else "(no summary line)"


# ---- the flood -----------------------------------------------------------------------------------
def open_idle(port: int, source: str) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0))
    except OSError:
        return None  # a refused or slow connect is part of a flood too


class Flood:
    """`idle` sockets opened once, then every `period_s` the `burst` oldest closed and as many opened."""

    def __init__(self, port: int, sources: list[str], idle: int, burst: int, period_s: float):
        self.port, self.sources, self.burst, self.period_s = port, sources, burst, period_s
        self.held: deque = deque()
        self.opened = 0
        self.stop_event = threading.Event()
        for _ in range(idle):
            self._open_one()
        self.thread = threading.Thread(target=self._reopen, name="flood", daemon=True)
        self.thread.start()

    def _open_one(self) -> None:
        s = open_idle(self.port, self.sources[self.opened % len(self.sources)])
        self.opened += 1
        if s is not None:
            self.held.append(s)

    def _reopen(self) -> None:
        while not self.stop_event.wait(self.period_s):
            for _ in range(min(self.burst, len(self.held))):
                self.held.popleft().close()
            for _ in range(self.burst):
                self._open_one()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)
        while self.held:
            self.held.popleft().close()


# ---- honest clients ------------------------------------------------------------------------------
def timed_pair(addr: str, session: str, within_s: float) -> tuple[float | None, str]:
    """(seconds to pair both ranks, "") or (None, the error)."""
    box: dict = {}

    def rank1() -> None:
        try:
            box["c1"] = RelayChannel.connect(addr, session, 1, SECRET, PAIRING, timeout_s=within_s)
        except Exception as e:  # noqa: BLE001 - reported in the output
            box["e1"] = e
    t0 = time.monotonic()
    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    try:
        c0 = RelayChannel.connect(addr, session, 0, SECRET, PAIRING, timeout_s=within_s)
    except Exception as e:  # noqa: BLE001
        t.join(within_s + 1)
        if "c1" in box:
            box["c1"].close()
        return None, f"rank 0: {e}"
    t.join(within_s + 1)
    elapsed = time.monotonic() - t0
    c0.close()
    if "c1" not in box:
        return None, f"rank 1: {box.get('e1', 'no answer')}"
    box["c1"].close()
    return elapsed, ""


def run_scenario(name: str, a, workdir: Path) -> None:
    relay = Relay(Path(a.relay_repo).resolve(), workdir, a.store)
    before = relay.memory_mb("VmRSS")
    t0 = time.monotonic()
    flood = Flood(relay.port, SCENARIO_SOURCES[name], a.idle, a.burst, a.period_s)
    setup_s = time.monotonic() - t0
    results = []
    try:
        for i in range(a.tries):
            time.sleep(a.spacing_s)
            results.append(timed_pair(relay.addr, f"honest-{name}-{i}", a.within_s))
        end_rss = relay.memory_mb("VmRSS")
        peak = relay.memory_mb("VmHWM")
    finally:
        flood.stop()
        summary = relay.stop()
    ok = [t for t, _ in results if t is not None and t <= a.within_s]
    times = " ".join("fail" if t is None else f"{t:.3f}" for t, _ in results)
    print(f"\n== {name}: flood from {len(SCENARIO_SOURCES[name])} address(es), {a.idle} idle + {a.burst} re-opened every "
          f"{a.period_s:g} s ({flood.opened} flood connections in all, the first {a.idle} in {setup_s:.1f} s)")
    print(f"   honest pairs within {a.within_s:g} s: {len(ok)}/{a.tries}")
    print(f"   pairing times (s): {times}")
    errors = sorted({e for _, e in results if e})
    for e in errors[:3]:
        print(f"   error: {e}")
    print(f"   relay RSS: {before:.1f} MB before the flood, peak (VmHWM) {peak:.1f} MB, at the end {end_rss:.1f} MB")
    print(f"   relay: {summary}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--idle", type=int, default=500, help="idle connections opened before the honest tries (500)")
    p.add_argument("--burst", type=int, default=130, help="connections the flood re-opens every period (130)")
    p.add_argument("--period-s", type=float, default=3.0, help="the flood's period (3 s)")
    p.add_argument("--tries", type=int, default=10, help="honest pairings (10)")
    p.add_argument("--within-s", type=float, default=5.0, help="an honest pairing counts when done within this (5 s)")
    p.add_argument("--spacing-s", type=float, default=1.0, help="pause before each honest try (1 s)")
    p.add_argument("--scenario", default="all", choices=(*SCENARIO_SOURCES, "all"))
    p.add_argument("--relay-repo", default=str(REPO), help="checkout to run `python -m netbridge.relay` from (this one)")
    p.add_argument("--store", action="store_true", help="relay with its rendezvous store (imports torch: ~200 MB more RSS)")
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = a.idle + 2 * a.burst + 256
    if soft < needed:  # one descriptor per flood socket, and the default soft limit is often 1024
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    print(f"relay from {a.relay_repo}; default limits ({'with store' if a.store else '--no-store'}); loopback; "
          f"{a.tries} honest pairings, one every ~{a.spacing_s:g} s")
    with tempfile.TemporaryDirectory(prefix="relay-flood-") as tmp:
        for name in (SCENARIO_SOURCES if a.scenario == "all" else [a.scenario]):
            run_scenario(name, a, Path(tmp))


if __name__ == "__main__":
    main()
