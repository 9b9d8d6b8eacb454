"""How much this host's pace moves by itself: one forward, the same call again and again in one process, its time
per window (cost_model.PaceTally: why a start-up timing is not the pace a rank runs at in service).

    python -m bench.host_pace                 # the tiny model's last rank over two ranks (7 of its 8 layers, the
                                              # norm and the head) over 2 rows of a K=4 block, 20 s
    python -m bench.host_pace --seconds 60 --context 2000

Each sample is the mean of 10 calls back to back (after one more, not timed), 10 ms apart; prints each of 10
windows' fastest, median and slowest sample, and over all of them the fastest, p10, median and p90. A start-up
timing is a few such samples at one moment. One thread; run it alone.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.cost_grid import tiny_model  # noqa: E402 - the repository root first
from model_parallel.loader import load_stage  # noqa: E402

CALLS, WINDOWS = 10, 10


def samples_ms(call, seconds: float) -> list[float]:
    out, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        call()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call()
        out.append((time.perf_counter() - t0) * 1000 / CALLS)
        time.sleep(0.01)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--context", type=int, default=0, help="cached tokens each row attends over")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--block", type=int, default=5, help="tokens a row (5: a K=4 round's)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    folder = tiny_model(Path(tempfile.mkdtemp()))
    stage = load_stage(folder, 1, 8, embed=False, head=True, dtype="float32")
    stage.allocate_cache(a.context + a.block + 16, torch.float32, slots=a.rows)
    x = torch.randn(a.rows, a.block, stage.config.hidden_size) * 0.1
    slots = list(range(a.rows))
    if a.context:  # the rows' caches filled once; each call writes its block after them
        stage.run_rows([0] * a.rows, torch.randn(a.rows, a.context, stage.config.hidden_size) * 0.1, slots,
                       [a.context] * a.rows, num_logits=None)
    ms = samples_ms(lambda: stage.run_rows([a.context] * a.rows, x, slots, [a.block] * a.rows, num_logits=a.block),
                    a.seconds)
    print(f"{platform.processor() or platform.machine()}, 1 thread; the tiny model's layers 1-7, norm and head over "
          f"{a.rows} rows of {a.block} tokens after {a.context} cached; {len(ms)} samples of {CALLS} calls, ms a call")
    n = max(len(ms) // WINDOWS, 1)
    for i in range(0, len(ms) - n + 1, n):
        w = ms[i:i + n]
        print(f"window {i // n}: fastest {min(w):.2f}, median {statistics.median(w):.2f}, slowest {max(w):.2f}")
    q = statistics.quantiles(ms, n=10)
    print(f"all: fastest {min(ms):.2f}, p10 {q[0]:.2f}, median {q[4]:.2f}, p90 {q[8]:.2f} "
          f"(median / fastest {statistics.median(ms) / min(ms):.2f})")


if __name__ == "__main__":
    main()
