"""How fast failures are reported (issue 16), tiny fp32 models built offline, loopback only.

    .venv/bin/python bench/failure_times.py relay-kill      # a rank SIGKILLed: time until the other's recv fails, through the relay
    .venv/bin/python bench/failure_times.py health-10mb     # /health while a 10 MB body is refused (and, limit raised, tokenized)
    .venv/bin/python bench/failure_times.py sigterm-stream  # SIGTERM (or --signal SIGINT) to torchrun's group mid-stream: exit times

Each prints one line per measurement; the figures depend on the host's load (quote them with it).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def tiny_chat_models(root: Path) -> tuple[Path, Path]:
    from tests.support.serve_harness import chat_folder
    if not (root / "target").exists():
        chat_folder(root / "target", seed=1)
        chat_folder(root / "draft", seed=7, layers=2)
    return root / "target", root / "draft"


def relay_kill(work: Path) -> None:
    import torch

    from netbridge.channel import PeerError
    from netbridge.relay_channel import RelayChannel
    from tests.support.relay_harness import PAIRING, TOKEN, relay_process
    with relay_process(work, "--no-store") as relay:
        child = subprocess.Popen([sys.executable, "-c", f"""
import sys, time; sys.path.insert(0, {str(REPO)!r})
from netbridge.relay_channel import RelayChannel
c1 = RelayChannel.connect({relay.addr!r}, "kill", 1, {TOKEN!r}, {PAIRING!r}, timeout_s=120, reconnect_s=60)
c1.recv("ping"); print("ready", flush=True); time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
        c0 = RelayChannel.connect(relay.addr, "kill", 0, TOKEN, PAIRING, timeout_s=120, reconnect_s=60)
        c0.send("ping", x=torch.ones(1))
        assert child.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        child.send_signal(signal.SIGKILL)
        try:
            c0.recv()
        except PeerError as e:
            print(f"killed rank reported through the relay after {time.monotonic() - t0:.2f} s "
                  f"(transport.reconnect_s=60, timeout_s=120): {e}")
        c0.close()
        child.wait()


def health_10mb(work: Path) -> None:
    from tests.support.serve_harness import served
    target, draft = tiny_chat_models(work)
    args = [f"model.target={target}", "model.dtype=float32", "draft.kind=model", f"draft.model={draft}",
            "draft.dtype=float32", "model.max_len=512", "draft.max_len=512", "gen.max_new_tokens=32"]
    body = json.dumps({"prompt": "w1 w2 " * 1_750_000}).encode()  # 10.5 MB, 3.5M words
    for extra, label in (([], "serve.max_body_bytes default (1 MiB)"), (["serve.max_body_bytes=20000000"], "serve.max_body_bytes=20000000")):
        with served(*args, *extra) as s:
            result = {}

            def post():
                t = time.monotonic()
                result["status"] = s.post("/v1/completions", body)[0]
                result["s"] = time.monotonic() - t
            poster = threading.Thread(target=post)
            poster.start()
            worst, n = 0.0, 0
            while poster.is_alive():
                t = time.monotonic()
                s.health()
                worst, n = max(worst, time.monotonic() - t), n + 1
                time.sleep(0.05)
            poster.join()
            print(f"{label}: 10.5 MB body answered {result['status']} after {result['s']:.2f} s; "
                  f"/health answered {n} times meanwhile, slowest {worst * 1000:.0f} ms")


def sigterm_stream(work: Path, sig: signal.Signals) -> None:
    from tests.support.serve_harness import serve_args, wait_healthy
    from bench.ports import free_port
    target, draft = tiny_chat_models(work)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), *serve_args(target, draft, port),
           "transport.emulate_delay_ms=5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True, env=dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false"))
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 1900, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    response.readline()
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    events = [raw.decode().strip() for raw in response if raw.strip()]
    stream_s = time.monotonic() - t0

    def pump():
        for line in proc.stderr:
            lines.append((time.monotonic() - t0, line.rstrip()))
    reader = threading.Thread(target=pump)
    reader.start()
    proc.wait(60)
    exit_s = time.monotonic() - t0
    reader.join()
    ranks = [f"{t:.2f} s {line}" for t, line in lines if "tandem[rank" in line]
    print(f"{sig.name} mid-stream: stream ended after {stream_s:.2f} s with {events[-2:]}; rank lines: {ranks}; "
          f"torchrun exited {proc.returncode} after {exit_s:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["relay-kill", "health-10mb", "sigterm-stream"])
    ap.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGINT"])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if a.what == "relay-kill":
            relay_kill(work)
        elif a.what == "health-10mb":
            health_10mb(work)
        else:
            sigterm_stream(work, signal.Signals[a.signal])


if __name__ == "__main__":
    main()
