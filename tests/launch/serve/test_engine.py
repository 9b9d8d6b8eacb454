"""Issue 28: the server's engine keeps up to session.slots requests live at once. Its bookkeeping (which job a
stream that ended belongs to, who gets the error when the link breaks or a signal comes, who waits) against
a scripted stand-in for the Session: no model, no HTTP, milliseconds. The served tests (test_concurrency.py)
run the real Session."""
import threading
import time
from types import SimpleNamespace

import pytest

from launch.config import load_config
from launch.serve import engine as engine_module
from launch.serve.engine import Engine, Job
from launch.serve.fields import Prompt
from netbridge.protocol import SamplingParams
from speculative.rounds import Generation, RoundRecord


class ScriptedSession:
    """The Session's interface for the server: each tick gives every live stream that is not cancelled one
    token (its prompt's first id x 100 + its position), then ends the streams done or cancelled."""

    def __init__(self, slots: int, fail_at_tick: int | None = None):
        self.slots, self.fail_at_tick = slots, fail_at_tick
        self.live, self.ticks, self.most_live, self.closed = [], 0, 0, False
        self.coming = []  # per admission: (its prompt's first id, the lengths of the prompts admitted right after)
        self.ticked = threading.Event()
        self.warmed = []  # (the thread, how many admitted then), per warm-up

    def warm_up(self) -> None:
        self.warmed.append((threading.current_thread().name, len(self.coming)))

    def free(self) -> int:
        return self.slots - len(self.live)

    def admit(self, ids, output, request, on_round=None, cancelled=lambda: False, coming=()):
        self.coming.append((ids[0], coming))
        if not self.free():
            raise RuntimeError("admitted with no slot free")
        slot = min(set(range(self.slots)) - {s.slot for s in self.live})
        stream = SimpleNamespace(gen=Generation(ids, output), slot=slot, on_round=on_round, cancelled=cancelled)
        self.live.append(stream)
        self.most_live = max(self.most_live, len(self.live))
        return stream

    def tick(self):
        self.ticks += 1
        self.ticked.set()
        if self.ticks == self.fail_at_tick:
            raise ConnectionError("lost the other rank")
        time.sleep(0.002)
        ended = []
        for s in list(self.live):
            if not s.cancelled():
                s.gen.output.commit([s.gen.prompt_ids[0] * 100 + len(s.gen.output.tokens)])
                record = RoundRecord(0, 0, 1, 0.0, 0.0, 1.0, 0.5)
                s.gen.rounds.append(record)
                s.on_round(record, SimpleNamespace(marks=[], middle_marks=None))
            if s.gen.output.done or s.cancelled():
                self.live.remove(s)
                ended.append(s)
        return ended

    def idle(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Events:
    """Job.emit's event loop, recording what the engine sends back."""

    def __init__(self):
        self.got = []

    def call_soon_threadsafe(self, put, event) -> None:
        self.got.append(event)

    def last(self, timeout_s: float = 5.0):
        deadline = time.monotonic() + timeout_s
        while not self.got or self.got[-1][0] not in ("done", "error"):
            assert time.monotonic() < deadline, self.got
            time.sleep(0.001)
        return self.got[-1]


def job(first_id: int, max_tokens: int) -> Job:
    return Job(Prompt([first_id, 1, 2], max_tokens, SamplingParams(), [], False), Events(), time.perf_counter())


def engine(session, max_queue: int = 8) -> Engine:
    cfg = load_config(["serve.port=1", f"serve.max_queue={max_queue}", "spec.k=0"])
    return Engine(cfg, session, None, set())


def expected(first_id: int, n: int) -> list[int]:
    return [first_id * 100 + i for i in range(n)]


def test_jobs_beyond_the_slots_wait_and_each_gets_its_own_answer():
    session = ScriptedSession(slots=2)
    e = engine(session)
    jobs = [job(1, 5), job(2, 2), job(3, 4)]
    for j in jobs:
        e.submit(j)
    e.thread.start()
    answers = [j.loop.last() for j in jobs]
    e.stop()
    assert session.most_live == 2 and session.closed
    for j, (kind, done) in zip(jobs, answers):
        assert kind == "done" and done["token_ids"] == expected(j.prompt.ids[0], j.prompt.max_tokens)
        assert done["finish_reason"] == "length" and done["stats"]["tokens"] == j.prompt.max_tokens  # when it was sent
    third = answers[2][1]["stats"]
    assert third["slot"] == 1 and third["queue_s"] > 0  # it waited for the second's slot
    assert e.served == 3 and e.cancelled == 0 and not e.live
    # the caches warmed once, on the engine's thread (its heap is the one requests use), before any admission
    assert session.warmed == [("tandem-engine", 0)]


def test_a_cancelled_job_frees_its_slot_for_a_waiting_one():
    session = ScriptedSession(slots=2)
    e = engine(session)
    long, other, waiting = job(1, 10**6), job(2, 10**6), job(3, 3)
    for j in (long, other, waiting):
        e.submit(j)
    e.thread.start()
    session.ticked.wait(5)
    long.cancelled.set()  # its client went away
    assert waiting.loop.last()[1]["token_ids"] == expected(3, 3)
    assert long.loop.last()[0] == "done" and e.cancelled == 1
    other.cancelled.set()
    e.stop()
    assert e.served == 3 and e.cancelled == 2


def test_a_broken_link_fails_every_live_job_and_the_waiting_ones():
    session = ScriptedSession(slots=2, fail_at_tick=3)
    e = engine(session)
    stopped = threading.Event()
    e.on_fatal = stopped.set
    jobs = [job(1, 100), job(2, 100), job(3, 100)]
    for j in jobs:
        e.submit(j)
    e.thread.start()
    assert stopped.wait(5)
    for j in jobs[:2]:
        kind, error = j.loop.last()
        assert kind == "error" and error.status == 503 and "generation failed: lost the other rank" in str(error)
    kind, error = jobs[2].loop.last()
    assert kind == "error" and error.status == 503 and "lost the other rank" in str(error)
    assert isinstance(e.fatal, ConnectionError) and not e.live
    with pytest.raises(Exception, match="the server is stopping"):
        e.submit(job(4, 1))


def test_a_signal_fails_every_live_job_then_the_engine_says_bye():
    session = ScriptedSession(slots=2)
    e = engine(session)
    jobs = [job(1, 10**6), job(2, 10**6), job(3, 1)]
    for j in jobs:
        e.submit(j)
    e.thread.start()
    session.ticked.wait(5)
    e.interrupt("stopped by SIGTERM")
    for j in jobs:  # the two live ones and the one waiting
        kind, error = j.loop.last()
        assert kind == "error" and error.status == 503 and "stopped by SIGTERM" in str(error)
    assert all(j.cancelled.is_set() for j in jobs[:2])
    e.stop()  # the live ones end (cancelled) at the next tick, then Bye
    assert session.closed and not session.live and not e.thread.is_alive()


def test_beyond_the_free_slots_and_max_queue_is_a_429():
    e = engine(ScriptedSession(slots=2), max_queue=2)
    for i in range(4):  # two for the free slots (the engine takes them at its next turn), two waiting
        e.submit(job(i, 1))
    with pytest.raises(Exception) as refused:
        e.submit(job(5, 1))
    assert refused.value.status == 429 and "serve.max_queue" in str(refused.value)


def test_the_predicted_ttft_counts_the_wait_for_a_slot_as_the_measured_one_does():
    """The cost model predicts a TTFT from admission; a job that waited for a slot has that wait (measured) in both
    its TTFT and its predicted TTFT, so the two count from its arrival alike. No prediction (0) stays 0."""
    class Predicting(ScriptedSession):
        def admit(self, ids, *args, **kwargs):
            stream = super().admit(ids, *args, **kwargs)
            stream.gen.predicted_ttft_s = 0.05 if ids[0] != 9 else 0.0
            return stream
    session = Predicting(slots=1)
    e = engine(session)
    jobs = [job(1, 3), job(2, 2), job(9, 2)]
    for j in jobs:
        e.submit(j)
    e.thread.start()
    stats = [j.loop.last()[1]["stats"] for j in jobs]
    e.stop()
    assert stats[1]["queue_s"] > 0.004  # it waited for the first's three ticks of 2 ms
    for s in stats[:2]:
        assert s["predicted_ttft_s"] == pytest.approx(0.05 + s["queue_s"])
    assert stats[2]["predicted_ttft_s"] == 0.0


def test_the_predicted_ttft_counts_the_wait_for_requests_right_behind(monkeypatch):
    """A lone request to an idle engine waits BURST_S for others before its admission (measured, like the wait
    for a slot, in its queue_s): its predicted TTFT has that wait too."""
    monkeypatch.setattr(engine_module, "BURST_S", 0.05)

    class Predicting(ScriptedSession):
        def admit(self, ids, *args, **kwargs):
            stream = super().admit(ids, *args, **kwargs)
            stream.gen.predicted_ttft_s = 0.01
            return stream
    e = engine(Predicting(slots=2))
    alone = job(1, 2)
    e.submit(alone)
    e.thread.start()
    stats = alone.loop.last()[1]["stats"]
    e.stop()
    assert 0.045 <= stats["queue_s"] < 0.5
    assert stats["predicted_ttft_s"] == pytest.approx(0.01 + stats["queue_s"])


def test_requests_arriving_together_are_admitted_before_the_first_tick(monkeypatch):
    """Clients sent together reach the queue a few ms apart: an idle engine that took the first waits briefly for
    the ones right behind it, so their first rounds go out together (one who missed the first tick waited a round
    trip). One arriving well after is admitted at a later tick; the running ones are not held for it. (Windows
    wider than the engine's, so that a loaded host cannot make the test flaky.)"""
    monkeypatch.setattr(engine_module, "BURST_S", 0.1)
    monkeypatch.setattr(engine_module, "BURST_MOST_S", 0.3)
    session = ScriptedSession(slots=4)
    live_at_tick = []
    tick = session.tick
    session.tick = lambda: (live_at_tick.append(len(session.live)), tick())[1]
    e = engine(session)
    first, behind, late = job(1, 40), [job(2, 40), job(3, 40)], job(4, 3)
    e.submit(first)
    e.thread.start()
    time.sleep(0.004)
    for j in behind:
        e.submit(j)
    for _ in range(500):  # bounded: until the first ticks ran
        if len(live_at_tick) >= 3:
            break
        time.sleep(0.002)
    e.submit(late)
    assert late.loop.last()[1]["token_ids"] == expected(4, 3)
    e.stop()
    assert live_at_tick[0] == 3 and max(live_at_tick) == 4
    # gathered before any was admitted: each admission knew the prompts behind it (their K is chosen for the burst)
    assert session.coming == [(1, (3, 3)), (2, (3,)), (3, ()), (4, ())]  # (each prompt 3 tokens)


def test_a_request_gathered_when_the_server_stops_gets_the_error(monkeypatch):
    """stop() while an idle engine waits for requests right behind its first: the one it holds (off the queue, not
    yet admitted) gets the shutdown error, as the waiting ones do, and the engine ends."""
    monkeypatch.setattr(engine_module, "BURST_S", 5.0)
    monkeypatch.setattr(engine_module, "BURST_MOST_S", 5.0)
    session = ScriptedSession(slots=2)
    e = engine(session)
    held = job(1, 3)
    e.submit(held)
    e.thread.start()
    for _ in range(500):  # bounded: until the engine took it off the queue
        if e.jobs.qsize() == 0:
            break
        time.sleep(0.002)
    e.stop()
    kind, value = held.loop.last()
    assert kind == "error" and "shutting down" in str(value) and session.coming == []
    assert not e.thread.is_alive()
