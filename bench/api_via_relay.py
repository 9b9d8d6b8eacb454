"""API latency through the relay vs direct, on loopback: TTFT and per-token time of streamed chat completions.

    python bench/api_via_relay.py [--model PATH] [--requests 10] [--max-tokens 64] [--loop auto] [extra key=value ...]

1. Starts `tandem-relay --api-port` and a served launch (torchrun, 2 ranks over gloo on this host) with
   serve.via_relay=true, so rank 0's server is reachable both at serve.port (direct) and at the relay's API
   port (through the dial-back).
2. Streams the same greedy chat completion `--requests` times each way, alternating, with the `openai` client:
   TTFT = request sent to the first streamed text; per-token = (last text - first text) / (pieces - 1).
   Medians are printed, and the difference the relay adds.
--model defaults to a tiny random Qwen2 with a chat template (as the tests build it): the model's own time is
then small and the relay's share shows; give a real model folder for a real figure.
Run it alone: a benchmark beside other work measures the other work.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.ports import free_port  # noqa: E402 - the repository root first

MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def stream_once(client, model: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, per-token s, pieces) of one streamed greedy chat completion."""
    t0 = time.perf_counter()
    times = []
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    if len(times) < 2:
        raise SystemExit(f"only {len(times)} streamed pieces: raise --max-tokens")
    return times[0] - t0, (times[-1] - times[0]) / (len(times) - 1), len(times)


def wait_until_up(client, proc: subprocess.Popen, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the served launch exited ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
        try:
            return client.models.list().data[0].id
        except Exception:  # noqa: BLE001 - not up yet (connection refused, closed by the relay)
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def tiny_chat_model(folder: Path) -> Path:
    from tests.support.serve_harness import chat_folder
    return chat_folder(folder, seed=3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: a tiny random chat model)")
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"), help="the relay's event loop")
    p.add_argument("extra", nargs="*", help="more key=value for the launch")
    a = p.parse_args()
    import openai
    work = Path(tempfile.mkdtemp(prefix="api-via-relay-"))
    model = a.model or tiny_chat_model(work / "model")
    tiny = [] if a.model else ["model.dtype=float32", "model.max_len=512", "draft.kind=none"]
    token, key = work / "relay.token", work / "api.key"
    token.write_text(secrets.token_hex(32))
    key.write_text(secrets.token_urlsafe(24))
    relay_port, api_port, serve_port = free_port(), free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    relay = subprocess.Popen([sys.executable, "-m", "netbridge.relay", "--host", "127.0.0.1", "--port", str(relay_port),
                              "--api-port", str(api_port), "--secret-file", str(token), "--loop", a.loop, "--log-level", "warning"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    listening = relay.stdout.readline()
    served = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                               f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), f"model.target={model}",
                               f"serve.port={serve_port}", "serve.via_relay=true", f"serve.api_key_file={key}",
                               f"transport.relay=127.0.0.1:{relay_port}", "transport.session=bench-api",
                               f"transport.relay_token_file={token}", *tiny, *a.extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        clients = {"direct": openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port}/v1", api_key=key.read_text(), max_retries=0),
                   "relay": openai.OpenAI(base_url=f"http://127.0.0.1:{api_port}/v1", api_key=key.read_text(), max_retries=0)}
        name = wait_until_up(clients["direct"], served)
        wait_until_up(clients["relay"], served)
        for client in clients.values():
            stream_once(client, name, a.max_tokens)  # warm-up: the first request of each path pays one-time costs
        got = {k: [] for k in clients}
        for _ in range(a.requests):
            for k, client in clients.items():
                got[k].append(stream_once(client, name, a.max_tokens))
    finally:
        os.killpg(served.pid, signal.SIGTERM)
        try:
            served.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(served.pid, signal.SIGKILL)
        relay.send_signal(signal.SIGTERM)
        relay.wait(15)
        shutil.rmtree(work, ignore_errors=True)
    loop = re.search(r"(uvloop|asyncio)\)", listening or "")
    print(f"API via relay vs direct: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, loopback, "
          f"relay loop {loop.group(1) if loop else '?'}, model {a.model or 'tiny random Qwen2'}, {a.requests} streamed greedy chat completions each way, "
          f"max_tokens {a.max_tokens} (~{statistics.median(g[2] for g in got['direct'])} pieces)")
    med = {k: (statistics.median(g[0] for g in v) * 1e3, statistics.median(g[1] for g in v) * 1e3) for k, v in got.items()}
    print(f"{'':8} {'TTFT ms':>9} {'per-token ms':>13}")
    for k, (ttft, per_token) in med.items():
        print(f"{k:8} {ttft:9.1f} {per_token:13.2f}")
    print(f"{'added':8} {med['relay'][0] - med['direct'][0]:+9.1f} {med['relay'][1] - med['direct'][1]:+13.2f}")


if __name__ == "__main__":
    main()
