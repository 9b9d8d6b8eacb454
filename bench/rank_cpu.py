"""Where a served round's CPU goes: each rank's process CPU per round while clients decode, beside the cost model's
busy time for the same ranks (issue 45: the middle rank's own work, ENGINE_MIDDLE_MS).

    python -m bench.rank_cpu --ranks 3 --setting "K0 D1" --clients 1     # one stream: rounds in turn, one a token
    python -m bench.rank_cpu --ranks 3 --setting "K0 D1" --clients 4

Launches the tiny 8-layer model of bench.cost_grid (torchrun, one thread a rank, no delay), sends one warm-up
request, then `--clients` requests of `--tokens` tokens after prompts of ~`--prompt` tokens (40) at once, and reads
each rank's process CPU (/proc, every thread) and the host's busy share over them. Prints them per rank with the CPU per
round (K=0 and one client: a round a token) and the model's busy ms a round at one row from the start-up timing
(its start-up line), and how long each rank (and this process, the clients) was ready to run but waited for a
core (/proc's schedstat: more processes at work than cores). Linux only; run it alone."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.concurrent_bench import Served  # noqa: E402 - the repository root first
from bench.cost_grid import FIXED, SETTINGS, complete, model_overrides, prompt_texts, tiny_model, together  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p))
        except OSError:
            pass
    return out


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far, every thread (utime + stime)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def waited_s(pid: int) -> float:
    """Seconds the process's threads were ready to run but waited for a core (/proc's schedstat: the run queue)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[1])
        except OSError:  # a thread that ended meanwhile
            pass
    return total / 1e9


def host_busy() -> tuple[int, int]:
    ticks = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # less idle and iowait


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--setting", default="K0 D1", choices=list(SETTINGS))
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=40, help="each request's prompt, tokens")
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp())
    folder = tiny_model(root)
    overrides = [*FIXED, *SETTINGS[a.setting], *model_overrides("tiny", root),
                 f"gen.max_new_tokens={max(a.tokens, 32)}"]  # (its default, 256, refuses longer answers)
    log = root / "log"
    with Served(0, overrides, 600, log, nproc=a.ranks) as served:
        complete(served.url, "Say hello.", 32, 600)
        below = children(served.proc.pid)  # torchrun's agent is the launched process: the ranks are its children
        ranks = sorted(w for w in below + [g for c in below for g in children(c)]
                       if "train_free_infer" in open(f"/proc/{w}/cmdline").read())  # (in rank order: spawned so)
        prompts = prompt_texts(str(folder), a.prompt, a.clients, f"rank_cpu {a.clients}")
        watched = [*ranks, os.getpid()]  # ... and this process: the clients reading every token's event
        before, waits0, busy0, t0 = [cpu_s(w) for w in watched], [waited_s(w) for w in watched], host_busy(), \
            time.perf_counter()
        results = together(served.url, prompts, a.tokens, 600)
        wall, busy1 = time.perf_counter() - t0, host_busy()
        after, waits1 = [cpu_s(w) for w in watched], [waited_s(w) for w in watched]
    tokens = sum(r.get("tokens", 0) for r in results)
    print(f"{a.ranks} ranks, {a.setting}, {a.clients} client(s): {tokens} tokens in {wall:.2f} s "
          f"({tokens / wall:.0f} tokens/s); the host busy {(busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1):.0%} "
          f"of its {os.cpu_count()} cores")
    if not tokens:
        sys.exit(f"no tokens came back: {results[0].get('error', results[0])}")
    rounds = tokens / a.clients  # K=0: a round a token per stream (the prompts' prefill is in the figures too)
    for r, (b, e, w0, w1) in enumerate(zip(before, after, waits0, waits1)):
        name = f"rank {r}" if r < len(ranks) else "the clients (this process)"
        print(f"  {name}: {e - b:.2f} s CPU ({(e - b) / wall:.0%} of a core), {1000 * (e - b) / rounds:.2f} ms per "
              f"round of the {a.clients} stream(s); ready but waiting for a core {w1 - w0:.2f} s "
              f"({(w1 - w0) / wall:.0%} of the time)")
    for line in log.read_text(errors="replace").splitlines():
        if "estimated" in line or line.startswith("[predicted"):
            print("  " + line.strip("[]")[:400])


if __name__ == "__main__":
    main()
