"""N > 2 pipeline stages: the ranks form a ring 0 -> 1 -> ... -> N-1 -> 0 (speculative.rounds.run_middle
between rank 0 and the last rank). Greedy output token-identical to transformers generate for N = 3
and 4, explicit and auto splits, K=0, n-gram and model drafters, overlap on and off; each rank holds
exactly its layers; bad splits are one line; the trace has a row per rank. (Sampling with 3 ranks:
tests/speculative/test_speculative.py's joint-distribution test.) Real processes: one torchrun launch of three
ranks over gloo, and (-m slow) a middle rank killed mid-generation, which every other rank reports in
one line within seconds."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from launch.build import build_stage
from launch.plan import plan_here
from launch.config import ConfigError, load_config
from model_parallel.split import even_cuts
from tests.support.one_line import assert_one_line_error, assert_one_line_process_error
from tests.support.tiny_models import REPO, free_port, ids_arg, reference_greedy, run_entry_pair, run_ranks, run_tandem

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
MAX_NEW = 23


def args(target, split: str, drafter: str, k: int, draft=None, overlap: bool = True) -> list[str]:
    base = [f"model.target={target}", "model.dtype=float32", f"model.split={split}", f"spec.k={k}",
            f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}", f"spec.overlap={str(overlap).lower()}"]
    if drafter == "model":
        return base + ["draft.kind=model", f"draft.model={draft}", "draft.dtype=float32"]
    return base + [f"draft.kind={drafter}"]


@pytest.mark.parametrize("ranks,split,drafter,k,draft,overlap", [
    (3, "[1,3]", "model", 4, "self", True),  # every draft accepted: the blocks drafted ahead are used
    (3, "[2,3]", "model", 4, "unrelated", True),  # mostly rejected: the blocks drafted ahead are dropped
    (3, "auto", "ngram", 3, None, False),
    (3, "[1,2]", "none", 0, None, True),  # K=0: one token per trip around the ring
    (4, "[1,2,3]", "model", 3, "unrelated", False),
    (4, "auto", "model", 2, "self", True),
    (4, "auto", "none", 0, None, True),
])
def test_n_stages_match_generate(ranks, split, drafter, k, draft, overlap, tiny_qwen, tiny_qwen_draft):
    draft = {"self": tiny_qwen, "unrelated": tiny_qwen_draft}.get(draft)
    out = run_ranks(ranks, *args(tiny_qwen, split, drafter, k, draft, overlap))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    stats = out["stats"]
    assert len(stats["busy_fraction"]) == ranks and len(stats["mean_ms"]["middle"]) == ranks - 2
    if draft == tiny_qwen:  # a drafter that is always right: whole blocks cross the pipe
        assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_round"] > k
        if overlap:
            assert stats["rounds_from_ahead"] >= stats["decode_rounds"] - 1


def test_tied_embeddings_over_three_ranks(tiny_llama):
    """Rank 0's embeddings and the last rank's head are one tensor in the checkpoint."""
    out = run_ranks(3, *args(tiny_llama, "[1,2]", "ngram", 3))
    assert out["token_ids"] == reference_greedy(tiny_llama, PROMPT, MAX_NEW)


def test_each_rank_holds_its_layers_only(tiny_qwen):
    cfg = load_config([f"model.target={tiny_qwen}", "model.split=[1,3]", "prompt_ids=[1]", "draft.kind=none"])
    stages = [build_stage(plan_here(cfg, r, 3)) for r in range(3)]
    assert [list(s.layer_ids) for s in stages] == [[0], [1, 2], [3]]
    assert [s.embed is not None for s in stages] == [True, False, False]
    assert [s.head is not None for s in stages] == [False, False, True]


def test_a_null_split_shares_the_layers_out_evenly():
    assert even_cuts(28, 2) == [14] and even_cuts(28, 4) == [7, 14, 21]
    assert even_cuts(28, 3) == [9, 19]  # the layer left over goes to the middle rank
    assert even_cuts(4, 3) == [1, 3] and even_cuts(5, 4) == [1, 3, 4] and even_cuts(6, 4) == [1, 3, 5]
    assert even_cuts(3, 3) == [1, 2]


@pytest.mark.parametrize("split,ranks,needles", [
    ("[2]", 3, ["model.split=[2] does not fit 3 ranks", "give 2 increasing layer numbers", "model.split=[1,3]"]),
    ("2", 3, ["model.split=2 does not fit 3 ranks"]),
    ("[3,2]", 3, ["model.split=[3, 2] is not increasing within 1..3", "has 4 layers"]),
    ("[1,4]", 3, ["model.split=[1, 4] is out of range", "within 1..3"]),
    ("auto", 5, ["has 4 layers, too few for 5 ranks", "start fewer ranks"]),
])
def test_a_split_that_does_not_fit_is_one_line(split, ranks, needles, tiny_qwen):
    with pytest.raises(BaseException) as info:
        run_ranks(ranks, f"model.target={tiny_qwen}", f"model.split={split}", "prompt_ids=[1,2]", "draft.kind=none",
                  timeout_s=20)
    assert_one_line_error(info.value, ConfigError, *needles)


def test_the_handshake_goes_around_the_ring(tiny_qwen):
    """Later ranks given model.split=auto take rank 0's split; a rank whose config differs from the one
    before it stops the ring with one line naming both (here rank 2's dtype)."""
    out = run_ranks(3, *args(tiny_qwen, "auto", "ngram", 3), only={0: ("model.split=[2,3]",)})
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    with pytest.raises(BaseException) as info:
        run_ranks(3, *args(tiny_qwen, "[1,3]", "none", 0), only={2: ("model.dtype=bfloat16",)}, timeout_s=20)
    assert_one_line_error(info.value, ConfigError, "the ranks disagree on dtype (rank 1: float32, rank 2: bfloat16)")


def run_ranks_over_relay(monkeypatch, relay: str, *argv: str, ranks: int = 3, tamper=None) -> dict[int, object]:
    """train_free_infer.main on every rank, as threads, over the real relay at `relay` (loopback): the real
    open_links, one relay session per ring link. `tamper(rank, prev, next)` sees each rank's opened links.
    Returns each rank's outcome as run_entry_pair does."""
    import threading

    import train_free_infer
    from launch import distributed
    from tests.support.relay_harness import PAIRING, TOKEN
    local, outcome = threading.local(), {}

    def open_links(cfg, rank, ranks):
        prev, next = distributed.open_links(cfg, rank, ranks)
        if tamper:
            tamper(rank, prev, next)
        return prev, next
    monkeypatch.setattr(train_free_infer, "torchrun_rank", lambda: (local.rank, ranks))
    monkeypatch.setattr(train_free_infer, "open_links", open_links)

    def rank(r: int) -> None:
        local.rank = r
        try:
            train_free_infer.main(["output.stream=false", "chat=false", "transport.kind=relay", f"transport.relay={relay}",
                                   "transport.session=ring-test", f"transport.relay_token={TOKEN.decode()}",
                                   f"transport.secret={PAIRING.decode()}", *argv])
            outcome[r] = None
        except SystemExit as e:
            outcome[r] = e.code
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome[r] = e
    from tests.support.tiny_models import run_both
    run_both(rank, 60, ranks)
    return outcome


def test_three_ranks_through_the_relay_match_generate(tiny_qwen, tmp_path, monkeypatch):
    """Each ring link (0 -> 1, 1 -> 2, and the replies 2 -> 0) is its own two-member session at a real relay."""
    from tests.support.relay_harness import relay_process
    out = tmp_path / "out.json"
    with relay_process(tmp_path, "--no-store") as relay:
        outcome = run_ranks_over_relay(monkeypatch, relay.addr, *args(tiny_qwen, "[1,3]", "ngram", 3), f"output.json={out}")
        paired = set(re.findall(r"session (\S+): ranks paired", relay.log()))
    assert outcome == {0: None, 1: None, 2: None}, outcome
    assert json.loads(out.read_text())["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert paired == {"ring-test/ring0", "ring-test/ring1", "ring-test/ring2"}, relay.log()[-2000:]


@pytest.mark.parametrize("drafter", ["self", "unrelated"])
def test_rounds_in_flight_through_the_relay_survive_a_cut_link(drafter, tiny_qwen, tiny_qwen_draft, tmp_path, monkeypatch):
    """spec.in_flight=3 over the relay, three ranks: mid-generation, with rounds on the way, rank 0's link to
    rank 1 loses its socket; it re-dials, the end-to-end session resends what was not acknowledged, and the
    output is still generate's (bets that hold with the target drafting for itself, that fail with another)."""
    import socket

    from tests.support.relay_harness import relay_process
    links = {}

    def cut_once(rank, prev, next):
        if rank != 0:
            return
        links[0], sent, send_frame = next, [0], next.send_frame

        def send_then_cut(frame):
            sent[0] += 1
            if sent[0] == 8:  # past the handshake and the prefill, rounds in flight
                next.link.sock.shutdown(socket.SHUT_RDWR)
            return send_frame(frame)
        next.send_frame = send_then_cut
    out = tmp_path / "out.json"
    draft = tiny_qwen if drafter == "self" else tiny_qwen_draft
    with relay_process(tmp_path, "--no-store") as relay:
        outcome = run_ranks_over_relay(monkeypatch, relay.addr, *args(tiny_qwen, "[1,3]", "model", 3, draft),
                                       "spec.in_flight=3", "spec.adaptive=false", f"output.json={out}", tamper=cut_once)
    assert outcome == {0: None, 1: None, 2: None}, outcome
    result = json.loads(out.read_text())
    assert result["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert links[0].resumes >= 1 and result["stats"]["in_flight_mean"] > 1.2, result["stats"]


def test_a_middle_ranks_dead_relay_link_is_one_line_on_every_rank(tiny_qwen, tmp_path, monkeypatch, capsys):
    """Mid-generation the middle rank's link on to rank 2 dies for good (its socket shut, it cannot re-dial,
    like a host gone): ranks 1 and 2 give up after transport.reconnect_s naming each other, rank 0 hears it
    from rank 2; one line each, with the ring's rank numbers (not the relay pair's 0/1)."""
    import socket

    from netbridge.channel import PeerError
    from tests.support.relay_harness import relay_process

    def kill_later(rank, prev, next):
        if rank != 1:
            return
        sent, send_frame = [0], next.send_frame

        def dead(seconds):
            raise PeerError("this rank's host is gone")

        def send_then_die(frame):
            sent[0] += 1
            if sent[0] == 6:  # past the handshake, mid-generation
                next.redial = dead
                next.link.sock.shutdown(socket.SHUT_RDWR)
            return send_frame(frame)
        next.send_frame = send_then_die
    t0 = time.monotonic()
    with relay_process(tmp_path, "--no-store") as relay:
        outcome = run_ranks_over_relay(monkeypatch, relay.addr, *args(tiny_qwen, "[1,2]", "none", 0),
                                       "transport.reconnect_s=2", "transport.timeout_s=20", tamper=kill_later)
    assert outcome == {0: 1, 1: 1, 2: 1}, outcome
    assert time.monotonic() - t0 < 25
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = dict(re.findall(r"tandem\[rank (\d)\]: ([^\r\n]*)", err))
    assert sorted(lines) == ["0", "1", "2"], err[-3000:]
    assert "rank 2" in lines["1"] and "reconnect_s" in lines["1"], lines
    assert "rank 1" in lines["2"] and "ring-test/ring1" in lines["2"], lines
    assert lines["0"].startswith("rank 2 failed: ") and "rank 1" in lines["0"], lines


def test_a_failure_on_one_rank_is_one_line_on_every_rank(tiny_qwen, monkeypatch, capsys):
    """Rank 0 alone finds the prompt too long for its cache (after the handshake): it says so, and the
    cause travels around the ring, so each other rank exits at once with one line naming it."""
    import re
    t0 = time.monotonic()
    outcome = run_entry_pair(monkeypatch, f"model.target={tiny_qwen}", "model.max_len=16", "draft.kind=none",
                             "model.split=[1,2]", "gen.max_new_tokens=10", f"prompt_ids={ids_arg(list(range(1, 10)))}",
                             timeout_s=30, ranks=3)
    assert time.monotonic() - t0 < 20
    assert outcome == {0: 1, 1: 1, 2: 1}
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = re.findall(r"tandem\[rank [^\]]*\]: [^\r\n]*", err)
    assert len(lines) == 3 and all("model.max_len=16" in line for line in lines), lines
    assert sum("failed" not in line for line in lines) == 1  # the cause, once; the others say who failed


def test_serving_over_three_ranks_equals_generate_and_stops_when_a_rank_is_lost(tmp_path):
    """The OpenAI-compatible server on rank 0 of three (threads over local_ring): an answer equals
    generate; then the middle rank vanishes mid-stream, the last rank loses it and goes, and the client
    gets an error naming the lost rank while rank 0's serve() raises the PeerError the entry reports."""
    import threading

    import openai

    import train_free_infer as entry
    from launch import ranks as lives
    from netbridge.channel import PeerError, local_ring
    from tests.support.serve_harness import MAX_LEN, chat_folder, serve_args, wait_healthy
    target, draft = chat_folder(tmp_path / "target", seed=1), chat_folder(tmp_path / "draft", seed=7, layers=2)
    port = free_port()
    cfg = load_config(serve_args(target, draft, port) + ["output.stream=false", "transport.timeout_s=20",
                                                         "model.split=[1,3]"])
    links, outcome = local_ring(3, 20), {}

    def run(rank):
        prev, next = links[rank]
        try:
            if rank == 0:
                entry.rank_zero(cfg, next, replies=prev, ranks=3)
            elif rank == 1:
                lives.middle_rank(cfg, prev, next, 1, 3)
            else:
                lives.last_rank(cfg, prev, reply_to=next, ranks=3)
        except BaseException as e:  # noqa: BLE001 - examined below
            outcome[rank] = e
            prev.close()
            next.close()
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    wait_healthy(f"http://127.0.0.1:{port}", None, 60)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(target)
    messages = [{"role": "user", "content": "def reverse(s):"}]
    answer = client.chat.completions.create(model="target", messages=messages, max_tokens=12)
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    assert answer.tandem["token_ids"] == reference_greedy(target, ids, 12)

    stream = client.completions.create(model="target", prompt="print('ok')", max_tokens=MAX_LEN - 64, stream=True)
    next(iter(stream))
    links[1][1].close()  # the middle rank's link onward goes away: rank 2's next receive fails
    links[1][0].inbox.put(None)  # and the middle rank's own thread ends
    with pytest.raises(openai.APIError, match="lost rank 2"):
        for _ in stream:
            pass
    threads[0].join(30)
    assert not threads[0].is_alive()
    assert isinstance(outcome.get(0), PeerError) and "lost rank 2" in str(outcome[0])
    assert isinstance(outcome.get(2), PeerError) and "lost rank 1" in str(outcome[2])


def test_the_trace_has_a_row_per_rank(tiny_qwen, tmp_path):
    delay_ms = 2
    out = run_ranks(3, *args(tiny_qwen, "[1,3]", "model", 3, tiny_qwen), f"log.dir={tmp_path}",
                    f"transport.emulate_delay_ms={delay_ms}")
    run_dir, = tmp_path.iterdir()
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {(e["pid"], e["name"]) for e in spans}
    assert {(1, "wait"), (1, "stage1"), (1, "send"), (2, "wait"), (2, "stage2"), (2, "verify")} <= names
    assert (1, "verify") not in names  # a middle rank only forwards
    rounds = {e["args"]["round"]: e for e in spans if e["pid"] == 0 and e["name"] == "round"}
    assert len(rounds) == out["stats"]["rounds"]
    for rank in (1, 2):  # after alignment each later rank works on round i inside rank 0's round i
        for e in spans:
            if e["pid"] == rank and e["name"] == f"stage{rank}":
                r = rounds[e["args"]["round"]]
                assert r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"], (rank, e, r)
    # one host, one clock: every rank's true offset, 0, within what the alignment claims, which knows
    # that rank 2 is two emulated hops from rank 0 and one back (rank 1: one and two)
    clock = trace["otherData"]
    assert clock["clock_offsets_ms"]["2"] == clock["clock_offset_ms"]
    for rank in ("1", "2"):
        assert abs(clock["clock_offsets_ms"][rank]) <= clock["clock_uncertainties_ms"][rank] + 0.05, clock
        assert clock["clock_uncertainties_ms"][rank] < delay_ms
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["middle_marks"]) == out["stats"]["rounds"] and all(len(m) == 1 for m in summary["middle_marks"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    middle = [e.value for e in events.Scalars("round/rank1_ms")]  # the middle rank's layers, per round
    assert len(middle) == out["stats"]["rounds"] and sum(middle[1:]) / (len(middle) - 1) == \
        pytest.approx(out["stats"]["mean_ms"]["middle"][0], rel=1e-4)


def test_clock_alignment_of_a_middle_rank_counts_the_ranks_that_held_the_block():
    """Synthetic rounds of three ranks, rank 1's clock 0.75 s ahead: rank 1 gets the block one hop after
    rank 0 sent it and its send reaches rank 0 only after rank 2 held the block and replied (two hops).
    Knowing the hops and how long rank 2 held it (a duration on rank 2's clock) bounds the offset far
    tighter than rank 1's own readings alone, and the true offset stays inside."""
    import random
    from launch.timeline import align_clocks
    rng, theta, hop = random.Random(1), 0.75, 0.005
    windows, marks, held, t = [], [], [], 10.0
    for _ in range(20):
        out, work1, work2 = hop + rng.uniform(0, 1e-3), rng.uniform(1e-3, 5e-3), rng.uniform(5e-3, 3e-2)
        back = 2 * hop + work2 + rng.uniform(0, 1e-3)
        recv = t + out + theta
        marks.append([recv - 1e-3, recv, recv + work1, recv + work1])
        windows.append((t, t + out + work1 + back))
        held.append((0.0, work2))
        t += out + work1 + back + rng.uniform(0, 0.02)
    plain = align_clocks(windows, marks)
    known = align_clocks(windows, marks, min_one_way_s=hop, hops=(1, 2), held=held)
    assert plain.consistent and known.consistent
    assert abs(known.offset_ms - theta * 1000) <= known.uncertainty_ms < 1.0 < plain.uncertainty_ms


# --- real processes: torchrun with three ranks over gloo; a middle rank killed --------------------

@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_torchrun_three_ranks_match_generate(tiny_qwen, tiny_qwen_draft, tmp_path):
    out, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=auto",
                           "draft.kind=model", f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "spec.k=4",
                           f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}", nproc=3)
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    for rank in range(3):  # each rank's start-up line: its layers, bytes against its budget, estimated ms
        assert f"[rank {rank}: layers " in proc.stderr and "estimated" in proc.stderr, proc.stderr
    assert len(out["stats"]["busy_fraction"]) == 3


def wait_for_output(proc, seconds: float) -> bool:
    """True once the process printed something on stdout (rank 0 streams text as tokens commit)."""
    import threading
    got = threading.Event()
    threading.Thread(target=lambda: (proc.stdout.read(1), got.set()), daemon=True).start()
    return got.wait(seconds)


@pytest.mark.slow  # three processes starting on two cores: 15-45 s, most of it importing torch
def test_a_killed_middle_rank_is_reported_by_every_other_rank(tiny_qwen, tmp_path):
    import shutil
    from tests.support.tiny_models import save_tiny_tokenizer
    folder = tmp_path / "with-tokenizer"
    shutil.copytree(tiny_qwen, folder)
    save_tiny_tokenizer(folder)  # rank 0 streams text: the sign that rounds are running
    port = free_port()
    argv = [f"model.target={folder}", "output.stream=true", "model.dtype=float32", "draft.kind=none",
            "prompt_ids=[1,2,3]", "chat=false", "gen.max_new_tokens=900", "model.max_len=1024", "model.split=[1,3]",
            "transport.emulate_delay_ms=20", "transport.timeout_s=30"]
    procs = []
    for rank in range(3):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE="3", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(REPO / "train_free_infer.py"), *argv], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        assert wait_for_output(procs[0], 90), procs[0].communicate()[1][-2000:]  # 900 rounds take > 54 s
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        errs = {r: procs[r].communicate(timeout=30)[1] for r in (0, 2)}
        assert time.monotonic() - t0 < 15
        for r, err in errs.items():
            lines = assert_one_line_process_error(subprocess.CompletedProcess([], procs[r].returncode, "", err), "rank 1")
            assert len(lines) == 1 and lines[0].startswith(f"tandem[rank {r}]: "), lines
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
