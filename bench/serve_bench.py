"""Serving figures on the embedded pair: turn-2 TTFT with and without prefix reuse, served vs one-shot tok/s.

    python bench/serve_bench.py [--doc-tokens 1000] [--max-new 32] [extra key=value ...]

1. Starts `torchrun ... train_free_infer.py serve.port=PORT` (the default config unless overridden).
2. Turn 1: a ~1,000-token document (the first tokens of Python 3.11's own json/decoder.py source, fixed
   for a given Python) and a question. Turn 2: the same conversation plus the answer and a follow-up,
   with the caches holding turn 1 (reuse), then again after an unrelated request has replaced the
   caches' contents (no reuse). TTFT is measured twice: by the server (generation start to first token)
   and by the client (request sent to first streamed text).
3. tok/s of a served request vs a one-shot launch of the same prompt (decode tokens/s, as the summary
   line reports it), from one run each.
Run it alone: a benchmark beside other work measures the other work.
"""
from __future__ import annotations

import argparse
import inspect
import json
import json.decoder
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.ports import free_port  # noqa: E402 - the repository root first

QUESTION_1 = "What does the scanner in this file do with a backslash escape? Answer briefly."
QUESTION_2 = "And what error does it raise for an unterminated string?"
SERVED_PROMPT = "Write a Python function that reverses a string."


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), *args]


def document(tokenizer, n_tokens: int) -> str:
    source = inspect.getsource(json.decoder)
    return tokenizer.decode(tokenizer(source)["input_ids"][:n_tokens])


def chat_chunks(url: str, messages: list[dict], max_tokens: int, timeout_s: float = 3600):
    """One streamed greedy chat completion: (perf_counter when it came, the parsed chunk) for each chunk. The
    timeout bounds every read."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield time.perf_counter(), json.loads(line[6:])


def stream_chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy request: its text, the client's TTFT and the server's `tandem` figures."""
    t0, first, text, final = time.perf_counter(), None, "", None
    for at, chunk in chat_chunks(url, messages, max_tokens):
        piece = chunk["choices"][0]["delta"].get("content")
        if piece:
            first = first or at
            text += piece
        if chunk["choices"][0]["finish_reason"]:
            final = chunk
    return {"text": text, "client_ttft_ms": ((first or time.perf_counter()) - t0) * 1000, **final["tandem"]}


def wait_healthy(url: str, proc, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("the server did not come up")


def serve_figures(args, tokenizer) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(torchrun(f"serve.port={port}", *args.overrides), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO)
    try:
        wait_healthy(url, proc)
        doc = document(tokenizer, args.doc_tokens)
        turn1 = [{"role": "user", "content": f"Here is a file:\n```python\n{doc}\n```\n{QUESTION_1}"}]
        first = stream_chat(url, turn1, args.max_new)
        turn2 = turn1 + [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": QUESTION_2}]
        reused = stream_chat(url, turn2, args.max_new)
        stream_chat(url, [{"role": "user", "content": "Say hello."}], 4)  # the caches now hold something else
        fresh = stream_chat(url, turn2, args.max_new)
        served = stream_chat(url, [{"role": "user", "content": SERVED_PROMPT}], args.decode_tokens)
        return {"turn1": first, "reuse": reused, "fresh": fresh, "served": served}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def one_shot_tokens_per_s(args) -> dict:
    out = Path(tempfile.mkdtemp()) / "out.json"
    subprocess.run(torchrun(f"prompt={SERVED_PROMPT}", f"gen.max_new_tokens={args.decode_tokens}", "output.stream=false",
                            f"output.json={out}", "gen.temperature=0", *args.overrides),
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--max-new", type=int, default=32, help="answer length of the conversation turns")
    ap.add_argument("--decode-tokens", type=int, default=64, help="answer length for the tok/s comparison")
    ap.add_argument("overrides", nargs="*", help="key=value for both launches (e.g. spec.k=4)")
    args = ap.parse_args()
    from launch.config import load_config
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(load_config(["prompt=x", *args.overrides]).model.target)
    t0 = time.time()
    s = serve_figures(args, tokenizer)
    one_shot = one_shot_tokens_per_s(args)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, bench/serve_bench.py: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, 1 thread per rank (torchrun), overrides {args.overrides or 'none'}; "
          f"{time.time() - t0:.0f} s in all\n")
    print("| turn-2 request | prompt tokens reused | prefilled | server TTFT ms | client TTFT ms |\n|---|---|---|---|---|")
    for name in ("reuse", "fresh"):
        r = s[name]
        print(f"| {'with reuse' if name == 'reuse' else 'without reuse'} | {r['prompt_tokens_reused']} | "
              f"{r['prefilled_tokens']} | {r['ttft_ms']:.0f} | {r['client_ttft_ms']:.0f} |")
    print(f"\nturn 2 TTFT without / with reuse: {s['fresh']['ttft_ms'] / s['reuse']['ttft_ms']:.1f}x (server), "
          f"{s['fresh']['client_ttft_ms'] / s['reuse']['client_ttft_ms']:.1f}x (client); turn 1 prefilled "
          f"{s['turn1']['prefilled_tokens']} tokens; turn-2 answers equal: {s['reuse']['token_ids'] == s['fresh']['token_ids']}")
    served, once = s["served"]["tokens_per_s"], one_shot["stats"]["tokens_per_s"]
    print(f"decode tok/s, {args.decode_tokens} tokens: served {served:.2f}, one-shot launch {once:.2f} "
          f"({served / once:.2f}x); same tokens: {s['served']['token_ids'] == one_shot['token_ids']}")


if __name__ == "__main__":
    main()
