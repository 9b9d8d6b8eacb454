"""Draft cost per round for K = 1, 4, 8: the embedded drafter (Qwen2.5-Coder-0.5B) on this machine; then
drafting for several requests at once (serve.max_concurrent): K=4 for B = 1, 2, 4, 8 rows in one batched step
(propose_rows) against B separate proposes, ms per row. --quant picks the drafter's weight format (none).

    python bench/draft_speed.py [--device cpu|cuda:0] [--dtype bfloat16] [--graph auto|on|off] [--rounds 20]
                                [--rows 1,2,4,8] [--rows-k 4] [--threads N] [--quant none|int8|nf4]

The formats (draft.quant): ms per draft step in each of none, int8 and nf4, at 1 thread and at N threads, for
1, 4 and 8 rows (K=4 rounds of the entry's own drafter, loaded in that format), and with --acceptance T the
greedy agreement of each format's drafter with the target (Qwen2.5-Coder-1.5B, bf16) over T tokens of each
bench prompt (bench/run_bench.py's): the share of positions where the drafter's argmax, given the target's
own output so far, is the target's next token (the per-draft acceptance of greedy speculation).

    python bench/draft_speed.py --formats none,int8,nf4 [--format-threads 1,2] [--format-rows 1,4,8]
                                [--acceptance 48] [--rounds 10]

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


def runnable_formats(asked: str) -> tuple[list[str], list[str]]:
    """(the formats of `asked` that can run here, a line for each left out)."""
    formats, left_out = [], []
    for quant in asked.split(","):
        if quant == "nf4":
            try:
                import bitsandbytes  # noqa: F401
            except Exception as e:  # noqa: BLE001 - the GPU machine has no bitsandbytes wheel
                left_out.append(f"nf4 left out: bitsandbytes does not import here ({type(e).__name__}: {e})")
                continue
        formats.append(quant)
    return formats, left_out


def make_drafter(folder: str, device: str, dtype: str, graph: str, temperature: float = 0.0, seed: int = 0,
                 max_len: int = 1024, max_k: int = 8, slots: int = 1, quant: str = "none"):
    """A drafter built by the entry's own code (launch.build) with `slots` KV slots, every slot set up for a request;
    its weights in `quant` (draft.quant: none, int8, nf4, or auto: timed here first)."""
    from dataclasses import replace

    from launch.build import model_drafter
    from launch.config import load_config
    from launch.plan import plan_here
    cfg = load_config([f"draft.model={folder}", f"draft.device={device}", f"draft.dtype={dtype}", f"draft.graph={graph}",
                       f"draft.max_len={max_len}", f"spec.k={max_k}", "prompt_ids=[1]", "model.split=null",
                       f"draft.quant={quant}"])
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
    ap.add_argument("--quant", default="none", help="draft.quant of the K and rows tables")
    ap.add_argument("--formats", default=None, help="e.g. none,int8,nf4: the formats table (and only it)")
    ap.add_argument("--format-threads", default=None, help="thread counts of the formats table (default: 1 and torch's)")
    ap.add_argument("--format-rows", default="1,4,8", help="batch rows of the formats table")
    ap.add_argument("--acceptance", type=int, default=0, help="with --formats: greedy agreement with the target over "
                                                              "this many tokens of each bench prompt (0: skip)")
    ap.add_argument("--target", default=None, help="target folder for --acceptance (default: the fetched 1.5B)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model or str(model_dir("qwen-coder-0.5b"))
    tok = AutoTokenizer.from_pretrained(folder)
    context = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    if args.formats:
        return formats_table(folder, args, context, tok)
    drafter = make_drafter(folder, args.device, args.dtype, args.graph, quant=args.quant)
    graph = drafter.step.use_graph
    print(f"drafter {Path(folder).name}, {args.dtype}, draft.quant={args.quant}, {args.device}, CUDA graph {'on' if graph else 'off'}, "
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
    drafter = make_drafter(folder, args.device, args.dtype, args.graph, slots=max(batches), quant=args.quant)
    contexts = [context + tok.encode(" x" * (3 * b)) for b in range(max(batches))]
    print(f"\n{max(batches)} slots, K={args.rows_k}, contexts {len(contexts[0])}-{len(contexts[-1])} tokens\n")
    print("| rows B | slot lacks | batched ms / row | separate ms / row | separate / batched |\n|---|---|---|---|---|")
    for b in batches:
        for lacking in (0, 1):
            ms = [rows_ms_per_row(drafter, args.rows_k, args.rounds, contexts[:b], batched, lacking)
                  for batched in (True, False)]
            print(f"| {b} | {lacking} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[1] / ms[0]:.2f}x |")


def formats_table(folder: str, args, context: list[int], tok) -> None:
    """ms per draft step (a K=4 round / 4) of each format at each thread count and batch size; then, with
    --acceptance, each format's greedy agreement with the target on the bench prompts."""
    formats = args.formats.split(",")
    threads = [int(t) for t in (args.format_threads or f"1,{torch.get_num_threads()}").split(",")]
    batches = [int(b) for b in args.format_rows.split(",")]
    k, default_threads = 4, torch.get_num_threads()
    contexts = [context + tok.encode(" x" * (3 * b)) for b in range(max(batches))]
    print(f"drafter {Path(folder).name}, {args.dtype}, {args.device}, K={k} rounds of {args.rounds}, prompt "
          f"{len(context)} tokens; ms per draft step (per row: a step drafts every row at once)\n")
    print("| format | threads | " + " | ".join(f"{b} row{'s' if b > 1 else ''}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for quant in formats:
        drafter = make_drafter(folder, args.device, args.dtype, args.graph, slots=max(batches), quant=quant)
        for n in threads:
            torch.set_num_threads(n)
            ms = [rows_ms_per_row(drafter, k, args.rounds, contexts[:b], True) * b / k for b in batches]
            print(f"| {quant} | {n} | " + " | ".join(f"{m:.1f}" for m in ms) + " |", flush=True)
        torch.set_num_threads(default_threads)
        del drafter
    if args.acceptance:
        acceptance_table(folder, args, formats, tok)


def acceptance_table(folder: str, args, formats: list[str], tok) -> None:
    """Greedy agreement of each format's drafter with the target's own greedy output, teacher-forced: one forward
    of the drafter over prompt + the target's tokens, its argmax at each output position against the next token."""
    from bench.run_bench import PROMPTS
    from model_parallel.fetch_weights import model_dir
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(args.target or str(model_dir("qwen-coder-1.5b")), dtype=torch.bfloat16)
    sequences = []
    for text in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        out = target.generate(torch.tensor([ids]), max_new_tokens=args.acceptance, do_sample=False)[0].tolist()
        sequences.append((len(ids), out))
    del target
    print(f"\ngreedy agreement with the target, {args.acceptance} tokens of each of {len(PROMPTS)} bench prompts\n")
    print("| format | " + " | ".join(f"prompt {i + 1}" for i in range(len(PROMPTS))) + " | all |\n|---|" +
          "---|" * (len(PROMPTS) + 1))
    for quant in formats:
        stage = make_drafter(folder, args.device, args.dtype, "off", max_len=2048, quant=quant).stage
        hits = []
        for prompt_len, ids in sequences:
            stage.cache.rewind(0)
            logits = stage(torch.tensor([ids], device=stage.device), num_logits=len(ids), live=len(ids))[0]
            guess = logits.argmax(-1).tolist()
            hits.append([guess[p - 1] == ids[p] for p in range(prompt_len, len(ids))])
        share = [sum(h) / len(h) for h in hits]
        pooled = sum(map(sum, hits)) / sum(map(len, hits))
        print(f"| {quant} | " + " | ".join(f"{x:.0%}" for x in share) + f" | {pooled:.1%} |", flush=True)


if __name__ == "__main__":
    main()
