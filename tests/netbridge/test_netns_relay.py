"""Two nodes that can only dial out to the relay, in network namespaces: relay / node0 / node1 / client.

    node0 (10.N.0.2) --veth-- relay ns (10.N.0.1, 10.N.1.1, 10.N.2.1; public 10.N.9.1 on lo) --veth-- node1 (10.N.1.2)
                                                   `--veth-- client (10.N.2.2): an API user outside the NAT

Each node (and the client) has one route, to 10.N.9.1, and the relay namespace does not forward, so node0
and node1 cannot reach each other at all, nor the client node0: the test checks that first. Then one torchrun per node with
--rdzv_backend=tandem-relay --rdzv_endpoint=10.N.9.1:PORT and transport.kind=relay runs the real
entry on a tiny random Qwen2; the token ids must equal single-process transformers generate().
Needs root and `ip netns`; skipped with the reason otherwise. Namespaces are removed in a finally.
"""
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.relay_harness import PAIRING, REPO, TOKEN, relay_process
from tests.support.tiny_models import ids_arg, reference_greedy

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5]
NEW_TOKENS = 16


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=20)


def skip(reason: str):
    print(f"\nSKIP test_netns_relay: {reason}")
    pytest.skip(reason)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0:
        skip("needs root to create network namespaces")
    if not shutil.which("ip"):
        skip("iproute2 (`ip`) is not installed")
    sfx = secrets.token_hex(2)
    net = 100 + int(sfx, 16) % 150
    names = {k: f"tdm-{k}-{sfx}" for k in ("relay", "n0", "n1", "cl")}
    made: list[str] = []
    try:
        for ns in names.values():
            try:
                sh("ip", "netns", "add", ns)
            except subprocess.CalledProcessError as e:
                skip(f"`ip netns add` failed here: {e.stderr.strip()}")
            made.append(ns)
        ex = lambda ns, *c: sh("ip", "netns", "exec", names[ns], *c)  # noqa: E731
        for ns in names:
            ex(ns, "ip", "link", "set", "lo", "up")
        public = f"10.{net}.9.1"
        ex("relay", "ip", "addr", "add", f"{public}/32", "dev", "lo")
        ex("relay", "sysctl", "-qw", "net.ipv4.ip_forward=0")
        for i, node in enumerate(("n0", "n1", "cl")):
            a, b = f"tr{sfx}{i}a", f"tr{sfx}{i}b"
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            sh("ip", "link", "set", a, "netns", names["relay"])
            sh("ip", "link", "set", b, "netns", names[node])
            ex("relay", "ip", "addr", "add", f"10.{net}.{i}.1/24", "dev", a)
            ex("relay", "ip", "link", "set", a, "up")
            ex(node, "ip", "addr", "add", f"10.{net}.{i}.2/24", "dev", b)
            ex(node, "ip", "link", "set", b, "up")
            ex(node, "ip", "route", "add", f"{public}/32", "via", f"10.{net}.{i}.1")
        yield names, public, net
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def can_connect(ns: str, host: str, port: int) -> tuple[bool, str]:
    code = (f"import socket\ns = socket.socket(); s.settimeout(2)\n"
            f"try:\n  s.connect(({host!r}, {port})); print('connected')\n"
            f"except OSError as e:\n  print('refused' if e.errno == {errno.ECONNREFUSED} else 'unreachable', e)\n")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=20).stdout
    return out.startswith(("connected", "refused")), out.strip()


