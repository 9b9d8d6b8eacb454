"""Each host is the node rank its user names (--rdzv_backend=tandem, launch/torchrun/rendezvous.py): started in the
"wrong" order, node rank 0 still runs rank 0 and prints the answer; a rank claimed twice, a rank out of range
or a node that never comes stops every host at the rendezvous with one line.

The refusals run the handler in this process (threads, a real TCPStore on loopback); the README's command runs
once through torchrun (two hosts here; three under -m slow)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from launch.torchrun.rendezvous import create_rdzv_handler
from tests.support.tiny_models import REPO, free_port, reference_greedy, save_tiny_tokenizer


@pytest.fixture(autouse=True)
def no_node_rank_left_behind(monkeypatch):
    """The handler exports TANDEM_NODE_RANK for torchrun's workers; here it must not outlive the test."""
    monkeypatch.setenv("TANDEM_NODE_RANK", "unset")
    monkeypatch.delenv("TANDEM_NODE_RANK")


def handler(port: int, node_rank: int | None, nnodes: int = 2, join_timeout: int = 10):
    conf = {"join_timeout": join_timeout} | ({} if node_rank is None else {"node_rank": node_rank})
    return create_rdzv_handler(RendezvousParameters("tandem", f"127.0.0.1:{port}", "run", nnodes, nnodes, **conf))


def meet(port: int, node_ranks: list, nnodes: int = 2, join_timeout: int = 10, stagger_s: float = 0.3) -> dict:
    """Each node's rendezvous in its own thread, started in the order given: {index: RendezvousInfo or the
    line it stopped with}, with the seconds each took."""
    results, threads = {}, []

    def node(i, r):
        t0 = time.monotonic()
        try:
            results[i] = handler(port, r, nnodes, join_timeout).next_rendezvous(), time.monotonic() - t0
        except SystemExit as e:
            results[i] = str(e), time.monotonic() - t0
    for i, r in enumerate(node_ranks):
        threads.append(threading.Thread(target=node, args=(i, r), daemon=True))
        threads[-1].start()
        time.sleep(stagger_s)
    for t in threads:
        t.join(join_timeout + 10)
    assert len(results) == len(node_ranks), "a node never returned from the rendezvous"
    return dict(sorted(results.items()))


def test_nodes_get_the_ranks_they_name_whatever_the_order_they_come_in():
    results = meet(free_port(), [2, 1, 0], nnodes=3)
    assert [info.rank for info, _ in results.values()] == [2, 1, 0]
    assert all(info.world_size == 3 for info, _ in results.values())


@pytest.mark.parametrize("node_ranks,needle", [
    ([0, 1, 1], "two hosts claim --rdzv_conf node_rank=1"),
    ([0, 5], "--rdzv_conf node_rank=5 on"),
])
def test_a_rank_that_cannot_be_assigned_stops_every_host_with_one_line(node_ranks, needle):
    results = meet(free_port(), node_ranks, nnodes=3)  # node rank 2 never comes: the group cannot complete first
    for line, took in results.values():
        assert isinstance(line, str) and needle in line and "\n" not in line, line
        assert took < 8, took  # the refusal, not the join timeout


def test_a_claim_after_all_met_stops_only_the_late_host():
    results = meet(free_port(), [0, 1, 1], nnodes=2, stagger_s=1.0)
    assert [info.rank for info, _ in list(results.values())[:2]] == [0, 1]
    line, _ = results[2]
    assert "two hosts claim --rdzv_conf node_rank=1" in line and "the launch went on with" in line, line


def test_a_node_that_never_comes_is_named_within_join_timeout():
    (line, took), = meet(free_port(), [0], join_timeout=1).values()
    assert "node rank 1 never came" in line and "--rdzv_conf join_timeout" in line, line
    assert 1 <= took < 8
    (line, took), = meet(free_port(), [1], join_timeout=1).values()  # no node rank 0 at the address at all
    assert "could not reach node rank 0's rendezvous" in line and took < 8, line


def test_the_node_rank_is_required():
    with pytest.raises(SystemExit, match="needs --rdzv_conf node_rank=R on every host"):
        handler(free_port(), None)


def readme_command(hosts: int, r: int, port: int, *args: str) -> list[str]:
    """The README's multi-host command, HOST0 = 127.0.0.1."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={hosts}", "--nproc_per_node=1",
            "--rdzv_backend=tandem", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_conf=node_rank={r},join_timeout=60",
            str(REPO / "train_free_infer.py"), *args]


def start_hosts(hosts: int, folder, draft) -> dict[int, subprocess.Popen]:
    """One torchrun per "host", the last node rank first."""
    port = free_port()
    args = [f"model.target={folder}", f"draft.model={draft}", "model.dtype=float32", "draft.dtype=float32", "spec.k=3",
            "prompt_ids=[1,2,3]", "chat=false", "gen.max_new_tokens=8", "model.split=null"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("TANDEM_NODE_RANK", None)
    procs = {}
    for r in reversed(range(hosts)):
        procs[r] = subprocess.Popen(readme_command(hosts, r, port, *args), env=env, cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(0.5)
    return procs


def check_rank0_answers(procs, folder):
    out = {r: p.communicate(timeout=180) for r, p in procs.items()}
    for r, p in procs.items():
        assert p.returncode == 0, f"node rank {r}: {out[r][1][-3000:]}"
    expected = reference_greedy(folder, [1, 2, 3], 8)[3:]
    assert out[0][0].strip(), "node rank 0 printed no answer"
    for r, (stdout, stderr) in out.items():
        assert f"[rank {r} (this host: --rdzv_conf node_rank={r}, as asked):" in stderr, stderr[-2000:]
        if r:
            assert not stdout.strip(), f"node rank {r} printed the answer: {stdout!r}"
    return expected


@pytest.fixture
def with_tokenizer(tiny_qwen, tiny_qwen_draft, tmp_path):
    import shutil
    folders = []
    for name, src in (("target", tiny_qwen), ("draft", tiny_qwen_draft)):
        shutil.copytree(src, tmp_path / name)
        save_tiny_tokenizer(tmp_path / name)
        folders.append(tmp_path / name)
    return folders


@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_readme_two_host_command_started_r1_first(with_tokenizer):
    folder, draft = with_tokenizer
    check_rank0_answers(start_hosts(2, folder, draft), folder)


@pytest.mark.slow
def test_readme_three_host_command_started_r2_r1_r0(with_tokenizer):
    folder, draft = with_tokenizer
    check_rank0_answers(start_hosts(3, folder, draft), folder)
