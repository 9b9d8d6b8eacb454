"""torchrun --rdzv_backend=tandem-relay on loopback: two torchruns meet at the relay, get the ranks they
pinned, and their workers talk through launch.distributed.open_channel with transport.kind=relay.
A wrong secret or a missing node fails in bounded time with a message that says what to check."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.relay_harness import PAIRING, REPO, TOKEN, relay_process

WORKER = textwrap.dedent("""
    import json, os, sys, torch
    from launch.config import load_config
    from launch.distributed import close_channel, open_channel, torchrun_rank
    rank, _ = torchrun_rank()
    cfg = load_config(["prompt_ids=[1]", "transport.kind=relay", "transport.timeout_s=30", *sys.argv[2:]])
    ch = open_channel(cfg, rank)
    if rank == 0:
        ch.send("ping", x=torch.arange(4))
        got = ch.recv("pong").tensors["x"].tolist()
    else:
        got = (ch.recv("ping").tensors["x"] * 10).tolist()
        ch.send("pong", x=torch.tensor(got))
    close_channel(ch)
    env = {k: os.environ.get(k) for k in ("RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TANDEM_RELAY",
                                "TANDEM_RELAY_ROUND")}
    with open(sys.argv[1], "w") as f:
        json.dump({"got": got, "env": env}, f)
""")


def torchrun(relay_addr: str, run_id: str, out: Path, script: Path, secret_file: Path, *conf: str, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=tandem-relay",
           f"--rdzv_endpoint={relay_addr}", f"--rdzv_id={run_id}", "--rdzv_conf", ",".join(["join_timeout=20", *conf]),
           "--max_restarts=0", str(script), str(out), *extra]
    pairing = secret_file.parent / "pairing"  # the nodes' pairing secret, for the channel; the relay never gets it
    pairing.write_bytes(PAIRING)
    env = dict(os.environ, PYTHONPATH=str(REPO), TANDEM_RELAY_TOKEN_FILE=str(secret_file), TANDEM_SECRET_FILE=str(pairing))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


@pytest.fixture
def setup(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(TOKEN)
    with relay_process(tmp_path) as relay:
        yield relay, script, secret_file, tmp_path


def test_torchrun_meets_at_the_relay_with_pinned_ranks(setup):
    relay, script, secret_file, tmp = setup
    # node "b" pins rank 1 and starts first; node "a" pins rank 0. Only the relay's address is given.
    procs = {n: torchrun(relay.addr, "job-a", tmp / f"{n}.json", script, secret_file, f"node_rank={r}")
             for n, r in (("b", 1), ("a", 0))}
    results = {n: p.communicate(timeout=120) for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, f"node {n}: {results[n][1][-3000:]}"
    a, b = (json.loads((tmp / f"{n}.json").read_text()) for n in "ab")
    assert a["env"]["RANK"] == "0" and b["env"]["RANK"] == "1"
    assert a["got"] == [0, 10, 20, 30] and b["got"] == [0, 10, 20, 30]
    for r in (a, b):  # the workers' store is the local proxy to the relay, never the other node's host
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1" and r["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert r["env"]["TANDEM_RELAY"] == relay.addr
    assert "rendezvous of 2 nodes complete" in relay.log()
    rounds = {r["env"]["TANDEM_RELAY_ROUND"] for r in (a, b)}  # the relay transport's link session names it
    assert len(rounds) == 1 and re.fullmatch(r"[0-9a-f]{8}", rounds.pop())


@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_wrong_secret_and_missing_node_fail_fast_and_say_why(setup):
    """The node with the wrong secret is refused at once; the good node hears of it from the relay within
    seconds (a warning, once), keeps waiting out its join_timeout, and its error names the refusal."""
    relay, script, secret_file, tmp = setup
    wrong = tmp / "wrong-secret"
    wrong.write_bytes(b"not the relay's secret")
    good = torchrun(relay.addr, "job-b", tmp / "good.json", script, secret_file, "join_timeout=6")
    good_lines = timestamped_lines(good.stderr)
    bad = torchrun(relay.addr, "job-b", tmp / "bad.json", script, wrong)
    _, bad_err = bad.communicate(timeout=60)
    good.wait(timeout=60)
    good_err = "".join(line for _, line in good_lines)
    assert bad.returncode != 0 and "token does not match" in bad_err, bad_err[-2000:]
    refusal = "a connection from 127.0.0.1 claiming session 'job-b' was refused at the relay for a wrong token"
    warnings = [(t, line) for t, line in good_lines if "still waits for its other node(s)" in line and refusal in line]
    assert len(warnings) == 1, good_err[-3000:]
    # told within seconds of the refusal, or of its own arrival if the refused node came first
    told_after = warnings[0][0] - max(relay_time(relay, "handshake refused: wrong MAC"),
                                      relay_time(relay, "run job-b: node any from"))
    assert told_after < 3.0, (told_after, relay.log()[-2000:])
    assert good.returncode != 0, good_err[-2000:]
    assert re.search(r"not all 2 nodes of run 'job-b' joined at the relay \S+ within 6 s \(--rdzv_conf join_timeout\); "
                     + re.escape(refusal) + r".*check TANDEM_RELAY_TOKEN_FILE", good_err), good_err[-3000:]


@pytest.mark.slow  # waits out a join timeout (~4 s)
def test_a_missing_node_is_named_with_what_to_check(setup):
    relay, script, secret_file, tmp = setup
    alone = torchrun(relay.addr, "job-c", tmp / "alone.json", script, secret_file, "join_timeout=3")
    _, err = alone.communicate(timeout=60)
    assert alone.returncode != 0
    assert "not all 2 nodes of run 'job-c' joined at the relay" in err and "start torchrun on the other node(s)" in err, err[-2000:]


def timestamped_lines(stream) -> list[tuple[float, str]]:
    """(time.time() of arrival, line) of a text stream, filled by a thread until the stream ends."""
    lines: list[tuple[float, str]] = []

    def read():
        for line in stream:
            lines.append((time.time(), line))
    threading.Thread(target=read, daemon=True).start()
    return lines


def relay_time(relay, text: str) -> float:
    """time.time() of the relay's first log line containing `text` (its asctime, to the millisecond)."""
    for line in relay.log().splitlines():
        if text in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    raise AssertionError(f"no {text!r} in the relay's log:\n{relay.log()[-2000:]}")


def test_join_timeout_defaults_well_below_torchruns_600_s(tmp_path):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from launch.torchrun.relay_rendezvous import DEFAULT_JOIN_TIMEOUT_S, RelayRendezvousHandler
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(TOKEN)

    def handler(**conf):
        params = RendezvousParameters("tandem-relay", "127.0.0.1:1", "job-d", 2, 2, relay_token_file=str(secret_file), **conf)
        return RelayRendezvousHandler(params)
    assert handler().join_timeout_s == DEFAULT_JOIN_TIMEOUT_S == 120
    assert handler(join_timeout="7").join_timeout_s == 7
