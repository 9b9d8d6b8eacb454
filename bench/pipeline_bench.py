"""N pipeline stages on one host: N = 2, 3, 4 ranks at 0 and 40 ms EMULATED one-way delay per hop,
K=0 (one token per trip around the ring) against the defaults (model drafter, K up to 4, adaptive,
overlap), with tokens per round and each rank's busy fraction.

    python bench/pipeline_bench.py                       # the embedded Qwen2.5-Coder 1.5B / 0.5B pair, bf16
    python bench/pipeline_bench.py --ranks 2 3 --delays 40 --max-new-tokens 24

Each row is the real entry under `torchrun --nproc_per_node=N` (gloo on loopback), one thread per rank,
the layers shared out evenly (model.split=null: half for two ranks, even for more), the same prompt
and token budget. The delay holds every message that long after its send (netbridge/delay.py): a round at
N ranks crosses N hops (0 -> 1 -> ... -> N-1 -> 0), so it pays N delays once per round, not per token.

    tok/s      decode tokens per second ((tokens - 1) / (total - TTFT), as in Tandem's stats)
    tok/round  tokens committed per round
    busy       per rank, its compute over the decode time (rank 0: drafting, ahead too, and its slice;
               a middle rank: its slice; the last rank: its slice, the head and verification)
    x K=0      tok/s over the K=0 row of the same N and delay
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.ports import free_port  # noqa: E402 - the repository root first
PROMPT = "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."
SETTINGS = {"K=0": ["spec.k=0", "draft.kind=none"], "defaults": []}


def run(ranks: int, delay_ms: float, setting: str, args, out: Path) -> dict:
    result = out / f"n{ranks}-d{delay_ms:g}-{setting.replace('=', '')}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "train_free_infer.py"), f"prompt={PROMPT}",
           f"output.json={result}", "output.stream=false", f"gen.max_new_tokens={args.max_new_tokens}",
           "model.split=null", "model.max_len=512", "draft.max_len=512", f"transport.emulate_delay_ms={delay_ms}",
           *SETTINGS[setting], *args.set]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    load, t0 = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.run_timeout)
    if proc.returncode != 0 or not result.exists():
        tail = [line for line in proc.stderr.splitlines() if line.startswith("tandem")][-2:] or proc.stderr.splitlines()[-2:]
        return {"error": " | ".join(tail)[-300:]}
    stats = json.loads(result.read_text())["stats"]
    return {"stats": stats, "wall_s": time.perf_counter() - t0, "load_avg_1min": load}


def table(rows: list[dict]) -> str:
    lines = ["| N | delay | setting | tok/s | tok/round | accept | busy per rank | x K=0 |",
             "|---|---|---|---|---|---|---|---|"]
    base = {(r["ranks"], r["delay_ms"]): r["stats"]["tokens_per_s"] for r in rows
            if r["setting"] == "K=0" and "stats" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ranks']} | {r['delay_ms']:g} ms | {r['setting']} | failed: {r['error']} | | | | |")
            continue
        s = r["stats"]
        k0 = base.get((r["ranks"], r["delay_ms"]))
        busy = " / ".join(f"{b:.0%}" for b in s["busy_fraction"])
        ratio = f"{s['tokens_per_s'] / k0:.2f}x" if k0 else ""
        lines.append(f"| {r['ranks']} | {r['delay_ms']:g} ms | {r['setting']} | {s['tokens_per_s']:.2f} | "
                     f"{s['tokens_per_round']:.2f} | {s['acceptance_rate']:.0%} | {busy} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="*", default=[2, 3, 4])
    ap.add_argument("--delays", type=float, nargs="*", default=[0.0, 40.0])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--set", nargs="*", default=[], help="more Tandem key=value overrides for every run")
    ap.add_argument("--run-timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="default: runs/pipeline/<time>")
    args = ap.parse_args(argv)
    out = Path(args.out or ROOT / "runs" / "pipeline" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    t_start, rows = time.perf_counter(), []
    for ranks in args.ranks:
        for delay in args.delays:
            for setting in SETTINGS:
                row = {"ranks": ranks, "delay_ms": delay, "setting": setting, **run(ranks, delay, setting, args, out)}
                rows.append(row)
                s = row.get("stats")
                print(f"# N={ranks} {delay:g} ms {setting}: " + (f"{s['tokens_per_s']:.2f} tok/s, "
                      f"{s['tokens_per_round']:.2f} tok/round" if s else f"FAILED {row['error']}"), file=sys.stderr)
    loads = [r["load_avg_1min"] for r in rows if "load_avg_1min" in r]
    head = (f"{time.strftime('%Y-%m-%d %H:%M')}, `{' '.join(['pipeline_bench.py', *sys.argv[1:]])}`: {cpu} "
            f"({os.cpu_count()} cores), 1 thread per rank, {args.max_new_tokens} new tokens, greedy, one prompt; "
            f"delays EMULATED per hop; load average at the runs' starts {min(loads, default=0):.1f}-{max(loads, default=0):.1f}; "
            f"{(time.perf_counter() - t_start) / 60:.1f} min.")
    text = head + "\n\n" + table(rows)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
