"""Why the loader copies each tensor off the checkpoint's mapping: a drafter step (every layer, the norm
and the head over one token after a short context) with its weights as views of the safetensors mapping
(what `safe_open(...).get_tensor` gives on CPU) against the same weights copied into the process's own
memory, alternating, one thread, medians.

    python bench/mapped_weights.py [--model PATH] [--repeats N]

Prints both medians and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def checkpoint_name(param: str, index: dict) -> str:
    """A Stage parameter's name in a Qwen/Llama-style checkpoint (a tied head is the embedding matrix)."""
    if param.startswith("layers."):
        return "model." + param
    if param == "head.weight":
        return "lm_head.weight" if "lm_head.weight" in index else "model.embed_tokens.weight"
    return {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(param, param)


def main(argv=None) -> None:
    from launch.build import build_draft_stage
    from launch.config import load_config
    from launch.plan import plan_here
    from model_parallel.loader import checkpoint_index
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded drafter)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(["prompt=x", "model.split=null", *([f"draft.model={args.model}"] if args.model else [])])
    stage = build_draft_stage(plan_here(cfg, 0))  # the loader's copies
    index = checkpoint_index(Path(cfg.draft.model))
    own = {name: p.data for name, p in stage.named_parameters()}
    opened = {file: safe_open(file, "pt", device="cpu") for file in set(index.values())}
    mapped = {}
    for name, p in stage.named_parameters():  # the same values, as views of the mapping where dtypes agree
        ckpt = checkpoint_name(name, index)
        tensor = opened[index[ckpt]].get_tensor(ckpt) if ckpt in index else None
        mapped[name] = tensor if tensor is not None and tensor.dtype == p.dtype and tensor.shape == p.shape else p.data
    on_mapping = sum(mapped[n] is not own[n] for n in own)
    stage(torch.arange(100, 164)[None], num_logits=1, live=64)
    token = torch.tensor([[7]])
    times = {"mapped": [], "own": []}
    for _ in range(args.repeats):
        for which, weights in (("mapped", mapped), ("own", own)):
            for name, p in stage.named_parameters():
                p.data = weights[name]
            stage.cache.rewind(64)
            t0 = time.perf_counter()
            with torch.inference_mode():
                stage(token, num_logits=1, live=65)
            times[which].append((time.perf_counter() - t0) * 1000)
    m, o = (statistics.median(times[k]) for k in ("mapped", "own"))
    print(f"{cfg.draft.model}: {on_mapping} of {len(own)} tensors on the mapping; one step {m:.1f} ms mapped, "
          f"{o:.1f} ms own memory: mapped / own = {m / o:.2f}")


if __name__ == "__main__":
    main()
