"""The engine: one thread owns the channel and the caches, and ticks the Session (speculative.session).

It admits up to session.slots requests at once (serve.max_concurrent), each into a slot of its own on every rank
(the free one holding the longest prefix of its prompt, else the least recently used), and lets the Session
interleave their rounds (round-robin); the rest wait in arrival order, up to serve.max_queue (a 429 beyond).
Text goes back to each request's event loop (its Job's events) as its rounds commit; a client that goes away
sets a flag the Session reads between rounds, and its slot is free at once. When a later rank is lost, every
live request gets a 503 naming the cause and the server stops (launch/serve/server.py raises it).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from launch.config import TandemConfig
from launch.serve.errors import ApiError, FieldError
from launch.serve.fields import Prompt
from launch.serve.structured import grammar_failed
from speculative.output import Output
from speculative.stats import summarize

FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}
SHUTTING_DOWN = "the server is shutting down"  # stop()'s cause, in the error of each request it leaves unrun
BURST_S, BURST_MOST_S = 0.015, 0.06  # an idle engine's first request waits for others arriving with it (_burst)


@dataclass
class Job:
    """One queued request and the way back to its HTTP handler."""
    prompt: Prompt
    loop: asyncio.AbstractEventLoop
    arrived: float = 0.0  # time.perf_counter() when the request arrived: ttft_ms counts from here
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokenizer: object = None  # writes logprobs' tokens as text (launch/serve/structured.py)

    def emit(self, kind: str, value) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: the server stopped and nobody is listening
            pass


@dataclass
class Running:
    """A job being generated: its Output, its stream in the Session, and what its client has had so far."""
    job: Job
    output: Output
    serial: int  # the order of admission: telemetry keys this request's rounds by it
    admitted: float = field(default_factory=time.perf_counter)
    stream: object = None  # the Session's stream (stream.gen, stream.slot) once admitted
    sent: str = ""  # the visible text sent so far
    reported: int = 0  # the tokens whose logprobs were sent so far

    def relay(self) -> None:
        """After one of its rounds: the text and logprobs that round added, to the client. With logprobs, the text
        goes out in whole tokens, each token's logprobs just before its text: the form sends both in one chunk."""
        p, output = self.job.prompt, self.output
        text = visible_text(output.text(), p.stop, output.done)
        scored = len(output.logprobs)
        if p.stream and p.params.logprobs is not None and not output.done:  # at the end: the rest, whatever it is
            scored, text = self.whole_tokens(text)
        if scored > self.reported:  # the new tokens' (tokens, rows)
            self.job.emit("logprobs", (output.tokens[self.reported:scored], output.logprobs[self.reported:scored]))
            self.reported = scored
        if len(text) > len(self.sent):
            self.job.emit("text", text[len(self.sent):])
            self.sent = text

    def whole_tokens(self, visible: str) -> tuple[int, str]:
        """The most tokens whose text lies whole within `visible` (what the client may see now), and that text."""
        output, best = self.output, (self.reported, self.sent)
        if output.tokenizer is None:
            return len(output.logprobs), visible
        for n in range(self.reported + 1, len(output.logprobs) + 1):  # a round's few new tokens
            end = output.text_end(n)  # the length of their text; None: the n-th ends within a character
            if end is not None and end <= len(visible):  # `visible` is a prefix of the text
                best = n, visible[:end]
        return best

    def fail(self, message: str) -> None:
        self.job.cancelled.set()
        self.job.emit("error", ApiError(503, message, "server_error"))


