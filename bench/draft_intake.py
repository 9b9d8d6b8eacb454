"""What the embedded drafter (Qwen2.5-Coder-0.5B) costs to take a prompt in, per chunk size and weight format: one
layer's ms over a chunk of each size after 128 cached tokens, through a stage of three layers as the start-up's
timing runs it (model_parallel/split.py:chunk_runs, time_intake), one thread, bf16 activations; and beside it what
a line through one token and 128 says (what the cost model priced a chunk at before chunks were timed).

    .venv/bin/python -m bench.draft_intake [--formats none,int8,nf4] [--sizes 1,5,16,17,32,40,64,128,256,512]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_parallel import split  # noqa: E402 - the repository root first
from model_parallel.fetch_weights import model_dir  # noqa: E402
from model_parallel.loader import ModelSource  # noqa: E402
from model_parallel.quant import Int8Settings, NF4Settings  # noqa: E402

FORMATS = {"none": None, "int8": Int8Settings(lm_head=True), "nf4": NF4Settings()}


def layer_ms(model, sizes: list[int], quant, reps: int = 5) -> dict[int, float]:
    """One layer's ms over a chunk of each size: the median of `reps` calls of a three-layer stage, over three."""
    runs = split.chunk_runs(model, [(n, split.CONTEXT) for n in sizes], "cpu", torch.bfloat16, quant)
    out = {}
    for (n, _), run in runs.items():
        run()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1000)
        out[n] = statistics.median(times) / split.STAGE_SIZES[-1]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="none,int8,nf4")
    ap.add_argument("--sizes", default="1,5,16,17,32,40,64,128,256,512")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = sorted({1, 128, *map(int, a.sizes.split(","))})
    model = ModelSource.open(str(model_dir("qwen-coder-0.5b")), "bfloat16")
    print(f"{platform.processor() or platform.machine()}; one drafter layer, ms over a chunk after {split.CONTEXT} "
          f"cached tokens (line: through 1 and 128 tokens)\n| format | " + " | ".join(map(str, sizes)) + " |\n|"
          + "---|" * (len(sizes) + 1))
    for name in a.formats.split(","):
        ms = layer_ms(model, sizes, FORMATS[name])
        slope = (ms[128] - ms[1]) / 127
        print(f"| {name} | " + " | ".join(f"{ms[n]:.2f} ({ms[1] + slope * (n - 1):.2f})" for n in sizes) + " |",
              flush=True)


if __name__ == "__main__":
    main()
