"""Issue 44: a served launch under torchrun --max_restarts loses a rank (SIGKILL, as a spot host taken back) and
keeps serving: the request in flight ends with an error naming the lost rank (no hang), the API answers again on
the same port (through the front, launch/serve/front.py) within the start-up time + 10 s, and the next answer is
token-identical to transformers generate. When the restarts are used up, torchrun ends in one line."""
import json
import os
import signal
import time
import urllib.request
from functools import partial

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from launch.torchrun.restarts import used_up_line
from tests.support.serve_harness import (Served, is_openai_error, launch_served, rank_pid, relay_nodes, serve_args,
                                         wait_healthy)
from tests.support.tiny_models import free_port, kill_launch, reference_greedy


def test_the_last_attempts_failure_is_one_line():
    failed = ChildFailedError("train_free_infer.py", {0: ProcessFailure(0, 0, 1, ""), 1: ProcessFailure(1, 1, -9, "")})
    line = used_up_line(failed, ["--nproc_per_node=2", "--max-restarts", "2", "train_free_infer.py", "serve.port=8000"])
    assert line == ("tandem: rank 0 (exit 1), rank 1 (exit -9) failed on the last of 3 attempts (--max_restarts=2 "
                    "used up); each rank's line above says why")
    assert used_up_line(failed, ["--nproc_per_node=2", "train_free_infer.py"]) is None  # torchrun's own report
    assert used_up_line(KeyboardInterrupt(), ["--max_restarts=2", "x.py"]) is None


def kill_mid_stream(served: Served, proc, victim: int, headers: dict | None = None) -> tuple[list[str], float]:
    """A long stream started, rank `victim` SIGKILLed after its first event; the rest of the stream (the socket's
    timeout bounds it: a hang fails) and when the kill was."""
    conn, events = served.stream("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1900}, timeout=30, headers=headers)
    assert json.loads(next(events))["choices"]
    pid = rank_pid(proc, victim)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    rest = list(events)
    conn.close()
    deadline = time.monotonic() + 60
    while rank_pid(proc, victim) in (None, pid):  # torchrun's next attempt
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    return rest, killed


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_lost_rank_costs_a_restart_not_the_service(models, victim):
    target, _ = models
    port = free_port()
    started = time.monotonic()
    proc = launch_served(*models, port, 2, torchrun=("--max_restarts=2",))
    served = Served(port)
    try:
        wait_healthy(served.url, proc)
        start_s = time.monotonic() - started
        rest, killed = kill_mid_stream(served, proc, victim)
        assert len(rest) >= 2 and rest[-1] == "[DONE]" and is_openai_error(json.loads(rest[-2])), rest[-3:]
        assert f"lost rank {victim}" in json.loads(rest[-2])["error"]["message"], rest[-2]
        wait_healthy(served.url, proc, timeout_s=start_s + 10)
        assert time.monotonic() - killed < start_s + 10
        status, answer = served.post("/v1/completions", {"prompt": [9, 8, 7], "max_tokens": 12})
        assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(target, [9, 8, 7], 12), answer
    finally:
        kill_launch(proc)


@pytest.mark.slow
def test_restarts_used_up_end_in_one_line_per_rank(models):
    port = free_port()
    proc = launch_served(*models, port, 2, torchrun=("--max_restarts=1",))
    served = Served(port)
    try:
        wait_healthy(served.url, proc)
        kill_mid_stream(served, proc, 1)
        wait_healthy(served.url, proc)
        os.kill(rank_pid(proc, 1), signal.SIGKILL)
        stderr = proc.communicate(timeout=60)[1]
    finally:
        kill_launch(proc)
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("tandem")]
    # rank 0 exits 1 once it finds rank 1 gone, or 143 when torchrun's SIGTERM comes first (nothing in flight: it
    # has not sent rank 1 anything since); rank 1 says nothing (SIGKILL)
    assert lines[-1].startswith("tandem: rank 0 (exit ") and lines[-1].endswith(
        "rank 1 (exit -9) failed on the last of 2 attempts (--max_restarts=1 used up); each rank's line above says why"), lines
    assert lines[-2].startswith(("tandem[rank 0]: lost rank 1", "tandem[rank 0]: stopped by SIGTERM")), lines
    with pytest.raises(OSError):  # the front went with the run
        urllib.request.urlopen(f"{served.url}/health", timeout=2)


