"""What a round costs on the device, in bf16, with random weights in the real shapes (bench/gpu/models.py).

- the drafter's K-step loop, eager and graph-captured (ms, and host syncs inside the loop: the goal is 0), with its
  weights in each format (draft.quant: none, int8, nf4 where bitsandbytes imports): a row per format;
- one target layer over 1, K+1 and a prefill chunk of tokens (ms per layer, measured over a few layers);
- the norm + LM head over K+1 positions;
- a whole round through the real entry at an emulated 0 and 43 ms one way, both ranks on the device.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from bench.gpu.models import SHAPES, TINY, layers_stage, random_model, save


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed_ms(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (and a graph's capture)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1000 / repeats


def host_syncs(fn, device: str) -> int | None:
    """Synchronizing calls inside `fn`, as torch's sync debug mode reports them (CUDA only)."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def drafter_formats(folder: str, device: str, k: int, repeats: int) -> dict:
    """{format: drafter_steps' row} for each weight format; a format that does not run here says why."""
    from bench.draft_speed import runnable_formats
    formats, left_out = runnable_formats("none,int8,nf4")
    rows = {quant: drafter_steps(folder, device, k, repeats, quant) for quant in formats}
    return {**rows, **{line.split()[0]: {"skipped": line} for line in left_out}}


def drafter_steps(folder: str, device: str, k: int, repeats: int, quant: str = "none") -> dict:
    """propose(K) + commit over the same context, eager and graph (bench/draft_speed.make_drafter: the entry's
    own drafter construction), the weights in `quant`. On the CPU only eager runs."""
    from bench.draft_speed import make_drafter
    context = list(range(1, 65))
    row = {}
    for graph in (["off", "on"] if device.startswith("cuda") else ["off"]):
        drafter = make_drafter(folder, device, "bfloat16", graph, max_k=k, quant=quant)
        drafter.commit(1)
        drafter.propose(context, k)

        def one_round():
            drafter.commit(len(context))
            drafter.propose(context, k)
        row[f"{'graph' if graph == 'on' else 'eager'}_ms"] = timed_ms(one_round, device, repeats)
        row[f"{'graph' if graph == 'on' else 'eager'}_host_syncs"] = host_syncs(one_round, device)
    return row


def drafter_folder(tmp: Path, dry_run: bool, device: str) -> str:
    shape = TINY if dry_run else SHAPES["qwen2.5-0.5b"]
    return save(random_model(shape, None, device, torch.bfloat16, seed=3), tmp / "drafter-costs")


def layer_ms(shape_name: str, device: str, k: int, chunk: int, layers: int, repeats: int, dry_run: bool) -> dict:
    """ms per layer of a stage over 1, K+1 and `chunk` tokens, and of the norm + head over K+1 positions."""
    shape = TINY if dry_run else SHAPES[shape_name]
    model = random_model(shape, layers, device, torch.bfloat16)
    stage = layers_stage(model)  # the head is timed apart, below
    stage.allocate_cache(chunk + 2 * (k + 1) + 8, torch.bfloat16)
    hidden = model.config.hidden_size
    row = {"layers_timed": layers, "real_layers": shape["num_hidden_layers"]}
    for tokens in (1, k + 1, chunk):
        h = torch.randn(1, tokens, hidden, device=device, dtype=torch.bfloat16)

        def forward():
            stage.cache.rewind(0)
            stage(h, live=tokens)
        row[f"per_layer_ms_{tokens}"] = timed_ms(forward, device, repeats) / layers
    h = torch.randn(1, k + 1, hidden, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        row[f"head_ms_{k + 1}"] = timed_ms(lambda: model.lm_head(model.model.norm(h)), device, repeats)
    del model, stage
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def entry_round(target: str, drafter: str, delay_ms: float, tmp: Path, new_tokens: int, k: int) -> dict:
    """A whole run through the real entry (2 ranks on this device over gloo) at an emulated one-way delay: its
    mean ms per round and the parts the stats name."""
    from bench.gpu.parity import run_entry
    args = [f"model.target={target}", f"draft.model={drafter}", "draft.kind=model", "model.dtype=bfloat16",
            "draft.dtype=bfloat16", "chat=false", "prompt_ids=[1,2,3,4,5,6,7,8]", f"gen.max_new_tokens={new_tokens}",
            f"spec.k={k}", "spec.adaptive=false", "model.split=null", "output.stream=false",
            f"transport.emulate_delay_ms={delay_ms:g}"]
    out, tail = run_entry(args, tmp / f"round-{delay_ms:g}.json")
    if out is None:
        return {"delay_ms": delay_ms, "error": tail}
    stats = out["stats"]
    return {"delay_ms": delay_ms, "rounds": stats["decode_rounds"], "tokens_per_round": stats["tokens_per_round"],
            "mean_ms": stats["mean_ms"]}


def round_target(tmp: Path, dry_run: bool, layers: int, device: str) -> str:
    shape = TINY if dry_run else SHAPES["qwen2.5-7b"]
    return save(random_model(shape, layers, device, torch.bfloat16, seed=5), tmp / "target-round")
