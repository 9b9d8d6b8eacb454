"""How fast failures are reported (issue 16), tiny fp32 models built offline, loopback only.

    .venv/bin/python bench/failure_times.py relay-kill      # a rank SIGKILLed: time until the other's recv fails, through the relay
    .venv/bin/python bench/failure_times.py health-10mb     # /health while a 10 MB body is refused (and, limit raised, tokenized)
    .venv/bin/python bench/failure_times.py sigterm-stream  # SIGTERM (or --signal SIGINT) to torchrun's group mid-stream: exit times
    .venv/bin/python bench/failure_times.py restart --model tiny --victim 1 --kills 2 [--transport relay]
        # a served launch under torchrun --max_restarts: a rank SIGKILLed mid-stream, each time: the stream's end, the
        # time from the kill to the first answer again, and what every request sent meanwhile got (issue 44);
        # --model embedded (the fetched pair, configs/default.yaml) or smollm2 (configs/smollm2.yaml);
        # --transport relay: a loopback relay and two torchruns (one rank each) meeting at it, node N's rank killed

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


MODELS = {"embedded": [], "smollm2": ["config=configs/smollm2.yaml"]}


def restart(work: Path, model: str, victim: int, kills: int, transport: str) -> None:
    """gloo: one torchrun of 2 ranks; relay: a loopback relay and two torchruns of one rank each meeting there
    (tandem-relay rendezvous, transport.kind=relay), node `victim`'s rank the one killed. torchrun gets `kills`
    restarts either way."""
    from bench.ports import free_port
    from tests.support.serve_harness import launch_train_free_infer, relay_nodes, serve_args
    from tests.support.tiny_models import kill_launch

    def model_args(port: int) -> list[str]:  # the tiny pair's overrides, or the model's own config
        if model == "tiny":
            return serve_args(*tiny_chat_models(work), port)
        return [*MODELS[model], f"serve.port={port}"]
    if transport == "gloo":
        port = free_port()
        proc = launch_train_free_infer(model_args(port), 2, (f"--max_restarts={kills}",))
        try:
            kill_and_measure(port, proc, proc, model, victim, kills)
        finally:
            kill_launch(proc)
    else:
        with relay_nodes(work, model_args, max_restarts=kills) as (node, port):
            nodes = [node(0), node(1)]
            kill_and_measure(port, nodes[0], nodes[victim], f"{model} through the relay", victim, kills)


def kill_and_measure(port: int, server, victims, label: str, victim: int, kills: int) -> None:
    """`kills` times: a long stream started, rank `victim` (a worker of the torchrun `victims`) SIGKILLed after its
    first event; the stream's end, the time to the first answer again and what requests meanwhile got. `server`:
    the torchrun whose rank 0 serves on `port` (its exit ends the wait for start-up)."""
    from tests.support.serve_harness import rank_pid, wait_healthy
    t = time.monotonic()
    wait_healthy(f"http://127.0.0.1:{port}", server, timeout_s=900)
    print(f"{label}: serving after {time.monotonic() - t:.1f} s (start-up)")
    for kill in range(kills):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "def f(x):", "max_tokens": 200, "stream": True}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.readline()
        pid = rank_pid(victims, victim)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        events = [raw.decode().strip() for raw in response if raw.strip()]
        stream_s = time.monotonic() - t0
        statuses, back_s = probe_until_answered(port, t0)
        print(f"kill {kill + 1}: rank {victim} SIGKILLed mid-stream; the stream ended after {stream_s:.2f} s with "
              f"{events[-2][:160] if len(events) > 1 else events}; first answer again after {back_s:.1f} s; "
              f"requests meanwhile: {dict(sorted(statuses.items()))} (lost silently: {statuses.get('no answer', 0)})")
        while rank_pid(victims, victim) in (None, pid):
            time.sleep(0.1)


def probe_until_answered(port: int, t0: float, every_s: float = 0.25, limit_s: float = 900) -> tuple[dict, float]:
    """A small completion every `every_s` until one is answered 200: how many got each status ('no answer': the
    connection failed or timed out, which a client sees as a hang or a reset), and when the 200 came."""
    statuses: dict = {}
    while time.monotonic() - t0 < limit_s:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 4}),
                         headers={"Content-Type": "application/json"})
            status = conn.getresponse().status
        except OSError:
            status = "no answer"
        statuses[status] = statuses.get(status, 0) + 1
        if status == 200:
            return statuses, time.monotonic() - t0
        time.sleep(every_s)
    return statuses, float("inf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["relay-kill", "health-10mb", "sigterm-stream", "restart"])
    ap.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGINT"])
    ap.add_argument("--model", default="tiny", choices=["tiny", *MODELS], help="restart: the model served")
    ap.add_argument("--victim", type=int, default=1, choices=[0, 1], help="restart: the rank killed")
    ap.add_argument("--kills", type=int, default=2, help="restart: how many times (torchrun gets as many restarts)")
    ap.add_argument("--transport", default="gloo", choices=["gloo", "relay"],
                    help="restart: one torchrun of 2 ranks (gloo), or two torchruns meeting at a loopback relay")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if a.what == "relay-kill":
            relay_kill(work)
        elif a.what == "health-10mb":
            health_10mb(work)
        elif a.what == "restart":
            restart(work, a.model, a.victim, a.kills, a.transport)
        else:
            sigterm_stream(work, signal.Signals[a.signal])


if __name__ == "__main__":
    main()