@pytest.mark.slow
def test_through_the_relay_a_lost_node_rejoins_and_the_api_comes_back(models, tmp_path):
    """Two torchruns (one rank each) meeting at the relay: node 1's rank SIGKILLed mid-stream, both restart, meet in
    a new rendezvous round and pair in a fresh relay session (TANDEM_RELAY_ROUND), and node 0's front, which held
    serve.port meanwhile, carries the next request to the new rank 0: token-identical to generate. With
    serve.via_relay the front is the API at the relay's --api-port too: a 503 "restarting" there meanwhile."""
    target, _ = models
    key = tmp_path / "api-key"
    key.write_text("k-44\n")
    api = Served(free_port())  # the relay's --api-port
    auth_header = {"Authorization": "Bearer k-44"}
    with relay_nodes(tmp_path, partial(serve_args, *models), "serve.via_relay=true", f"serve.api_key_file={key}",
                     relay_args=("--api-port", str(api.port))) as (node, port):
        started = time.monotonic()
        nodes = [node(0), node(1)]
        served = Served(port)
        wait_healthy(served.url, nodes[0])
        start_s = time.monotonic() - started
        rest, killed = kill_mid_stream(served, nodes[1], 1, auth_header)
        assert len(rest) >= 2 and rest[-1] == "[DONE]" and is_openai_error(json.loads(rest[-2])), rest[-3:]
        assert api.health()["status"] == "restarting"  # rank 0 reloads for seconds yet: the front answers
        wait_healthy(served.url, nodes[0], timeout_s=start_s + 10)
        assert time.monotonic() - killed < start_s + 10
        for where in (served, api):
            status, answer = where.post("/v1/completions", {"prompt": [9, 8, 7], "max_tokens": 12}, auth_header)
            assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(target, [9, 8, 7], 12), answer
        assert all(p.poll() is None for p in nodes)


@pytest.mark.slow
def test_a_replacement_node_takes_over_and_the_lost_one_coming_back_cannot_break_in(models, tmp_path):
    """Node 1's host frozen mid-stream (SIGSTOP: its connections stay open, as a host gone without a word); a
    replacement node 1 started: rank 0 times out on the lost rank, node 0 restarts and meets the replacement in a
    new round, and the API answers again. Then the old node wakes (SIGCONT) and its rank re-dials its old relay
    session: that must not take the new rank 1's place (the link session names the round, TANDEM_RELAY_ROUND)."""
    target, _ = models
    # the frozen rank's link is seen dead after 3 missed heartbeats (2 s each at transport.timeout_s=12), then
    # re-dialed for transport.reconnect_s: rank 0 gives up on it ~14 s after the freeze
    with relay_nodes(tmp_path, partial(serve_args, *models), "transport.timeout_s=12",
                     "transport.reconnect_s=8") as (node, port):
        started = time.monotonic()
        node0, old1 = node(0), node(1)
        served = Served(port)
        wait_healthy(served.url, node0)
        start_s = time.monotonic() - started
        conn, events = served.stream("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1900}, timeout=30)
        assert json.loads(next(events))["choices"]
        frozen = [old1.pid, rank_pid(old1, 1)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        lost = time.monotonic()
        new1 = node(1)
        rest = list(events)
        conn.close()
        assert len(rest) >= 2 and rest[-1] == "[DONE]" and is_openai_error(json.loads(rest[-2])), rest[-3:]
        wait_healthy(served.url, node0, timeout_s=start_s + 14 + 10)
        assert time.monotonic() - lost < start_s + 14 + 10  # start-up + the loss seen + 10 s
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        time.sleep(6)  # the old rank finds its link closed and re-dials its session (for transport.reconnect_s)
        for prompt in ([9, 8, 7], [4, 4, 2]):
            status, answer = served.post("/v1/completions", {"prompt": prompt, "max_tokens": 12})
            assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(target, prompt, 12), answer
        assert node0.poll() is None and new1.poll() is None
