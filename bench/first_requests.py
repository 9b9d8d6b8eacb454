"""A launch's first requests against its later ones: one served launch of the embedded pair, prompts sent one after
another (each new: no prefix of another's), each request's TTFT beside the cost model's prediction, and each rank's
minor page faults and system time over it (read from /proc: Linux only).

    python -m bench.first_requests                                 # K=0 over two ranks: 40, 2000, 2000, 2000, 40, 2000 tokens
    python -m bench.first_requests --overrides spec.k=4 --prompts 2000 2000

Why: a launch's first long prompt ran 15-35% over its prediction while the later ones fell within 15% (issue 45).
Since 567009e the server warms every rank's caches before its first request (Session.warm_up). Run it alone.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.concurrent_bench import Served  # noqa: E402 - the repository root first
from bench.cost_grid import FIXED, complete, prompt_texts  # noqa: E402


def rank_counters() -> dict[int, tuple[int, int]]:
    """Every rank process's (minor page faults, system time in clock ticks), its threads' together, by pid (rank 0
    is started first: the lowest)."""
    counters = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if b"train_free_infer" not in cmdline or b"torchrun" in cmdline or b"distributed.run" in cmdline:  # not the agent
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        counters[int(proc.name)] = (int(fields[7]), int(fields[12]))
    return counters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prompts", nargs="+", type=int, default=[40, 2000, 2000, 2000, 40, 2000])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--overrides", nargs="*", default=["spec.k=0", "spec.in_flight=1"])
    ap.add_argument("--out", default=None, help="a folder for the launch's log (default: a temporary one)")
    a = ap.parse_args()
    out = Path(a.out or f"/tmp/first_requests-{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    with Served(0, [*FIXED, *a.overrides], 600, out / "launch.log", nproc=a.ranks) as served:
        complete(served.url, "Say hello.", 32, 600)  # the cost grid's warm-up request
        print("| request | prompt tokens | TTFT ms | predicted ms | err | page faults by rank | system s by rank |")
        print("|---|---|---|---|---|---|---|")
        for i, n in enumerate(a.prompts):
            prompt = prompt_texts(None, n, 1, f"first requests {i} x {n}")[0]
            before = rank_counters()
            r = complete(served.url, prompt, a.max_tokens, 600)
            after = rank_counters()
            if "error" in r:
                print(f"| {i + 1} | {n} | {r['error']} | | | | |")
                continue
            faults = " / ".join(str(after[p][0] - before[p][0]) for p in sorted(after) if p in before)
            system = " / ".join(f"{(after[p][1] - before[p][1]) / 100:.2f}" for p in sorted(after) if p in before)
            err = r["predicted_ttft_ms"] / r["ttft_ms"] - 1
            print(f"| {i + 1} | {r['prompt_tokens']} | {r['ttft_ms']:.0f} | {r['predicted_ttft_ms']:.0f} | {err:+.0%} "
                  f"| {faults} | {system} |", flush=True)


if __name__ == "__main__":
    main()
