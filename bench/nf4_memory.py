"""NF4 vs full precision on the embedded target: each rank's memory while loading, and decode speed.

    python bench/nf4_memory.py [--target DIR] [--dtype bfloat16] [--tokens 32]

For model.quant=none and model.quant=nf4 it
- loads each rank's half of the target in a fresh process and reports the peak RSS while loading
  (above the interpreter's own), the bytes of the stage's weights (4-bit data and quantization state
  included) and the RSS once every weight has been read (safetensors maps the checkpoint, so a
  full-precision stage is only resident once it has been used);
- runs the real two-rank generation (torchrun train_free_infer.py, greedy, spec.k=0, no drafter)
  and takes tokens/s (decode only) and the time to the first token from its stats.
It prints one markdown table, with the machine, dtypes and prompt it ran.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.ports import free_port  # noqa: E402 - the repository root first
DEFAULT_TARGET = Path(os.environ.get("TANDEM_CACHE", "~/.cache/tandem")).expanduser() / "models" / "qwen2.5-coder-1.5b-instruct"
PROMPT = "Write a Python function that reverses a string."
MB = 2 ** 20


def child(folder: str, first: int, last: int, quant: str, dtype: str, compute: str) -> None:
    """Load one rank's stage and print its memory figures as one JSON line."""
    import torch
    from transformers import AutoModelForCausalLM
    from model_parallel.loader import DTYPES, load_config, load_stage
    from model_parallel.quant import NF4Settings, weight_bytes

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    config = load_config(folder)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)  # import the model's code before the baseline
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from the current RSS
    except OSError:
        pass  # the peak then includes the imports': an overestimate
    base = status("VmRSS:")
    start = time.perf_counter()
    settings = NF4Settings(compute_dtype=DTYPES[compute]) if quant == "nf4" else None
    stage = load_stage(folder, first, last, embed=first == 0, head=last == config.num_hidden_layers,
                       dtype=dtype, device=device, quant=settings)
    load_s = time.perf_counter() - start
    peak = status("VmHWM:") - base
    for p in stage.parameters():
        p.sum()  # fault every page in
    figures = {"peak": peak, "resident": status("VmRSS:") - base, "weights": weight_bytes(stage), "load_s": load_s}
    if device.startswith("cuda"):
        figures["cuda_peak"] = torch.cuda.max_memory_allocated()
    print(json.dumps(figures))


def measure_load(folder: Path, first: int, last: int, quant: str, dtype: str, compute: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(folder), str(first), str(last), quant, dtype, compute]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    if proc.returncode:
        sys.exit(f"loading layers {first}-{last - 1} with quant={quant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def generate(folder: Path, quant: str, dtype: str, compute: str, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), f"model.target={folder}",
               f"model.dtype={dtype}", f"model.quant={quant}", f"model.quant_compute_dtype={compute}",
               "draft.kind=none", "spec.k=0", f"gen.max_new_tokens={tokens}", f"prompt={PROMPT}",
               "model.max_len=512", "output.stream=false", f"output.json={out}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
        if proc.returncode:
            sys.exit(f"generation with quant={quant} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def machine() -> str:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype (full-precision parts, hidden states)")
    parser.add_argument("--compute", default="bfloat16", help="model.quant_compute_dtype")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, first, last, quant, dtype, compute = args.child
        return child(folder, int(first), int(last), quant, dtype, compute)
    if not (args.target / "config.json").is_file():
        sys.exit(f"{args.target} has no config.json; fetch it with `python -m model_parallel.fetch_weights`")

    from model_parallel.loader import load_config
    num_layers = load_config(args.target).num_hidden_layers
    halves = [(0, num_layers // 2), (num_layers // 2, num_layers)]
    rows, outputs = [], {}
    for quant in ("none", "nf4"):
        loads = [measure_load(args.target, first, last, quant, args.dtype, args.compute) for first, last in halves]
        if quant == "none":
            full_weights = [m["weights"] for m in loads]
        result = generate(args.target, quant, args.dtype, args.compute, args.tokens)
        outputs[quant] = result["token_ids"]
        stats = result["stats"]
        for rank, ((first, last), m) in enumerate(zip(halves, loads)):
            speed = f"{stats['tokens_per_s']:.2f}" if rank == 0 else "(same run)"
            ttft = f"{stats['ttft_s']:.1f}" if rank == 0 else ""
            peak = f"{m['peak'] / MB:,.0f}" + (f" (GPU {m['cuda_peak'] / MB:,.0f})" if "cuda_peak" in m else "")
            rows.append(f"| {quant} | {rank} (layers {first}-{last - 1}) | {peak} | {m['weights'] / MB:,.0f} | "
                        f"{m['resident'] / MB:,.0f} | {m['load_s']:.1f} | {speed} | {ttft} |")
    same = next((i for i, (a, b) in enumerate(zip(outputs["none"], outputs["nf4"])) if a != b), min(map(len, outputs.values())))
    print(f"\n{args.target.name}, model.dtype={args.dtype}, NF4 matmuls in {args.compute}, greedy, spec.k=0, {args.tokens} new tokens, "
          f"chat prompt {PROMPT!r}\nmachine: {machine()}\n")
    print("| model.quant | rank | peak RSS while loading (MB) | weights (MB) | resident once read (MB) | load (s) "
          "| tokens/s (decode) | first token (s) |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[args.dtype]
    fp32 = [m * 4 // element / MB for m in full_weights]
    print(f"\nRSS figures are above the interpreter's own (torch + transformers + bitsandbytes imported). With "
          f"quant=none loading reads nothing (safetensors maps the checkpoint; pages come in on first use), so its "
          f"footprint is the 'resident once read' column. The fp32 slices would be {fp32[0]:,.0f} and {fp32[1]:,.0f} MB. "
          f"The NF4 output matches the {args.dtype} output for its first {same} of {len(outputs['none'])} tokens.")


if __name__ == "__main__":
    main()
