"""TTFT of a long system prompt, cold vs restored from cache.dir (issue 31), with the embedded pair.

    python bench/kv_restore.py                      # ~2,000-token system prompt, delays 0 and 40 ms
    python bench/kv_restore.py --delays 0 --system-tokens 1000

For each delay: a cold run (an empty cache.dir) asks question A after the system prompt; then a new launch
(a restart: new processes, the same cache.dir) asks question B after the same system prompt, so the system
prompt's blocks come from disk and only the rest is prefilled. Both under torchrun, two ranks on this host,
the real entry; TTFT is the output's stats.ttft_s (the first round's reply, prefill included). The delay is
EMULATED (transport.emulate_delay_ms, one way, per message). Prints one table row per delay and writes
<out>/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("TANDEM_CACHE", "~/.cache/tandem")).expanduser() / "models"
QUESTIONS = ["In one sentence: what does this project do?", "Name one file the text mentions."]


def system_text(tokens: int) -> str:
    """About `tokens` tokens of this repository's own prose (Qwen's tokenizer: ~4 characters a token)."""
    text = "\n\n".join((ROOT / f).read_text() for f in ("README.md", "docs/design.md", "docs/exactness.md")
                       if (ROOT / f).exists())
    return text[:tokens * 4]


def run(out: Path, cache_dir: Path, system_file: Path, question: str, delay_ms: float, args) -> dict:
    result = out / f"run-{len(list(out.glob('run-*.json')))}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={args.port}", str(ROOT / "train_free_infer.py"), f"output.json={result}", "output.stream=false",
           f"model.target={MODELS / 'qwen2.5-coder-1.5b-instruct'}", f"draft.model={MODELS / 'qwen2.5-coder-0.5b-instruct'}",
           f"model.dtype={args.dtype}", f"draft.dtype={args.dtype}", "model.split=null", f"gen.max_new_tokens={args.max_new}",
           f"transport.emulate_delay_ms={delay_ms}", f"cache.dir={cache_dir}", "cache.min_tokens=256",
           f"system_file={system_file}", f"prompt={question}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())["stats"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 40.0], help="emulated one-way delays, ms")
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kv-restore-"))
    out.mkdir(parents=True, exist_ok=True)
    system_file = out / "system.txt"
    system_file.write_text(system_text(args.system_tokens))
    rows = []
    print("| delay ms | prompt tokens | cold TTFT s | restored TTFT s | reused (disk) | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for delay in args.delays:
        cache_dir = out / f"cache-{delay:g}"
        cold = run(out, cache_dir, system_file, QUESTIONS[0], delay, args)
        warm = run(out, cache_dir, system_file, QUESTIONS[1], delay, args)
        rows.append({"delay_ms": delay, "cold": cold, "restored": warm})
        print(f"| {delay:g} | {warm['prompt_tokens']} | {cold['ttft_s']:.2f} | {warm['ttft_s']:.2f} | "
              f"{warm['prompt_tokens_reused']} ({warm['prompt_tokens_reused_from']['disk']}) | "
              f"{cold['ttft_s'] / warm['ttft_s']:.1f}x |", flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
