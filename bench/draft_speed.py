"""Draft cost per round for K = 1, 4, 8: the embedded drafter (Qwen2.5-Coder-0.5B) on this machine; then
drafting for several requests at once (serve.max_concurrent): K=4 for B = 1, 2, 4, 8 rows in one batched step
(propose_rows) against B separate proposes, ms per row.

    python bench/draft_speed.py [--device cpu|cuda:0] [--dtype bfloat16] [--graph auto|on|off] [--rounds 20]
                                [--rows 1,2,4,8] [--rows-k 4] [--threads N]

A round is what rank 0's drafter does per round trip: feed the last committed token, then K
single-token steps over the static cache, then rewind to the committed length.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "Write a Python function that reverses a string, with a docstring and three doctests."


def ms_per_round(drafter, k: int, rounds: int, context: list[int]) -> float:
    """Mean wall ms of propose(K) + commit over `rounds` rounds from the same committed context."""
    drafter.commit(1)
    drafter.propose(context, k)  # prefill and warm-up
    sync = torch.cuda.synchronize if drafter.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(rounds):
        drafter.commit(len(context))
        drafter.propose(context, k)
    sync()
    return (time.perf_counter() - t0) * 1000 / rounds


def rows_ms_per_row(drafter, k: int, rounds: int, contexts: list[list[int]], batched: bool, lacking: int = 0) -> float:
    """Mean wall ms per row of one round for every row (slot b drafting contexts[b]): one propose_rows over all
    of them (batched) or one propose per row, after the commits. `lacking` = 1: every slot lacks a token first (as
    after a fully accepted round: its last draft), which it takes in before drafting."""
    slots = list(range(len(contexts)))
    sync = torch.cuda.synchronize if drafter.device.type == "cuda" else (lambda: None)

    def one_round() -> None:
        for slot, context in zip(slots, contexts):
            drafter.commit(len(context) - lacking, slot=slot)
        if batched:
            drafter.propose_rows(contexts, [k] * len(contexts), slots)
        else:
            for slot, context in zip(slots, contexts):
                drafter.propose(context, k, slot=slot)

    one_round()  # prefill and warm-up (and, with a graph, its capture for this batch size)
    sync()
    t0 = time.perf_counter()
    for _ in range(rounds):
        one_round()
    sync()
    return (time.perf_counter() - t0) * 1000 / rounds / len(contexts)


def make_drafter(folder: str, device: str, dtype: str, graph: str, temperature: float = 0.0, seed: int = 0,
                 max_len: int = 1024, max_k: int = 8, slots: int = 1):
    """A drafter built by the entry's own code (launch.build) with `slots` KV slots, every slot set up for a request."""
    from dataclasses import replace

    from launch.build import model_drafter
    from launch.config import load_config
    from launch.plan import plan_here
    cfg = load_config([f"draft.model={folder}", f"draft.device={device}", f"draft.dtype={dtype}", f"draft.graph={graph}",
                       f"draft.max_len={max_len}", f"spec.k={max_k}", "prompt_ids=[1]", "model.split=null"])
    drafter = model_drafter(replace(plan_here(cfg, 0), slots=slots))  # a served launch settles the slots
    for slot in range(slots):
        drafter.reset(0, temperature, seed + slot, slot=slot)
    return drafter


def main() -> None:
    from model_parallel.fetch_weights import model_dir
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="drafter folder (default: the fetched Qwen2.5-Coder-0.5B)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--graph", default="auto")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--rows", default="1,2,4,8", help="batch sizes of the several-requests table ('' skips it)")
    ap.add_argument("--rows-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (a rank under torchrun beside another "
                                                                 "on this host has 1); default: torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model or str(model_dir("qwen-coder-0.5b"))
    tok = AutoTokenizer.from_pretrained(folder)
    context = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    drafter = make_drafter(folder, args.device, args.dtype, args.graph)
    graph = drafter.step.use_graph
    print(f"drafter {Path(folder).name}, {args.dtype}, {args.device}, CUDA graph {'on' if graph else 'off'}, "
          f"torch threads {torch.get_num_threads()}, prompt {len(context)} tokens, {args.rounds} rounds each\n")
    print("| K | draft ms / round | ms / step |\n|---|---|---|")
    for k in (1, 4, 8):
        ms = ms_per_round(drafter, k, args.rounds, context)
        print(f"| {k} | {ms:.1f} | {ms / k:.1f} |")
    if args.rows:
        rows_table(folder, args, [int(b) for b in args.rows.split(",")], context, tok)


def rows_table(folder: str, args, batches: list[int], context: list[int], tok) -> None:
    """K=rows_k for B requests at once: one batched step per position (propose_rows) vs B proposes, ms per row, with
    every slot up to date and lacking one token (a fully accepted round). Each row's context is the prompt with a
    different tail, so the rows sit at different lengths."""
    drafter = make_drafter(folder, args.device, args.dtype, args.graph, slots=max(batches))
    contexts = [context + tok.encode(" x" * (3 * b)) for b in range(max(batches))]
    print(f"\n{max(batches)} slots, K={args.rows_k}, contexts {len(contexts[0])}-{len(contexts[-1])} tokens\n")
    print("| rows B | slot lacks | batched ms / row | separate ms / row | separate / batched |\n|---|---|---|---|---|")
    for b in batches:
        for lacking in (0, 1):
            ms = [rows_ms_per_row(drafter, args.rows_k, args.rounds, contexts[:b], batched, lacking)
                  for batched in (True, False)]
            print(f"| {b} | {lacking} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.2f}x |")


if __name__ == "__main__":
    main()