def torchrun_node(names: dict, node: str, rank: int, endpoint: str, model, out, secrets_dir, tokens: int, extra=(),
                  session: str = "netns-faults") -> subprocess.Popen:
    """One node's torchrun in its namespace, meeting the other at the relay (rendezvous and data)."""
    cmd = ["ip", "netns", "exec", names[node], sys.executable, "-m", "torch.distributed.run",
           "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=tandem-relay", f"--rdzv_endpoint={endpoint}",
           f"--rdzv_id={session}", f"--rdzv_conf=node_rank={rank},join_timeout=60", "--max_restarts=0",
           str(REPO / "train_free_infer.py"), f"model.target={model}", "model.dtype=float32", "draft.kind=none",
           f"prompt_ids={ids_arg(PROMPT)}", "chat=false", f"gen.max_new_tokens={tokens}", f"output.json={out}",
           "output.stream=false", "transport.kind=relay", f"transport.relay={endpoint}", f"transport.session={session}",
           f"transport.secret_file={secrets_dir / 'pairing'}", *extra]
    # the relay token reaches the rendezvous and the channel through the environment; the pairing secret only the channel
    env = dict(os.environ, PYTHONPATH=str(REPO), TANDEM_RELAY_TOKEN_FILE=str(secrets_dir / "token"), TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def node_secrets(tmp_path: Path) -> Path:
    """The nodes' files: the relay's token (admission) and their pairing secret, which the relay never gets."""
    folder = tmp_path / "node-secrets"
    folder.mkdir()
    for name, value in (("token", TOKEN), ("pairing", PAIRING)):
        (folder / name).write_bytes(value)
        (folder / name).chmod(0o600)
    return folder


@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_two_namespaces_reach_only_the_relay_and_match_generate(namespaces, tiny_qwen, tmp_path):
    names, public, net = namespaces
    expected = reference_greedy(tiny_qwen, PROMPT, NEW_TOKENS)
    secrets_dir = node_secrets(tmp_path)
    with relay_process(tmp_path, "--emulate-delay-ms", "5", host="0.0.0.0", netns=names["relay"]) as relay:
        # the topology: each node reaches the relay and nothing else
        assert can_connect(names["n0"], public, relay.port)[0] and can_connect(names["n1"], public, relay.port)[0]
        reached, why = can_connect(names["n0"], f"10.{net}.1.2", 22)
        assert not reached, f"node0 can reach node1 ({why}): the test would not prove anything"
        out = tmp_path / "out.json"
        endpoint = f"{public}:{relay.port}"
        procs = [torchrun_node(names, node, rank, endpoint, tiny_qwen, out, secrets_dir, NEW_TOKENS,
                               ["transport.timeout_s=60"], session="netns-e2e") for rank, node in enumerate(("n0", "n1"))]
        try:
            results = [p.communicate(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        for rank, (p, (_, err)) in enumerate(zip(procs, results)):
            assert p.returncode == 0, f"node{rank} torchrun failed ({p.returncode}):\n{err[-4000:]}\nrelay log:\n{relay.log()[-2000:]}"
        got = json.loads(out.read_text())["token_ids"]
        assert got == expected
        log = relay.log()
        # the ranks' link session is the run id and the rendezvous round (launch/transport.py)
        assert "rendezvous of 2 nodes complete" in log and re.search(r"session netns-e2e/[0-9a-f]{8}: ranks paired", log)
        print(f"\nnetns: {NEW_TOKENS} tokens equal generate(); relay {endpoint} peak RSS {relay.rss_mb():.0f} MB")


# ---- faults: the relay restarted and a node's link cut, mid-generation ------------------------
FAULTS_EACH = 5  # relay restarts, and link cuts, per run
FAULT_TOKENS = 300
FAULT_PORT = 29411  # fixed, so a restarted relay is found at the same address (the namespace is fresh)


@pytest.mark.slow  # about 2 minutes: `python -m pytest -m slow` (CI runs it)
def test_generation_survives_relay_restarts_and_link_cuts(namespaces, tiny_qwen, tmp_path):
    """The relay SIGKILLed and restarted 2 s later on the same address, and one node's veth set down for 5 s, each
    FAULTS_EACH times at random points of one generation: both torchruns exit 0 and the tokens equal generate()."""
    import random
    import signal
    import threading
    import time
    names, public, net = namespaces
    sfx = names["relay"].rsplit("-", 1)[1]
    expected = reference_greedy(tiny_qwen, PROMPT, FAULT_TOKENS)
    secrets_dir = node_secrets(tmp_path)
    relay_args = ("--port", str(FAULT_PORT))  # after relay_process's --port 0: the later one wins
    relays = [relay_process(tmp_path, *relay_args, host="0.0.0.0", netns=names["relay"])]
    first = relays[0].__enter__()
    endpoint = f"{public}:{FAULT_PORT}"
    out = tmp_path / "out.json"
    # timeout_s=6: heartbeats every 1 s, a dead link is noticed after 3 s; 30 ms emulated per message stretches the run
    extra = ("transport.timeout_s=6", "transport.reconnect_s=60", "transport.emulate_delay_ms=30")
    procs = [torchrun_node(names, node, rank, endpoint, tiny_qwen, out, secrets_dir, FAULT_TOKENS, extra)
             for rank, node in enumerate(("n0", "n1"))]
    counts = {"relay restarts": 0, "link cuts": 0}
    rng = random.Random(int(sfx, 16))

    def running() -> bool:
        return all(p.poll() is None for p in procs)

    def restart_relay() -> None:
        proc = inner[-1].proc  # the running relay (`ip netns exec` execs it: this is its pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        time.sleep(2.0)
        relays.append(relay_process(tmp_path, *relay_args, host="0.0.0.0", netns=names["relay"]))
        inner.append(relays[-1].__enter__())

    def cut_link() -> None:
        veth = f"tr{sfx}{rng.randrange(2)}a"  # the relay's end of node0's or node1's link
        sh("ip", "netns", "exec", names["relay"], "ip", "link", "set", veth, "down")
        time.sleep(5.0)
        sh("ip", "netns", "exec", names["relay"], "ip", "link", "set", veth, "up")

    def inject() -> None:
        deadline = time.monotonic() + 120
        while "ranks paired" not in first.log() and running() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(5.0)  # both load their stage after pairing (a fault then is survived too, but is not mid-generation)
        kinds = ["relay restarts", "link cuts"] * FAULTS_EACH
        rng.shuffle(kinds)
        for kind in kinds:
            time.sleep(rng.uniform(0.3, 2.0))  # a random point of the generation
            if not running():
                return
            (restart_relay if kind == "relay restarts" else cut_link)()
            counts[kind] += 1

    inner = [first]
    injector = threading.Thread(target=inject, daemon=True)
    t0 = time.monotonic()
    injector.start()
    try:
        results = [p.communicate(timeout=400) for p in procs]
        injector.join(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for cm in reversed(relays):
            cm.__exit__(None, None, None)
    elapsed = time.monotonic() - t0
    logs = "\n".join(r.log()[-1500:] for r in inner[-2:])
    for rank, (p, (_, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0, f"node{rank} torchrun failed ({p.returncode}):\n{err[-4000:]}\nrelay logs:\n{logs}"
    got = json.loads(out.read_text())["token_ids"]
    assert got == expected
    print(f"\nnetns faults: {counts['relay restarts']} relay restarts (2 s down) and {counts['link cuts']} link cuts (5 s down) "
          f"during one generation of {FAULT_TOKENS} tokens; both nodes exit 0, tokens equal generate(); {elapsed:.0f} s")
    assert counts["relay restarts"] >= FAULTS_EACH and counts["link cuts"] >= FAULTS_EACH, counts


# ---- the API through the relay (issue 43), from a client namespace that reaches only the relay ----------------
API_PORT = 29480  # the relay's --api-port (the namespace is fresh, so fixed is free)
SERVE_PORT = 8000  # rank 0's own serve.port, on node0 (unreachable from the client)
IDLE_CLIENTS = 200

CLIENT = r'''
import json, socket, sys, time
import openai
base, key, mode = sys.argv[1:4]
client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=60)
messages = [{"role": "user", "content": "tell me about relays"}]

def stream():
    model = client.models.list().data[0].id
    t0, ttft, pieces = time.perf_counter(), None, []
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            pieces.append(chunk.choices[0].delta.content)
    return {"pieces": pieces, "ttft_s": ttft}

def rounds(n=3):
    model = client.models.list().data[0].id
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.completions.create(model=model, prompt="abc", max_tokens=12, temperature=0)
        times.append(time.perf_counter() - t0)
    return min(times)

if mode == "stream":
    print(json.dumps(stream()))
elif mode == "wrong-key":
    try:
        client.models.list()
        print(json.dumps({"status": 200}))
    except openai.APIStatusError as e:
        print(json.dumps({"status": e.status_code}))
elif mode == "idle":
    host, port = base.split("//")[1].split("/")[0].rsplit(":", 1)
    without = rounds()
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(int(sys.argv[4]))]
    with_idle = rounds()
    print(json.dumps({"without_s": without, "with_idle_s": with_idle, "idle": len(idle)}))
'''


def api_client(ns: str, script: Path, base: str, key: str, mode: str, *extra: str) -> dict:
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(script), base, key, mode, *extra],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def serve_node(names: dict, node: str, rank: int, endpoint: str, model, secrets_dir, key_file) -> subprocess.Popen:
    """One node of a served launch (rank 0 registers its API at the relay; every rank checks the key's setting)."""
    cmd = ["ip", "netns", "exec", names[node], sys.executable, "-m", "torch.distributed.run",
           "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=tandem-relay", f"--rdzv_endpoint={endpoint}",
           "--rdzv_id=netns-api", f"--rdzv_conf=node_rank={rank},join_timeout=60", "--max_restarts=0",
           str(REPO / "train_free_infer.py"), f"model.target={model}", "model.dtype=float32", "model.max_len=512",
           "draft.kind=none", f"serve.port={SERVE_PORT}", "serve.via_relay=true", f"serve.api_key_file={key_file}",
           "transport.kind=relay", f"transport.secret_file={secrets_dir / 'pairing'}", "transport.timeout_s=60"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TANDEM_RELAY_TOKEN_FILE=str(secrets_dir / "token"), TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)


def wait_for_api(names: dict, script: Path, base: str, key: str, procs, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a node exited ({p.returncode}):\n{p.stderr.read()[-3000:]}"
        out = subprocess.run(["ip", "netns", "exec", names["cl"], sys.executable, str(script), base, key, "wrong-key"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0 and '"status": 401' in out.stdout:  # the server answers (401: this probe's key is wrong)
            return
        time.sleep(1.0)
    raise AssertionError("the API did not answer through the relay")


@pytest.mark.slow  # a served two-node launch in namespaces: ~1 minute
def test_a_client_outside_the_nat_streams_from_rank_0_through_a_relay_without_torch(namespaces, tmp_path):
    """The relay runs where torch cannot be imported (rendezvous and API alike); a client namespace that reaches
    only the relay streams a chat completion through --api-port, token for token the same as served directly on
    node0; a wrong key is a 401 through the relay; 200 idle API clients do not slow a round."""
    from tests.support.relay_without_torch import blocked_imports, start_relay_without_torch
    from tests.support.serve_harness import chat_folder
    from tests.support.tiny_models import kill_launch
    names, public, net = namespaces
    model = chat_folder(tmp_path / "chat-model", seed=3)
    secrets_dir = node_secrets(tmp_path)
    key_file = secrets_dir / "api-key"
    key_file.write_text("api-key-" + secrets.token_hex(8) + "\n")
    key = key_file.read_text().strip()
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    with start_relay_without_torch(tmp_path, "--api-port", str(API_PORT), host="0.0.0.0", netns=names["relay"]) as relay:
        endpoint = f"{public}:{relay.port}"
        assert can_connect(names["cl"], public, API_PORT)[0]
        reached, why = can_connect(names["cl"], f"10.{net}.0.2", SERVE_PORT)
        assert not reached, f"the client can reach node0 ({why}): the test would not prove anything"
        procs = [serve_node(names, node, rank, endpoint, model, secrets_dir, key_file) for rank, node in enumerate(("n0", "n1"))]
        try:
            via_relay = f"http://{public}:{API_PORT}/v1"
            wait_for_api(names, script, via_relay, "wrong", procs)
            relayed = api_client(names["cl"], script, via_relay, key, "stream")
            direct = api_client(names["n0"], script, f"http://127.0.0.1:{SERVE_PORT}/v1", key, "stream")
            assert relayed["pieces"] == direct["pieces"] and len(direct["pieces"]) > 3, (relayed, direct)
            assert api_client(names["cl"], script, via_relay, "not-the-key", "wrong-key") == {"status": 401}
            idle = api_client(names["cl"], script, via_relay, key, "idle", str(IDLE_CLIENTS))
            assert idle["idle"] == IDLE_CLIENTS
            assert idle["with_idle_s"] < 2 * idle["without_s"] + 0.5, idle  # loose: the idle sockets cost rank links nothing
        finally:
            for p in procs:
                kill_launch(p)
        log = relay.log()
        assert blocked_imports(log) == [], log[-2000:]
        assert "rendezvous of 2 nodes complete" in log and "service api:netns-api: registered" in log, log[-2000:]
        print(f"\nnetns API: {len(direct['pieces'])} streamed pieces equal through the relay (TTFT {relayed['ttft_s'] * 1e3:.0f} ms "
              f"vs {direct['ttft_s'] * 1e3:.0f} ms direct); a round {idle['without_s'] * 1e3:.0f} ms, with {IDLE_CLIENTS} idle "
              f"API clients {idle['with_idle_s'] * 1e3:.0f} ms; relay peak RSS {relay.rss_mb():.0f} MB, torch never imported")
