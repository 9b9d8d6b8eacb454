"""Draft cost per round for K = 1, 4, 8: the embedded drafter (Qwen2.5-Coder-0.5B) on this machine.

    python bench/draft_speed.py [--device cpu|cuda:0] [--dtype bfloat16] [--graph auto|on|off] [--rounds 20]

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


def make_drafter(folder: str, device: str, dtype: str, graph: str, temperature: float = 0.0, seed: int = 0,
                 max_len: int = 1024, max_k: int = 8):
    """A drafter built by the entry's own code (launch.build), set up for one request."""
    from launch.build import model_drafter
    from launch.config import load_config
    from launch.plan import plan_here
    cfg = load_config([f"draft.model={folder}", f"draft.device={device}", f"draft.dtype={dtype}", f"draft.graph={graph}",
                       f"draft.max_len={max_len}", f"spec.k={max_k}", "prompt_ids=[1]", "model.split=null"])
    drafter = model_drafter(plan_here(cfg, 0))
    drafter.reset(0, temperature, seed)
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
