"""Several ranks per host (issue 42), as real torchruns on this machine: one per "host", --nnodes=H
--nproc_per_node=2. The ranks of a host link directly (loopback), only host-to-host links go through the relay, so
the relay carries H ring links, not 2H; the answer is transformers generate's (fp32); a host-to-host link cut
mid-generation resumes with the same answer; gloo between hosts (stock c10d rendezvous) the same.

All -m slow: each starts 4-6 ranks and their agents (20-60 s on two cores)."""
from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time

import pytest

from tests.support.hosts_harness import finish, kill_all, paired_ring_links, start_hosts
from tests.support.relay_harness import relay_process
from tests.support.tiny_models import reference_greedy, save_tiny, save_tiny_tokenizer

PROMPT = [1, 2, 3]
MAX_NEW = 12


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """A target of 6 layers (one per rank with 6 ranks), with a tokenizer (rank 0 streams text)."""
    folder = save_tiny(tmp_path_factory.mktemp("six") / "model", "qwen2", seed=3, layers=6)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def drafter(tiny_qwen_draft, tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft") / "model"
    shutil.copytree(tiny_qwen_draft, folder)
    save_tiny_tokenizer(folder)
    return folder


def args(target, draft, out, *more: str, max_new: int = MAX_NEW) -> list[str]:
    return [f"model.target={target}", f"draft.model={draft}", "model.dtype=float32", "draft.dtype=float32",
            "spec.k=3", f"prompt_ids={json.dumps(PROMPT).replace(' ', '')}", "chat=false", f"gen.max_new_tokens={max_new}",
            "model.split=null", f"output.json={out}", "output.stream=false", "transport.timeout_s=60", *more]


def check_answer(out, target, max_new: int = MAX_NEW) -> None:
    assert json.loads(out.read_text())["token_ids"] == reference_greedy(target, PROMPT, max_new)


def check_hosts_ended(outs: dict, procs: dict) -> str:
    for node, p in procs.items():
        assert p.returncode == 0, f"host {node}: {outs[node][1][-4000:]}"
    return "".join(err for _, err in outs.values())


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [2, 3])
def test_ranks_of_a_host_link_directly_and_the_relay_carries_one_link_per_host(hosts, six_layers, drafter, tmp_path):
    out = tmp_path / "out.json"
    with relay_process(tmp_path) as relay:
        procs = start_hosts(tmp_path, hosts, 2, args(six_layers, drafter, out, "transport.kind=relay"), relay, "hl")
        outs = finish(procs, 240)
        carried = paired_ring_links(relay.log(), "hl")
    err = check_hosts_ended(outs, procs)
    check_answer(out, six_layers)
    # the links rank 1 -> 2, 3 -> 4, ..., and the last rank -> 0: one per host, each paired once (no resume)
    assert sorted(carried) == [f"hl/ring{2 * h + 1}" for h in range(hosts)], carried
    ring = re.search(r"\[ring of (\d+) links: (\d+) between hosts \(relay, RTT [\d./]+ ms\), (\d+) on one host \(direct", err)
    assert ring and ring.groups() == (str(2 * hosts), str(hosts), str(hosts)), err[-3000:]
    assert f"its link to rank 1: local, RTT" in err and f"its link to rank 2: relay, RTT" in err, err[-3000:]
    # node 0's agent holds the run's store: it must outlive the other agents' exit barrier, not cut it short
    assert "exit barrier was skipped" not in err and "TCPStore.cpp" not in err, err[-3000:]


class CuttingProxy:
    """A TCP proxy in front of the relay for the ranks' data links: `cut()` shuts every connection it carries
    once, as a network drop would; it keeps listening, so the ranks re-dial through it."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            self.socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.cuts += 1
        for s in list(self.socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        self.cut()


@pytest.mark.slow
def test_a_cut_host_to_host_link_resumes_with_the_same_answer(six_layers, drafter, tmp_path):
    """Mid-generation (rank 0 has streamed its first text) every relay connection of the data links drops at once;
    the ranks re-dial, the sessions resume, and the answer is generate's."""
    out, max_new = tmp_path / "out.json", 48
    with relay_process(tmp_path) as relay:
        proxy = CuttingProxy(relay.addr)
        more = ("transport.kind=relay", f"transport.relay={proxy.addr}", "transport.emulate_delay_ms=20",
                "transport.reconnect_s=30", "output.stream=true")
        procs = start_hosts(tmp_path, 2, 2, args(six_layers, drafter, out, *more, max_new=max_new), relay, "cut")
        streamed = threading.Event()
        threading.Thread(target=lambda: (procs[0].stdout.read(1), streamed.set()), daemon=True).start()
        try:
            assert streamed.wait(150), "rank 0 never streamed its answer"
            proxy.cut()
            outs = finish(procs, 180)
        finally:
            kill_all(procs)  # when rank 0 never streamed; finish did it otherwise
            proxy.close()
        log = relay.log()
    err = check_hosts_ended(outs, procs)
    check_answer(out, six_layers, max_new)
    assert re.search(r"resumed session 'cut/([0-9a-f]{8}/)?ring", err), err[-3000:]  # the round, under tandem-relay
    assert len(set(paired_ring_links(log, "cut"))) == 2, log[-3000:]


@pytest.mark.slow
def test_gloo_between_hosts_with_the_stock_rendezvous(six_layers, drafter, tmp_path):
    """kind=gloo, torchrun's own c10d rendezvous (node ranks in arrival order): the ranks of a host are still
    numbered one after another, so the same two links cross between hosts and the answer is generate's."""
    out = tmp_path / "out.json"
    procs = start_hosts(tmp_path, 2, 2, args(six_layers, drafter, out, "transport.kind=gloo"), run_id="gl")
    err = check_hosts_ended(finish(procs, 240), procs)
    check_answer(out, six_layers)
    assert "[ring of 4 links: 2 between hosts (gloo, RTT" in err and "2 on one host (direct" in err, err[-3000:]
