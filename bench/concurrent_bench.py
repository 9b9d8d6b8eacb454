"""Several requests at once through a served launch (issue 28): aggregate and per-stream tokens/s, TTFT.

    .venv/bin/python bench/concurrent_bench.py            # 0 and 40 ms, 1/2/4/8 clients (about 25 minutes on 2 cores)
    .venv/bin/python bench/concurrent_bench.py --quick    # smoke: 0 ms, 1/2 clients, 12 tokens (about 4 minutes)
    .venv/bin/python bench/concurrent_bench.py --delays 40 --clients 4 8 --sequential 0 --no-check log.dir=/tmp/l
        # an A/B pass: steps 1 and 3 left out; log.dir's trace.json has every round of every rank

For each delay: `torchrun --nproc_per_node=2 train_free_infer.py serve.port=PORT serve.max_concurrent=8
transport.emulate_delay_ms=D` with the default config (the embedded 0.5B drafter / 1.5B target, bf16; the
delay is EMULATED: a message arrives D ms after it was sent, one way, and no sender is held). Then, after
one warm-up request:
  1. one at a time: 8 requests, each sent when the previous one is done (the "served one at a time" baseline);
  2. N = 1, 2, 4, 8 clients: N threads, each streaming one greedy chat completion of its own prompt, all
     sent together;
  3. the check: every request of step 2 again, alone. Greedy, so its text must equal the one it got among
     others ("identical"). A correctness canary, not a timing.
Every request has its own prompt (short coding questions, none repeated across steps 1-2), so no step
reuses another's prompt from the slots' caches (the chat template's shared system prefix is reused by all).
Each answer's `tandem` fields (the server's TTFT, queue wait, tokens per round) go into --json beside them.
Figures, all client-measured: aggregate tok/s = every completion token / (last done - first sent);
per-stream tok/s = a request's completion tokens / (its done - its sent), mean and min; TTFT = sent ->
first streamed text, p50 / p95 (linear interpolation); x1 = aggregate over N=1's; x seq = over one at a time.
Run it alone: a benchmark beside other work measures the other work (the load average is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.ports import free_port  # noqa: E402 - the repository root first
from bench.serve_bench import chat_chunks  # noqa: E402
PROMPTS = [  # 23 different short coding questions: 8 for one at a time, then 1 + 2 + 4 + 8 for the clients
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that finds the second highest salary in an employees table.",
    "Write a Python function that flattens a nested list.",
    "Write a Bash one-liner that counts the lines of every .py file in a folder.",
    "Write a Rust function that returns the largest element of a slice of i32.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Go function that reads a file and returns its number of words.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a C function that copies a string without using strcpy.",
    "Write a Python function that removes duplicates from a list and keeps the order.",
    "Write a TypeScript interface for a user with a name, an email and an optional age.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Java method that checks whether a string is a palindrome.",
    "Write a Python function that parses a date like 2024-03-15 into a datetime.",
    "Write a regular expression that matches an IPv4 address, and explain it briefly.",
    "Write a Python function that computes the factorial of n recursively.",
    "Write a Python generator that yields the lines of a file without their newlines.",
    "Write a Kotlin data class for a point with x and y, and a function for their distance.",
    "Write a Python function that groups a list of words by their first letter.",
    "Write a Python decorator that prints how long a function took.",
]
WARM_UP = "Say hello."


def cpu_name() -> str:
    """lscpu's model name and whether the flags this CPU's bf16 speed depends on are there."""
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        info = ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    have = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512_bf16"))
    return f"{fields.get('Model name', 'unknown CPU').strip()} ({os.cpu_count()} cores; {have})"


class Served:
    """The served launch at one delay: started, healthy within `launch_s`, its process group ended on exit."""

    def __init__(self, delay_ms: float, overrides: list[str], launch_s: float, log: Path, nproc: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(ROOT / "train_free_infer.py"), f"serve.port={self.port}",
               "serve.max_concurrent=8", f"transport.emulate_delay_ms={delay_ms:g}", *overrides]
        env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)
        self.launch_s = launch_s

    def __enter__(self) -> "Served":
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.launch_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}); its log: {self.log}\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise SystemExit(f"the server did not answer /health within {self.launch_s:.0f} s (--launch-timeout); "
                         f"its log: {self.log}\n{self.tail()}")

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-5:])

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(60)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def stream_chat(url: str, prompt: str, max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy chat completion: its text, tokens and client-side times (perf_counter seconds)."""
    r = {"prompt": prompt, "sent": time.perf_counter(), "first": None, "text": "", "token_ids": None}
    try:
        for at, chunk in chat_chunks(url, [{"role": "user", "content": prompt}], max_tokens, timeout_s):
            piece = chunk["choices"][0]["delta"].get("content")
            if piece:
                r["first"] = r["first"] or at
                r["text"] += piece
            if chunk["choices"][0]["finish_reason"]:
                r["token_ids"] = chunk["tandem"]["token_ids"]
                r["tandem"] = {k: v for k, v in chunk["tandem"].items() if k != "token_ids"}  # the server's figures
    except (OSError, ValueError, KeyError) as e:
        r["error"] = f"{type(e).__name__}: {e}"[:200]
    r["done"] = time.perf_counter()
    if r["token_ids"] is None and "error" not in r:
        r["error"] = "the stream ended without a finish_reason"
    return r


