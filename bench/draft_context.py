"""What a drafter step costs per cached token, timed three ways (the seventeenth session's measurement behind
model_parallel.split.steps_ms): a one-layer stage over the step's token after CONTEXT and after DECODE_CONTEXT cached
tokens timed in turn with each other (split.sample_ms), the same back to back five calls at a time (split.steps_ms,
as time_rank now times it), and real drafting steps (ModelDrafter.propose of 4 drafts after each context).

    python -m bench.draft_context --model tiny     # the 8-layer fp32 model bench.cost_grid runs
    python -m bench.draft_context --model pair     # the embedded 0.5B drafter, bf16 (fetched by the quick start)
    python -m bench.draft_context --model tiny --rows 4    # ... and a step over 4 rows, their slots in order or not,
                                                           # and real rounds over 4 rows (ModelDrafter.propose_rows)
    python -m bench.draft_context --model tiny --rows 4 --block 5   # ... the layer over 4 rows of a 5-token block

Prints ms more per 1,000 cached tokens for one layer, each way. With --rows N, also one layer's step (with --block
T: over a block of T tokens, a target's round) over N rows after the two contexts, back to back, the rows' slots
consecutive and in order (StaticKVCache.span: the cache read as a view), in reverse (gathered: a copy of every row's
live part) and one row alone; and the whole drafter's rounds of 4 drafts over N rows after each context
(propose_rows, as rank 0 drafts a batch), the same two orders, and over one row of them. One thread; run it alone."""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import model_parallel.split as split  # noqa: E402 - the repository root first
from model_parallel.loader import ModelSource, load_stage  # noqa: E402
from speculative.drafters import ModelDrafter  # noqa: E402

PAIR_DRAFTER = Path.home() / ".cache/tandem/models/qwen2.5-coder-0.5b-instruct"


def per_layer_1k(short_ms: float, long_ms: float, layers: int = 1) -> float:
    return (long_ms - short_ms) / (split.DECODE_CONTEXT - split.CONTEXT) * 1000 / layers


