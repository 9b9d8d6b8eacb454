"""spec.in_flight: rounds of one stream on the way at once, against one at a time (issue 29).

    python -m bench.in_flight_bench                 # every row below (about 15 minutes on 2 CPU cores)
    python -m bench.in_flight_bench --only self     # the self-drafting bound alone (about a minute)

Each run is the real entry under torchrun (two ranks on this host) with an EMULATED one-way delay
(transport.emulate_delay_ms: a message arrives that long after it was sent; the sender is not held).
Rows:
    self     a tiny random fp32 model drafting for itself (every bet holds): the bound of what rounds in
             flight can give when the wire is everything; at 0 and 50 ms
    ngram    the embedded 1.5B target, bf16, with the n-gram drafter on a code-editing prompt (the answer
             repeats the code it was given); at 40 and 150 ms
    pair     the embedded 1.5B target + 0.5B drafter, bf16; at 40 and 150 ms (150 ms: a transatlantic link)
at spec.in_flight 1 / 2 / 3 / auto (spec.overlap on in every row: in_flight=1 is today's round). Columns:
tok/s (decode: (tokens - 1) / (total - TTFT)), x1 (over in_flight=1 at the same row and delay), tok/round,
in flight (mean rounds on the way at each reply), bets won / lost, dropped (rounds sent on failed bets) and
the later ranks' ms spent on them, and = in_flight 1 (the tokens equal those of in_flight=1: greedy, so they
must). Writes <out>/results.json and prints a markdown table.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.ports import free_port  # noqa: E402 - the repository root first
CODE_EDIT = ("Rename the variable `total` to `running_sum` in this function and return the whole function:\n\n"
             "def average(values):\n    total = 0\n    count = 0\n    for v in values:\n        total += v\n"
             "        count += 1\n    if count == 0:\n        return 0.0\n    return total / count\n")
TALK = "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."
ROWS = {  # name: (delays ms, overrides)
    "self": ([0, 50], ["draft.kind=model", "model.dtype=float32", "draft.dtype=float32", "spec.k=4"]),
    "ngram": ([40, 150], ["draft.kind=ngram", "spec.k=6", f"prompt={CODE_EDIT}"]),
    "pair": ([40, 150], ["draft.kind=model", "spec.k=4", f"prompt={TALK}"]),
}
DEPTHS = ["1", "2", "3", "auto"]


def tiny_self_model(root: Path) -> list[str]:
    from tests.support.tiny_models import save_tiny
    folder = save_tiny(root / "tiny", "qwen2", seed=3, layers=8)
    return [f"model.target={folder}", f"draft.model={folder}", "prompt_ids=[5,17,250,3,99,42,7,8]"]


def run(overrides: list[str], out: Path, timeout_s: float) -> dict:
    result = out / f"run-{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "train_free_infer.py"), f"output.json={result}",
           "output.stream=false", "chat=true", "spec.adaptive=false", "spec.overlap=true", *overrides]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout_s)
    if proc.returncode != 0 or not result.exists():
        tail = [line for line in proc.stderr.splitlines() if line.strip() and "tensor/s" not in line][-3:]
        return {"error": " | ".join(tail)[-400:] or f"exit {proc.returncode}"}
    return json.loads(result.read_text())


def sweep(rows: list[str], max_new: int, out: Path, timeout_s: float) -> list[dict]:
    results = []
    for name in rows:
        delays, overrides = ROWS[name]
        base = overrides + (tiny_self_model(out) if name == "self" else []) + [f"gen.max_new_tokens={max_new}"]
        for delay in delays:
            for depth in DEPTHS:
                r = run(base + [f"transport.emulate_delay_ms={delay}", f"spec.in_flight={depth}"], out, timeout_s)
                results.append({"row": name, "delay_ms": delay, "in_flight": depth, "load": os.getloadavg()[0], **r})
                print(line(results[-1], results), flush=True)
    return results


def line(r: dict, every: list[dict]) -> str:
    if "error" in r:
        return f"| {r['row']} | {r['delay_ms']} | {r['in_flight']} | error: {r['error']} |"
    s = r["stats"]
    one = next((o for o in every if o["row"] == r["row"] and o["delay_ms"] == r["delay_ms"] and o["in_flight"] == "1"
                and "error" not in o), None)
    ratio = s["tokens_per_s"] / one["stats"]["tokens_per_s"] if one else float("nan")
    same = "yes" if one and one["token_ids"] == r["token_ids"] else "NO"
    return (f"| {r['row']} | {r['delay_ms']} | {r['in_flight']} | {s['tokens_per_s']:.2f} | {ratio:.2f} | "
            f"{s['tokens_per_round']:.2f} | {s['in_flight_mean']:.2f} | {s['bets_won']} / {s['bets_lost']} | "
            f"{s['rounds_dropped']} ({s['dropped_later_ms']:.0f} ms) | {same} | {r['load']:.1f} |")


HEADER = ("| row | delay ms | in_flight | tok/s | x1 | tok/round | in flight | bets won / lost | dropped (later ms) "
          "| = in_flight 1 | load |\n|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run-timeout", type=float, default=600)
    a = ap.parse_args(argv)
    out = Path(a.out or tempfile.mkdtemp(prefix="in-flight-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; out {out}\n{HEADER}", flush=True)
    results = sweep(a.only, a.max_new_tokens, out, a.run_timeout)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