def together(url: str, prompts: list[str], max_tokens: int, timeout_s: float) -> list[dict]:
    """Each prompt from its own thread, all sent at once; results in prompt order."""
    results: list[dict | None] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        start.wait()
        results[i] = stream_chat(url, prompts[i], max_tokens, timeout_s)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [r or {"prompt": p, "error": "no answer in time"} for r, p in zip(results, prompts)]


def one_at_a_time(url: str, prompts: list[str], max_tokens: int, timeout_s: float) -> list[dict]:
    return [stream_chat(url, p, max_tokens, timeout_s) for p in prompts]


def figures(results: list[dict]) -> dict:
    """Aggregate, per-stream and TTFT figures of one step (client-measured)."""
    if not results:
        return {"error": "skipped (--sequential 0)"}
    bad = [r for r in results if "error" in r]
    if bad:
        return {"error": f"{len(bad)} of {len(results)} failed: {bad[0]['error']}"}
    tokens = [len(r["token_ids"]) for r in results]
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    per_stream = [n / (r["done"] - r["sent"]) for n, r in zip(tokens, results)]
    ttft_ms = [((r["first"] or r["done"]) - r["sent"]) * 1000 for r in results]
    return {"requests": len(results), "tokens": sum(tokens), "wall_s": wall, "aggregate": sum(tokens) / wall,
            "stream_mean": float(np.mean(per_stream)), "stream_min": min(per_stream),
            "ttft_p50_ms": float(np.percentile(ttft_ms, 50)), "ttft_p95_ms": float(np.percentile(ttft_ms, 95))}


def bench_delay(delay_ms: float, a, log_dir: Path) -> dict:
    """Every step at one delay, on one served launch."""
    seq_prompts, rest = PROMPTS[:a.sequential], PROMPTS[a.sequential:]
    with Served(delay_ms, a.overrides, a.launch_timeout, log_dir / f"server-{delay_ms:g}ms.log") as served:
        warm = stream_chat(served.url, WARM_UP, 8, a.request_timeout)
        if "error" in warm:
            raise SystemExit(f"the warm-up request failed: {warm['error']}\n{served.tail()}")
        out = {"delay_ms": delay_ms, "load_before": os.getloadavg()}
        seq = one_at_a_time(served.url, seq_prompts, a.max_tokens, a.request_timeout)
        out["one_at_a_time"] = {**figures(seq), "results": seq}
        steps = []
        for n in a.clients:
            prompts, rest = rest[:n], rest[n:]
            step = together(served.url, prompts, a.max_tokens, a.request_timeout + 60 * n)
            steps.append({"clients": n, **figures(step), "results": step})
            print(f"  {delay_ms:g} ms, {n} clients: {steps[-1].get('aggregate', float('nan')):.2f} tok/s", flush=True)
        for step in steps if a.check else []:  # the canary: each request again, alone
            alone = one_at_a_time(served.url, [r["prompt"] for r in step["results"]], a.max_tokens, a.request_timeout)
            step["identical"] = [not ("error" in r or "error" in s) and r["text"] == s["text"]
                                 and r["token_ids"] == s["token_ids"] for r, s in zip(step["results"], alone)]
            step["alone_texts"] = [s.get("text") for s in alone]
        out["clients"] = steps
        out["load_after"] = os.getloadavg()
    return out