def real_step_ms(drafter: ModelDrafter, context: list[int], slot: int, tries: int) -> float:
    """The fastest mean step of 4 drafts after `context` (the drafts thrown away each time)."""
    best = float("inf")
    for _ in range(tries):
        drafter.commit(len(context), slot=slot)
        t0 = time.perf_counter()
        drafter.propose(context, 4, slot=slot)
        best = min(best, (time.perf_counter() - t0) * 1000 / 4)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "pair"], default="tiny")
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--block", type=int, default=1, help="with --rows: the block's tokens (5: a target's at K=4)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.model == "tiny":
        from bench.cost_grid import tiny_model
        folder, dtype_name = tiny_model(Path(tempfile.mkdtemp())), "float32"
    else:
        folder, dtype_name = PAIR_DRAFTER, "bfloat16"
    source = ModelSource.open(folder, dtype_name)
    dtype, layers = getattr(torch, dtype_name), source.config.num_hidden_layers
    runs = {c: split.stage_runs(source, 1, "cpu", dtype, context=c, sizes=(1,))[1]
            for c in (split.CONTEXT, split.DECODE_CONTEXT)}
    print(f"{platform.processor() or platform.machine()}, 1 thread; {a.model}: {layers} layers, {dtype_name}")
    split.MIN_SAMPLES = split.MAX_SAMPLES = 25
    turns = {c: min(ms) for c, ms in split.sample_ms(runs).items()}
    print(f"in turn with each other (25 cycles): {per_layer_1k(*turns.values()):.4f}")
    b2b = split.steps_ms(runs, 5, reps=a.tries)
    print(f"back to back, 5 calls (split.steps_ms): {per_layer_1k(*b2b.values()):.4f}")
    stage = load_stage(folder, 0, layers, embed=True, head=True, dtype=dtype_name)
    stage.allocate_cache(split.DECODE_CONTEXT + 16, dtype, setting="draft.max_len", slots=2)
    drafter = ModelDrafter(stage, max_k=8, top_k=16)
    rng = random.Random(0)
    vocab = source.config.vocab_size
    steps = []
    for slot, n in enumerate((split.CONTEXT, split.DECODE_CONTEXT)):
        context = [rng.randrange(vocab // 4, vocab // 2) for _ in range(n)]
        drafter.reset(0, 0.0, 1, slot=slot)
        drafter.catch_up(context[:-1], slot=slot)
        steps.append(real_step_ms(drafter, context, slot, a.tries))
    print(f"real steps ({steps[0]:.2f} ms a step after {split.CONTEXT}, {steps[1]:.2f} after {split.DECODE_CONTEXT}): "
          f"{per_layer_1k(*steps, layers):.4f}")
    if a.rows > 1:
        rows_step(folder, dtype_name, dtype, a.rows, a.tries, a.block)
        rows_rounds(folder, dtype_name, dtype, layers, a.rows, a.tries)


def rows_step(folder, dtype_name: str, dtype, rows: int, tries: int, block: int = 1) -> None:
    """One layer over `rows` rows of a `block`-token block (1: a drafter's step) after each context, its slots in
    order and reversed, and over one row, back to back."""
    layer = load_stage(folder, 0, 1, embed=False, head=False, dtype=dtype_name)
    layer.allocate_cache(split.DECODE_CONTEXT + block, dtype, slots=rows)
    hidden = torch.randn(rows, block, layer.config.hidden_size, dtype=dtype) * 0.1
    runs = {}
    orders = (("in order", list(range(rows))), ("reversed", list(range(rows))[::-1]), ("one row", [0]))
    for name, order in orders:
        for context in (split.CONTEXT, split.DECODE_CONTEXT):
            def step(order=order, context=context):
                for slot in order:
                    layer.cache.rewind(context, slot)
                layer(hidden[:len(order)], live=context + block, rows=order)
            runs[name, context] = step
    means = split.step_means_ms(runs, 5, reps=tries)
    for name, order in orders:
        short, long = min(means[name, split.CONTEXT]), min(means[name, split.DECODE_CONTEXT])
        print(f"{len(order)} rows of {block} token(s), slots {name}: {short:.3f} ms after {split.CONTEXT}, {long:.3f} "
              f"after {split.DECODE_CONTEXT}: {per_layer_1k(short, long) / len(order) / block:.4f} a row a token "
              f"(the fastest of {tries}, as split.steps_ms; their median: "
              f"{statistics.median(means[name, split.CONTEXT]):.3f} and "
              f"{statistics.median(means[name, split.DECODE_CONTEXT]):.3f})")


def rows_rounds(folder, dtype_name: str, dtype, layers: int, rows: int, tries: int) -> None:
    """The fastest round of 4 drafts over `rows` rows (ModelDrafter.propose_rows, the drafts thrown away each time)
    after each context, its slots in order and reversed, and over the first alone."""
    stage = load_stage(folder, 0, layers, embed=True, head=True, dtype=dtype_name)
    stage.allocate_cache(split.DECODE_CONTEXT + 16, dtype, setting="draft.max_len", slots=rows)
    drafter = ModelDrafter(stage, max_k=8, top_k=16)
    rng = random.Random(1)
    vocab = stage.config.vocab_size
    for context_len in (split.CONTEXT, split.DECODE_CONTEXT):
        contexts = [[rng.randrange(vocab // 4, vocab // 2) for _ in range(context_len)] for _ in range(rows)]
        for slot, context in enumerate(contexts):
            drafter.reset(0, 0.0, 1, slot=slot)
            drafter.catch_up(context[:-1], slot=slot)
        for name, order in (("in order", list(range(rows))), ("reversed", list(range(rows))[::-1]), ("one row", [0])):
            best = float("inf")
            for _ in range(tries):
                for slot in order:
                    drafter.commit(context_len, slot=slot)
                t0 = time.perf_counter()
                drafter.propose_rows([contexts[s] for s in order], [4] * len(order), order)
                best = min(best, (time.perf_counter() - t0) * 1000)
            print(f"a round of 4 drafts over {len(order)} rows after {context_len}, slots {name}: {best:.2f} ms")


if __name__ == "__main__":
    main()
