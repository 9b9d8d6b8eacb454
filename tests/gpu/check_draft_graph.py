"""GPU check (prepared, run by hand on a CUDA machine): graph-replayed drafting == eager drafting.

    python tests/gpu/check_draft_graph.py                      # the fetched 0.5B drafter on cuda:0
    python tests/gpu/check_draft_graph.py --tiny               # a tiny random model (no fetch needed)
    python tests/gpu/check_draft_graph.py --tiny --device cpu  # dry run of this script: eager vs eager
    python tests/gpu/check_draft_graph.py --quant none,int8    # the weight formats checked (default: each that runs)

Two drafters with the same weights on the same device, one with draft.graph=on, one off, are driven
through the same 500 rounds (random K, random number accepted, sometimes a deep rewind), greedy and
sampled; their drafts must be equal token for token. Then the same over 4 KV slots (serve.max_concurrent):
propose_rows over a random subset of the slots in each of up to 100 rounds (each batch size its own graph),
greedy, sampled and both mixed in one batch, each row at its own length and K. All of it for the drafter's
weights in each format (draft.quant: none, int8, nf4; nf4 left out, said so, where bitsandbytes does not import):
each must capture, and replay what it computes eagerly. Then it prints ms per draft step, eager vs graph, and the
ratio, a row per format and K. Exit status 0 = all equal.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.draft_speed import make_drafter, ms_per_round, runnable_formats  # noqa: E402


def drive(drafters, rounds: int, vocab: int, seed: int) -> int:
    """Same rounds for every drafter; returns how many rounds were compared."""
    rng = random.Random(seed)
    context = [rng.randrange(vocab) for _ in range(16)]
    for r in range(rounds):
        k = rng.randint(1, 8)
        proposals = [d.propose(context, k).tokens.tolist() for d in drafters]
        if any(p != proposals[0] for p in proposals[1:]):
            raise SystemExit(f"MISMATCH at round {r} (k={k}, context length {len(context)}): {proposals}")
        accepted = rng.choice([k, rng.randint(0, k)])
        context = context + proposals[0][:accepted] + [rng.randrange(vocab)]
        if len(context) > 900 or rng.random() < 0.05:
            context = context[:rng.randint(1, min(len(context), 200))]
        for d in drafters:
            d.commit(len(context))
    return rounds


def drive_rows(drafters, rounds: int, vocab: int, seed: int, temperatures: list[float]) -> int:
    """Same batched rounds for every drafter (slots = len(temperatures)); returns how many rounds were compared."""
    rng = random.Random(seed)
    slots = list(range(len(temperatures)))
    for d in drafters:
        for slot, temperature in zip(slots, temperatures):
            d.reset(0, temperature, seed=100 + slot, slot=slot)
    contexts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in slots]
    for r in range(rounds):
        rows = sorted(rng.sample(slots, rng.randint(1, len(slots))))
        ks = [rng.randint(1, 8) for _ in rows]
        batch = [contexts[s] for s in rows]
        proposals = [[p.tokens.tolist() for p in d.propose_rows(batch, ks, rows)] for d in drafters]
        if any(p != proposals[0] for p in proposals[1:]):
            raise SystemExit(f"MISMATCH at batched round {r} (slots {rows}, k {ks}): {proposals}")
        for slot, k, drafts in zip(rows, ks, proposals[0]):
            accepted = rng.choice([k, rng.randint(0, k)])
            contexts[slot] = contexts[slot] + drafts[:accepted] + [rng.randrange(vocab)]
            if len(contexts[slot]) > 900 or rng.random() < 0.05:
                contexts[slot] = contexts[slot][:rng.randint(1, min(len(contexts[slot]), 200))]
            for d in drafters:
                d.commit(len(contexts[slot]), slot=slot)
    return rounds


def tiny_model(folder: Path) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return str(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="drafter folder (default: the fetched Qwen2.5-Coder-0.5B)")
    ap.add_argument("--tiny", action="store_true", help="use a tiny random model instead")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--timing-rounds", type=int, default=50, help="rounds per K in the ms table (0: no table)")
    ap.add_argument("--quant", default="none,int8,nf4", help="the drafter's weight formats to check (draft.quant)")
    args = ap.parse_args()
    formats, left_out = runnable_formats(args.quant)
    for line in left_out:
        print(line)
    if args.tiny:
        folder = tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    else:
        from model_parallel.fetch_weights import model_dir
        folder = args.model or str(model_dir("qwen-coder-0.5b"))
    on_gpu = args.device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here; run with --device cpu for a dry run of the script")
    graph_mode = "on" if on_gpu else "off"  # on CPU: eager vs eager, which checks only this script
    kind = "graph" if on_gpu else "DRY RUN: eager"
    for quant in formats:
        for temperature in (0.0, 0.8):
            make = lambda graph: make_drafter(folder, args.device, args.dtype, graph, temperature, seed=3, quant=quant)  # noqa: E731
            graphed, eager = make(graph_mode), make("off")
            n = drive([graphed, eager], args.rounds, graphed.vocab_size, seed=11)
            print(f"draft.quant={quant}, temperature {temperature}: {n} rounds, graph == eager token for token ({kind} vs eager)")
        for temperatures in ([0.0] * 4, [0.8] * 4, [0.0, 0.8, 0.0, 1.2]):
            make = lambda graph: make_drafter(folder, args.device, args.dtype, graph, slots=4, quant=quant)  # noqa: E731
            graphed, eager = make(graph_mode), make("off")
            n = drive_rows([graphed, eager], min(args.rounds, 100), graphed.vocab_size, seed=12, temperatures=temperatures)
            print(f"draft.quant={quant}, 4 slots at temperatures {temperatures}: {n} batched rounds, graph == eager token "
                  f"for token ({kind} vs eager)")
    if not args.timing_rounds:
        return
    print(f"\n| draft.quant | K | eager ms/step | graph ms/step | eager/graph |\n|---|---|---|---|---|")
    context = list(range(1, 65))
    for quant in formats:
        graphed = make_drafter(folder, args.device, args.dtype, graph_mode, quant=quant)
        eager = make_drafter(folder, args.device, args.dtype, "off", quant=quant)
        for k in (1, 4, 8):
            e, g = ms_per_round(eager, k, args.timing_rounds, context) / k, ms_per_round(graphed, k, args.timing_rounds, context) / k
            print(f"| {quant} | {k} | {e:.2f} | {g:.2f} | {e / g:.2f}x |", flush=True)
        del graphed, eager
    print(f"\nmodel {folder}, {args.dtype}, device {args.device}"
          f" ({torch.cuda.get_device_name(args.device) if on_gpu else 'CPU: no graph, both eager'})")


if __name__ == "__main__":
    main()
