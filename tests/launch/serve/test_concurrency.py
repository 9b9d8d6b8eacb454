"""Issue 28: the server serves several requests at once (serve.max_concurrent), each in its own slot; the rest
wait (serve.max_queue, a 429 beyond). Over real HTTP against the in-process server (tests.support.serve_harness),
tiny fp32 models, a 5 ms emulated delay so that rounds of different requests overlap on the way."""
import json
import threading
import time

import pytest
from transformers import AutoTokenizer

from tests.support.serve_harness import served, served_args
from tests.support.tiny_models import reference_greedy

SLOTS = 3
LONG = 400  # tokens: a request that stays live until its client goes away


@pytest.fixture(scope="module")
def server(models):
    args = served_args(*models, f"serve.max_concurrent={SLOTS}", "serve.max_queue=1", f"gen.max_new_tokens={LONG}",
                       "transport.emulate_delay_ms=5")
    with served(*args) as s:
        yield s
    assert s.outcome == {0: None, 1: None}


def post_all(server, bodies: list[dict]) -> list:
    """POST each body from its own thread, all at once; the answers in order: (status, JSON), or for a
    streamed one (its text joined, its last chunk)."""
    answers = [None] * len(bodies)

    def post(i):
        if not bodies[i].get("stream"):
            answers[i] = server.post("/v1/completions", bodies[i])
            return
        conn, events = server.stream("/v1/completions", bodies[i])
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        conn.close()
        answers[i] = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]
    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return answers


def watch_live(server, stop: threading.Event, seen: list[int]) -> None:
    while not stop.is_set():
        seen.append(server.health()["live"])
        time.sleep(0.003)


def test_concurrent_requests_each_equal_generate_of_their_own_prompt(server, models):
    """4 clients on 3 slots, two of them streamed: each one's tokens (and a stream's text, chunk by chunk) its own."""
    prompts = [([5, 6, 7], 20), ([9, 8, 7, 6, 5, 4], 12), ([11], 24), ([30, 31, 32, 33], 16)]
    streamed = [True, False, True, False]
    assert server.health()["slots"] == SLOTS
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=watch_live, args=(server, stop, seen))
    watcher.start()
    answers = post_all(server, [{"prompt": ids, "max_tokens": n, "stream": s} for (ids, n), s in zip(prompts, streamed)])
    stop.set()
    watcher.join()
    tokenizer = AutoTokenizer.from_pretrained(models[0])
    for (ids, n), s, answer in zip(prompts, streamed, answers):
        expected = reference_greedy(models[0], ids, n)
        if s:
            text, last = answer
            assert text == tokenizer.decode(expected, skip_special_tokens=True) and last["tandem"]["token_ids"] == expected
        else:
            assert answer[0] == 200 and answer[1]["tandem"]["token_ids"] == expected, ids
    assert max(seen) >= 2 and max(seen) <= SLOTS, seen  # they were live together, never more than the slots


def test_a_client_that_goes_away_leaves_the_others_answers_alone(server, models):
    before = server.health()
    conn, events = server.stream("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": LONG})
    next(events)
    other = {}
    thread = threading.Thread(target=lambda: other.update(answer=server.post("/v1/completions",
                                                                              {"prompt": [40, 41, 42], "max_tokens": 24})))
    thread.start()
    server.wait_for(lambda h: h["live"] == 2)
    conn.close()  # the first client goes away mid-stream, while the other is being generated
    thread.join(60)
    status, answer = other["answer"]
    assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(models[0], [40, 41, 42], 24)
    after = server.wait_for(lambda h: h["live"] == 0)
    assert after["cancelled"] == before["cancelled"] + 1 and after["served"] == before["served"] + 2


def test_beyond_the_slots_and_the_queue_is_a_429_and_the_waiting_one_counts_its_wait(server, models):
    streams = [server.stream("/v1/completions", {"prompt": [5 + i, 6], "max_tokens": LONG}) for i in range(SLOTS)]
    for _, events in streams:
        next(events)
    health = server.health()
    assert health["live"] == SLOTS and health["slots"] == SLOTS and health["waiting"] == 0
    waiting = {}

    def wait_in_line():
        waiting["sent"] = time.monotonic()
        waiting["answer"] = server.post("/v1/completions", {"prompt": [9, 8, 7], "max_tokens": 4})
        waiting["received"] = time.monotonic()
    thread = threading.Thread(target=wait_in_line)
    thread.start()
    server.wait_for(lambda h: h["waiting"] == 1)  # serve.max_queue=1: the queue is full
    status, refused = server.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 429 and refused["error"]["type"] == "rate_limit_exceeded" and "serve.max_queue" in refused["error"]["message"]
    time.sleep(0.2)
    freed_at = time.monotonic()
    streams[0][0].close()  # a slot frees: the waiting one is admitted
    thread.join(60)
    status, answer = waiting["answer"]
    assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(models[0], [9, 8, 7], 4)
    t = answer["tandem"]
    assert t["queue_ms"] >= (freed_at - waiting["sent"]) * 1000 - 5, t  # it waited for the slot
    assert t["queue_ms"] <= t["ttft_ms"] <= (waiting["received"] - waiting["sent"]) * 1000, t  # TTFT from arrival
    for conn, _ in streams[1:]:
        conn.close()
    server.wait_for(lambda h: h["live"] == 0)


def test_a_signal_ends_every_live_stream_with_its_cause(models, tmp_path):
    """SIGTERM (what uvicorn's handler does on it) with two streams live and one waiting: each stream ends with
    an error event and [DONE], the waiting one gets the 503, both ranks end cleanly. The telemetry written on the
    way out has both requests, in their own slots."""
    from launch.distributed import Interrupted
    args = served_args(*models, "serve.max_concurrent=2", "gen.max_new_tokens=400", "transport.emulate_delay_ms=5",
                       f"log.dir={tmp_path}")
    with served(*args) as server:
        streams = [server.stream("/v1/completions", {"prompt": [5 + i, 6, 7], "max_tokens": 400}) for i in range(2)]
        for _, events in streams:
            next(events)
        waiting = {}
        queued = threading.Thread(target=lambda: waiting.update(answer=server.post("/v1/completions",
                                                                                   {"prompt": [5], "max_tokens": 2})))
        queued.start()
        server.wait_for(lambda h: h["waiting"] == 1 and h["live"] == 2)
        server.uvicorn.handle_exit(15, None)  # SIGTERM
        for conn, events in streams:
            rest = list(events)
            conn.close()
            assert rest[-1] == "[DONE]" and "stopped by SIGTERM" in json.loads(rest[-2])["error"]["message"], rest[-3:]
        queued.join(10)
        for t in server.threads:
            t.join(10)
        assert waiting["answer"][0] == 503 and "stopped by SIGTERM" in waiting["answer"][1]["error"]["message"]
        assert isinstance(server.outcome[0], Interrupted) and server.outcome[1] is None
    run_dir, = tmp_path.iterdir()
    spans = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert {(e["args"]["slot"], e["args"]["request"]) for e in spans if e["name"] == "round"} in ({(0, 0), (1, 1)},
                                                                                                {(0, 1), (1, 0)})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert max(e.value for e in events.Scalars("serve/slots_in_use")) == 2
    assert sorted(e.value for e in events.Scalars("request/slot")) == [0, 1]