class Engine:
    """The one thread that talks to the later ranks: up to session.slots requests live at once, each in its
    own slot, their rounds interleaved by the Session; the rest wait in arrival order (serve.max_queue)."""

    def __init__(self, cfg: TandemConfig, session, tokenizer, eos_ids: set[int], telemetry=None):
        self.cfg, self.session, self.tokenizer, self.eos_ids = cfg, session, tokenizer, eos_ids
        self.telemetry = telemetry
        self.jobs: queue.Queue[Job | None] = queue.Queue()  # waiting for a slot; None: stop
        self.idle_s = max(0.5, cfg.transport.timeout_s / 4)  # the later ranks' receives time out after timeout_s
        self.fatal: BaseException | None = None  # a later rank lost: the server stops and the entry reports it
        self.on_fatal = lambda: None
        self.live: list[Running] = []  # admitted and not ended; changed under `lock`, read anywhere
        self.lock = threading.Lock()  # admission against interrupt(): no job slips between them unfailed
        self.stopping: str | None = None  # a signal's cause: every request ends now with it
        self.closing = False  # stop(): nothing more is admitted; once the live ones have ended, Bye
        self.admitted = self.served = 0
        self.cancelled = 0  # requests whose client went away before the end
        self.thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)

    def submit(self, job: Job) -> None:
        if self.fatal is not None or self.stopping is not None:
            raise ApiError(503, f"the server is stopping: {self.fatal or self.stopping}", "server_error")
        if self.jobs.qsize() >= self.cfg.serve.max_queue + self.session.slots - len(self.live):
            # a free slot takes a job at the engine's next turn: a burst of as many is not refused. (Only the
            # event loop's thread submits; a job taken off the queue but not yet live may let one more wait.)
            raise ApiError(429, f"{self.cfg.serve.max_queue} requests are already waiting (serve.max_queue); retry later",
                           "rate_limit_exceeded")
        self.jobs.put_nowait(job)

    def stop(self) -> None:
        """Cancel the live requests (each ends at its next round), drop the waiting ones, say Bye."""
        for running in list(self.live):
            running.job.cancelled.set()
        self._fail_waiting(RuntimeError(SHUTTING_DOWN))
        self.jobs.put(None)
        self.thread.join()

    def interrupt(self, cause: str) -> None:
        """A signal: every live request ends at once with an error (a stream gets an error event, then [DONE])
        and stops at its next round; the waiting ones get the error too."""
        with self.lock:
            self.stopping = cause
            live = list(self.live)
        for running in live:
            running.fail(f"the server is stopping: {cause}")
        self._fail_waiting(RuntimeError(cause))

    # --- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.session.warm_up()  # on this thread: its heap is the one requests use
            while self.live or not self.closing:
                self._admit_waiting()
                if self.live:
                    self._finish(self.session.tick())
            self.session.close()
        except Exception as e:  # noqa: BLE001 - the peer is gone or the link broke: stop serving
            self.fatal = e
            with self.lock:
                live, self.live = self.live, []
            for running in live:
                running.fail(f"generation failed: {e}")
            self._fail_waiting(e)
            self.on_fatal()

    def _admit_waiting(self) -> None:
        """Admit waiting jobs while a slot is free: with none live, a burst (_burst) together, each knowing the
        prompts behind it; else those already waiting."""
        burst = [] if self.live else self._burst()
        for i, job in enumerate(burst):
            self._admit(job, coming=tuple(len(j.prompt.ids) for j in burst[i + 1:]))
        while not self.closing and self.session.free() > 0:
            job = self._next_job(wait=False)
            if job is None:
                return
            self._admit(job)

    def _burst(self) -> list[Job]:
        """An idle engine's next jobs: wait for one (saying Idle meanwhile, which keeps the later ranks' receives
        from timing out), then for the ones right behind it, before admitting any. Requests sent together reach the
        queue a few ms apart: admitted together, their first rounds go out as one batch (one that missed the first
        tick waited a whole round trip, ~0.9 s at 40 ms), and each one's K is chosen knowing the others
        (spec.k_from_costs: four 2,000-token prompts each admitted as if alone drafted, every prompt through the
        drafter first, and their first tokens came 4x later than at K=0). Each waits BURST_S for the next,
        BURST_MOST_S in all: what a lone request's first token pays (in its queue_s)."""
        job = self._next_job(wait=True)
        burst, until = ([] if job is None else [job]), time.perf_counter() + BURST_MOST_S
        while burst and not self.closing and len(burst) < self.session.free():
            within = until - time.perf_counter()
            job = self._next_job(wait=False, within=min(BURST_S, within)) if within > 0 else None
            if job is None:
                break
            burst.append(job)
        if self.closing:  # stop() came while gathering: these left the queue before its _fail_waiting
            for job in burst:
                refuse(job, SHUTTING_DOWN)
            return []
        return burst

    def _next_job(self, wait: bool, within: float = 0.0) -> Job | None:
        """The next job: waiting for one (`wait`), or for at most `within` seconds, or only one already there."""
        try:
            if wait:
                job = self.jobs.get(timeout=self.idle_s)
            else:
                job = self.jobs.get(timeout=within) if within > 0 else self.jobs.get_nowait()
        except queue.Empty:
            if wait:
                self.session.idle()
            return None
        if job is None:  # stop(): the live ones end (cancelled), then Bye
            self.closing = True
        return None if job is None or job.cancelled.is_set() else job

    def _admit(self, job: Job, coming: tuple[int, ...] = ()) -> None:
        """`job` live in a slot; `coming`: the prompts' lengths of the jobs admitted right after it (its burst)."""
        p = job.prompt
        running = Running(job, Output(self.tokenizer, self.eos_ids, p.max_tokens, p.stop), self.admitted)
        with self.lock:
            if self.stopping is not None:  # interrupt() ran since this job was taken off the queue
                running.fail(f"the server is stopping: {self.stopping}")
                return
            self.live.append(running)
        self.admitted += 1

        def on_round(record, reply) -> None:
            if self.telemetry is not None:
                self.telemetry.on_round(record, reply, running.serial, len(self.live), self.jobs.qsize())
            running.relay()
        # an exception (the link broke) fails every live job, this one included: it is in self.live
        running.stream = self.session.admit(p.ids, running.output, p.params, on_round=on_round,
                                            cancelled=job.cancelled.is_set, coming=coming)

    def _finish(self, ended) -> None:
        """The streams that ended in a tick: each job's last event, with its figures."""
        for stream in ended:
            running = next(r for r in self.live if r.stream is stream)
            with self.lock:
                self.live.remove(running)
            if stream.gen.error is not None:  # its grammar failed on the last rank: this request alone ends, in error
                message, param = grammar_failed(running.job.prompt.tools, stream.gen.error)
                running.job.emit("error", FieldError(message, param))
                continue
            self._done(running)

    def _done(self, running: Running) -> None:
        job, gen, p = running.job, running.stream.gen, running.job.prompt
        stats = summarize(gen, self.cfg.spec.k, self.cfg.draft.kind if self.cfg.spec.k else "none")
        stats["prompt_tokens_reused"] = gen.reused
        stats["prefilled_tokens"] = len(p.ids) - gen.reused
        stats["queue_s"] = running.admitted - job.arrived  # parsing, tokenizing and waiting for a slot
        stats["ttft_s"] += stats["queue_s"]  # as the client sees it: from the request's arrival
        if stats["predicted_ttft_s"]:  # the cost model's counts from admission; the wait before it is measured
            stats["predicted_ttft_s"] += stats["queue_s"]
        stats["slot"] = running.stream.slot
        if self.telemetry is not None:
            self.telemetry.on_request(stats, self.served, running.serial, gen)
        self.served += 1
        self.cancelled += job.cancelled.is_set() and not running.output.done
        output = running.output
        job.emit("done", {"text": visible_text(output.text(), p.stop, True), "token_ids": output.tokens,
                          "finish_reason": FINISH.get(output.stop_reason, "stop"), "stats": stats,
                          "logprobs": (output.tokens, output.logprobs) if p.params.logprobs is not None else None})

    def _fail_waiting(self, cause: BaseException) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                refuse(job, cause)


def refuse(job: Job, cause) -> None:
    """A job that will not run: the server is stopping, for `cause`."""
    job.emit("error", ApiError(503, f"the server is stopping: {cause}", "server_error"))


def visible_text(text: str | None, stops: list[str], done: bool) -> str:
    """What a client may see of the output so far: OpenAI leaves a stop string out of the answer, so the
    text is cut at the first one; until the end, a tail that could begin one (or half a character) waits."""
    text = text or ""
    cuts = [text.find(s) for s in stops if s in text]
    if cuts:
        return text[:min(cuts)]
    if done:
        return text
    hold = max((len(s) - 1 for s in stops), default=0)
    text = text[:len(text) - hold] if hold else text
    return text.rstrip("\ufffd")