def table(runs: list[dict]) -> str:
    rows = ["| delay ms | clients | requests | tokens | wall s | aggregate tok/s | x N=1 | x one at a time "
            "| per-stream tok/s mean / min | TTFT p50 / p95 ms | identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        seq = run["one_at_a_time"]
        one = next((s for s in run["clients"] if s["clients"] == 1 and "error" not in s), None)
        for name, s in [("one at a time", seq)] + [(str(s["clients"]), s) for s in run["clients"]]:
            if "error" in s:
                rows.append(f"| {run['delay_ms']:g} | {name} | error: {s['error']} |")
                continue
            x1 = s["aggregate"] / one["aggregate"] if one else float("nan")
            xseq = s["aggregate"] / seq["aggregate"] if "error" not in seq else float("nan")
            same = "—" if "identical" not in s else f"{'yes' if all(s['identical']) else 'NO'} ({sum(s['identical'])}/{len(s['identical'])})"
            rows.append(f"| {run['delay_ms']:g} | {name} | {s['requests']} | {s['tokens']} | {s['wall_s']:.1f} | "
                        f"{s['aggregate']:.2f} | {x1:.2f} | {xseq:.2f} | {s['stream_mean']:.2f} / {s['stream_min']:.2f} "
                        f"| {s['ttft_p50_ms']:.0f} / {s['ttft_p95_ms']:.0f} | {same} |")
    return "\n".join(rows)


def goals(runs: list[dict]) -> list[str]:
    """Issue 28's goals, each said met or not."""
    lines = []
    for run in runs:
        by_n = {s["clients"]: s for s in run["clients"] if "error" not in s}
        if 1 not in by_n:
            continue
        agg1, d = by_n[1]["aggregate"], run["delay_ms"]
        wanted = [(4, 2.5), (8, 4.0)] if d >= 40 else [(4, 1.5), (8, 1.5)]
        for n, x in wanted:
            if n in by_n:
                got = by_n[n]["aggregate"] / agg1
                lines.append(f"{d:g} ms: {n} clients {got:.2f}x the aggregate of one (goal >= {x}x): "
                             f"{'met' if got >= x else 'NOT met'}")
        if 4 in by_n:
            got = by_n[4]["stream_mean"] / by_n[1]["stream_mean"]
            lines.append(f"{d:g} ms: per-stream tok/s at 4 clients {got:.2f}x one client's (goal >= 0.5x): "
                         f"{'met' if got >= 0.5 else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 0 ms only, 1 and 2 clients, 12 tokens")
    ap.add_argument("--delays", type=float, nargs="*", default=None, help="one-way emulated delays, ms (0 40)")
    ap.add_argument("--clients", type=int, nargs="*", default=None, help="concurrent clients (1 2 4 8)")
    ap.add_argument("--max-tokens", type=int, default=None, help="answer length (48; --quick 12)")
    ap.add_argument("--launch-timeout", type=float, default=600, help="seconds for the launch to answer /health")
    ap.add_argument("--request-timeout", type=float, default=600, help="seconds for one request (per read)")
    ap.add_argument("--sequential", type=int, default=None, help="requests of the one-at-a-time step (8; --quick: "
                    "the most clients; 0: skip it)")
    ap.add_argument("--no-check", dest="check", action="store_false", help="leave out step 3 (the canary)")
    ap.add_argument("--json", default=None, help="write every figure and answer here")
    ap.add_argument("overrides", nargs="*", help="key=value for the launch (e.g. spec.k=4)")
    a = ap.parse_args(argv)
    a.delays = a.delays if a.delays is not None else ([0.0] if a.quick else [0.0, 40.0])
    a.clients = a.clients or ([1, 2] if a.quick else [1, 2, 4, 8])
    a.max_tokens = a.max_tokens or (12 if a.quick else 48)
    if a.sequential is None:
        a.sequential = max(a.clients) if a.quick else 8
    if a.sequential + sum(a.clients) > len(PROMPTS):
        raise SystemExit(f"{a.sequential} + {sum(a.clients)} requests need more than the {len(PROMPTS)} prompts")
    log_dir = Path(tempfile.mkdtemp(prefix="concurrent-bench-"))
    started, load = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), os.getloadavg()
    print(f"{started}; {cpu_name()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; logs {log_dir}", flush=True)
    runs = [bench_delay(d, a, log_dir) for d in a.delays]
    load = os.getloadavg()
    command = " ".join([".venv/bin/python bench/concurrent_bench.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"\n`{command}`: default config{' + ' + ' '.join(a.overrides) if a.overrides else ''}, "
          f"max_tokens {a.max_tokens}, greedy; started {started}, ended "
          f"{time.strftime('%H:%M UTC', time.gmtime())}; load average per delay (before / after): "
          + "; ".join(f"{r['delay_ms']:g} ms {r['load_before'][0]:.2f} / {r['load_after'][0]:.2f}" for r in runs)
          + f"\n\n{table(runs)}\n")
    print("\n".join(goals(runs)))
    if a.json:
        Path(a.json).write_text(json.dumps({"started": started, "cpu": cpu_name(), "args": vars(a), "runs": runs},
                                           indent=1, default=str))


if __name__ == "__main__":
    main()
