"""Correctness on the device, before any figure: the real entry (two ranks on the one device, over gloo) is
token-identical to transformers `generate` there, and the graph-captured draft step equals the eager one.
Tiny random models in fp32; a drafter in the real Qwen2.5-0.5B shape for the graph check."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.gpu.models import SHAPES, TINY, random_model, save

REPO = Path(__file__).resolve().parents[2]
PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
NEW_TOKENS = 24


def tiny_folders(tmp: Path) -> tuple[str, str]:
    """(target, drafter): the same vocabulary, different random weights."""
    target = save(random_model(TINY, 4, "cpu", torch.float32, seed=1, scale=4.0), tmp / "target")
    drafter = save(random_model(TINY, 2, "cpu", torch.float32, seed=7, scale=4.0), tmp / "drafter")
    return target, drafter


def run_entry(args: list[str], out: Path, timeout_s: float = 240) -> tuple[dict | None, str]:
    """train_free_infer.py under torchrun, two ranks on this host; (output json, the end of stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_port()}", str(REPO / "train_free_infer.py"), *args, f"output.json={out}"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    result = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    return result, proc.stderr[-1500:]


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases(drafter: str, on_gpu: bool, tmp: Path) -> dict[str, list[str]]:
    """Ordered: the dry run launches only the last (the path with the most code)."""
    graph = "on" if on_gpu else "off"  # a CUDA graph needs CUDA; the dry run takes the same path eagerly
    model = ["draft.kind=model", f"draft.model={drafter}", "draft.dtype=float32", f"draft.graph={graph}", "spec.k=4"]
    kv = [f"cache.dir={tmp / 'kv'}", "cache.min_tokens=4", "cache.block_tokens=4"]  # the prompt's 8 first tokens
    return {
        "k0 (one token per round trip)": ["spec.k=0", "draft.kind=none"],
        "n-gram drafter": ["draft.kind=ngram", "spec.k=4"],
        "cache.dir, first run (saves the prompt's blocks, the device copy on a side stream)": ["draft.kind=ngram", *kv],
        "cache.dir, second run (restores them onto the device)": ["draft.kind=ngram", *kv],
        f"model drafter, draft.graph={graph}, 3 rounds in flight": [*model, "spec.in_flight=3"],
    }


def entry_parity(device: str, tmp: Path, dry_run: bool = False) -> list[dict]:
    """Every case on a device; the dry run launches only the model drafter's (the path with the most code)."""
    target, drafter = tiny_folders(tmp)
    expected = reference_for(target, device, PROMPT)
    common = [f"model.target={target}", "model.dtype=float32", "chat=false", f"prompt_ids=[{','.join(map(str, PROMPT))}]",
              f"gen.max_new_tokens={NEW_TOKENS}", "model.split=null", "output.stream=false"]
    results = []
    every = cases(drafter, device.startswith("cuda"), tmp)
    for i, (name, extra) in enumerate(every.items()):
        if dry_run and i < len(every) - 1:
            results.append({"name": name, "identical": None, "skipped": "dry run: one launch covers the path"})
            continue
        out, tail = run_entry(common + extra, tmp / f"case{i}.json")
        got = out["token_ids"] if out else None
        reused = out["stats"].get("prompt_tokens_reused_from") if out else None
        results.append({"name": f"entry, 2 ranks on {device}: {name}", "identical": got == expected,
                        **({"reused": reused} if reused else {}),
                        **({} if got == expected else {"expected": expected, "got": got, "stderr": tail})})
    return results


def graph_parity(device: str, tmp: Path, real_shape: bool, rounds: int) -> dict:
    """tests/gpu/check_draft_graph.py (graph replay == eager, greedy and sampled) on a tiny model or a random
    model in the real Qwen2.5-0.5B shape."""
    script = REPO / "tests" / "gpu" / "check_draft_graph.py"
    if real_shape:
        folder = save(random_model(SHAPES["qwen2.5-0.5b"], None, "cpu", torch.bfloat16, seed=3), tmp / "draft-0.5b")
        args = ["--model", folder]
    else:
        args = ["--tiny"]
    timing = ["--timing-rounds", "0"] if device == "cpu" else []  # on the CPU both are eager: no table to read
    proc = subprocess.run([sys.executable, str(script), *args, "--device", device, "--rounds", str(rounds), *timing],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    name = f"draft step graph == eager, {'Qwen2.5-0.5B shape' if real_shape else 'tiny'} on {device}"
    return {"name": name, "identical": proc.returncode == 0, "output": (proc.stdout + proc.stderr)[-1200:]}


def tmp_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="tandem-gpu-"))


def concurrent_parity(device: str, tmp: Path, requests: int = 4) -> dict:
    """Several requests at once (serve.max_concurrent) on the device, in process: rank 1 in a thread over
    local_ring, rank 0's Session admitting `requests` prompts of different lengths together (batched drafting,
    with the graph one per batch size on CUDA; batched stage forwards); each must be `generate`'s for its prompt."""
    import threading

    from launch.build import build_drafter, build_stage, eos_ids
    from launch.config import load_config
    from launch.ranks import last_rank, meet
    from netbridge.channel import local_ring
    from netbridge.protocol import SamplingParams
    from speculative.output import Output
    from speculative.session import Session
    target, drafter = tiny_folders(tmp / "concurrent")
    graph = "on" if device.startswith("cuda") else "off"
    cfg = load_config([f"model.target={target}", "model.dtype=float32", "chat=false", "serve.port=0",
                       f"serve.max_concurrent={requests}", "draft.kind=model", f"draft.model={drafter}",
                       "draft.dtype=float32", f"draft.graph={graph}", "spec.k=4", "model.split=null",
                       "output.stream=false"])
    (prev0, next0), (prev1, next1) = local_ring(2, 120.0)
    rank1 = threading.Thread(target=last_rank, args=(cfg, prev1), kwargs={"reply_to": next1}, daemon=True)
    rank1.start()
    plan = meet(cfg, prev0, next0, 0, 2)
    session = Session(build_stage(plan), build_drafter(plan), next0, plan.spec, prev0, slots=plan.slots)
    prompts = [PROMPT[:4 + 2 * i] for i in range(requests)]
    streams = [session.admit(p, Output(None, eos_ids(plan.models.target), NEW_TOKENS, [], stream=False), SamplingParams())
               for p in prompts]
    while session.live:
        session.tick()
    session.close()
    rank1.join(60)
    got = [s.output.tokens for s in streams]
    expected = [reference_for(target, device, p) for p in prompts]
    batches = max(r.batch for s in streams for r in s.gen.rounds)
    return {"name": f"{requests} requests at once, 2 ranks in process on {device} (draft.graph={graph}, batches up to "
                    f"{batches})", "identical": got == expected,
            **({} if got == expected else {"expected": expected, "got": got})}


def reference_for(folder: str, device: str, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
