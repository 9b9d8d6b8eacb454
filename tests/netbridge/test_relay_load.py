"""50 sessions at once through one relay: all correct, bounded
in time and count; the relay's peak RSS is printed."""
from __future__ import annotations

import threading
import time

import torch

from tests.support.relay_harness import pair, relay_process

SESSIONS, ROUNDS = 50, 20


def test_fifty_concurrent_sessions(tmp_path):  # one relay: it never hosts a store (nor imports torch) since issue 43
    with relay_process(tmp_path, "--log-level", "warning") as relay:
        idle_rss = relay.rss_mb("VmRSS")
        errors: list[str] = []
        done = [0] * SESSIONS
        channels = []
        all_paired = threading.Barrier(SESSIONS, timeout=60)  # all 50 sessions open at the relay at once
        t0 = time.monotonic()

        def session(i: int) -> None:
            try:
                c0, c1 = pair(relay, f"load-{i}", timeout_s=60)
                channels.extend([c0, c1])
                all_paired.wait()
                echo = threading.Thread(target=_echo, args=(c1, i), daemon=True)
                echo.start()
                gen = torch.Generator().manual_seed(i)
                for r in range(ROUNDS):
                    x = torch.randn(256 if r % 5 else 65536, generator=gen)  # mostly small, some 256 KB
                    c0.send("ask", {"session": i, "round": r}, x=x)
                    reply = c0.recv("answer")
                    assert reply.meta == {"session": i, "round": r} and torch.equal(reply.tensors["x"], x + i), f"session {i} round {r}"
                    done[i] += 1
                c0.send("bye")
                echo.join(30)
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(f"session {i}: {e!r}")

        threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(SESSIONS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(1.0, 120 - (time.monotonic() - t0)))
        elapsed = time.monotonic() - t0
        for c in channels:
            c.close()
        peak = relay.rss_mb()
        print(f"\nload: {SESSIONS} sessions x {ROUNDS} "
              f"round trips in {elapsed:.1f} s; relay RSS idle {idle_rss:.1f} MB, peak {peak:.1f} MB")
        assert not errors, errors[:5]
        assert done == [ROUNDS] * SESSIONS
        assert relay.alive()
        assert peak < 1024, "the relay must fit a 1 GB host"


def _echo(c, i: int) -> None:
    while True:
        m = c.recv(("ask", "bye"))
        if m.kind == "bye":
            return
        c.send("answer", m.meta, x=m.tensors["x"] + i)
