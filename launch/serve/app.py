"""serve.port=PORT: rank 0 answers an OpenAI-compatible HTTP API; rank 1 serves rounds as always.

    POST /v1/chat/completions   POST /v1/completions   (stream=true: server-sent events, then [DONE])
    POST /v1/responses          (stream=true: the Responses API's typed events)
    GET  /v1/models             GET  /v1/models/{id}        GET  /health

What each accepts and refuses (launch/api.py's field table) is in docs/api.md.

The HTTP side (FastAPI on uvicorn, in the main thread so it owns SIGINT/SIGTERM) only parses and
queues: a body over serve.max_body_bytes is refused (413) before it is read, and parsing and
tokenizing run in worker threads, so /health and other clients never wait on one request. One engine
thread owns the channel and the caches: it admits up to session.slots requests at once (serve.max_concurrent),
each into a slot of its own on every rank (the free one holding the longest prefix of its prompt, else the
least recently used), and lets the Session interleave their rounds (round-robin); the rest wait in arrival
order, up to serve.max_queue (a 429 beyond). Text goes back to each request's event loop as its rounds
commit; a client that goes away sets a flag the Session reads between rounds, and its slot is free at once.
When a later rank is lost, every live request gets a 503 naming the cause and the server stops; `serve`
then raises, and the entry reports one line and exits non-zero.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from launch.api import ApiError, Prompt, parse_chat, parse_completion, tandem_fields, usage, visible_text
from launch.responses import ResponsesForm, parse_responses
from launch.structured import chat_logprobs, completion_logprobs, grammar_failed
from launch.tools import finish_reason
from launch.build import CapacityError, check_capacity, check_ids, output_room
from launch.config import TandemConfig
from speculative.output import Output
from speculative.stats import summarize

FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


@dataclass
class Job:
    """One queued request and the way back to its HTTP handler."""
    prompt: Prompt
    loop: asyncio.AbstractEventLoop
    arrived: float = 0.0  # time.perf_counter() when the request arrived: ttft_ms counts from here
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokenizer: object = None  # writes logprobs' tokens as text (launch.structured)

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
        if p.stream and p.request.logprobs is not None and not output.done:  # at the end: the rest, whatever it is
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
        self._fail_waiting(RuntimeError("the server is shutting down"))
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
        """Admit waiting jobs while a slot is free. With none live, wait for one (saying Idle meanwhile,
        which keeps the later ranks' receives from timing out)."""
        while not self.closing and self.session.free() > 0:
            job = self._next_job(wait=not self.live)
            if job is None:
                return
            self._admit(job)

    def _next_job(self, wait: bool) -> Job | None:
        try:
            job = self.jobs.get(timeout=self.idle_s) if wait else self.jobs.get_nowait()
        except queue.Empty:
            if wait:
                self.session.idle()
            return None
        if job is None:  # stop(): the live ones end (cancelled), then Bye
            self.closing = True
        return None if job is None or job.cancelled.is_set() else job

    def _admit(self, job: Job) -> None:
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
        running.stream = self.session.admit(p.ids, running.output, p.request, on_round=on_round,
                                            cancelled=job.cancelled.is_set)

    def _finish(self, ended) -> None:
        """The streams that ended in a tick: each job's last event, with its figures."""
        for stream in ended:
            running = next(r for r in self.live if r.stream is stream)
            with self.lock:
                self.live.remove(running)
            if stream.gen.error is not None:  # its grammar failed on the last rank: this request alone ends, in error
                message, param = grammar_failed(running.job.prompt.tools, stream.gen.error)
                running.job.emit("error", ApiError(400, message, param=param))
                continue
            self._done(running)

    def _done(self, running: Running) -> None:
        job, gen, p = running.job, running.stream.gen, running.job.prompt
        stats = summarize(gen, self.cfg.spec.k, self.cfg.draft.kind if self.cfg.spec.k else "none")
        stats["prompt_tokens_reused"] = gen.reused
        stats["prefilled_tokens"] = len(p.ids) - gen.reused
        stats["queue_s"] = running.admitted - job.arrived  # parsing, tokenizing and waiting for a slot
        stats["ttft_s"] += stats["queue_s"]  # as the client sees it: from the request's arrival
        stats["slot"] = running.stream.slot
        if self.telemetry is not None:
            self.telemetry.on_request(stats, self.served, running.serial, gen)
        self.served += 1
        self.cancelled += job.cancelled.is_set() and not running.output.done
        output = running.output
        job.emit("done", {"text": visible_text(output.text(), p.stop, True), "token_ids": output.tokens,
                          "finish_reason": FINISH.get(output.stop_reason, "stop"), "stats": stats,
                          "logprobs": (output.tokens, output.logprobs) if p.request.logprobs is not None else None})

    def _fail_waiting(self, cause: BaseException) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit("error", ApiError(503, f"the server is stopping: {cause}", "server_error"))


def build_app(cfg: TandemConfig, engine: Engine, tokenizer, vocab_size: int, model_name: str, api_key: str | None = None):
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(http: HttpRequest, e: HTTPException):
        """The router's own answers (an unknown route, a wrong method) in OpenAI's error shape, not {"detail"}."""
        return JSONResponse(route_error(http.method, http.url.path, e).body(), status_code=e.status_code,
                            headers=e.headers)

    if api_key is not None:
        expected = api_key.encode()

        @app.middleware("http")
        async def authenticate(http: HttpRequest, call_next):  # before the body is read
            scheme, _, given = http.headers.get("authorization", "").encode("latin-1", "replace").partition(b" ")
            # the scheme is case-insensitive (RFC 7235: "bearer" is Bearer); the key compares in constant time
            if http.url.path == "/health" or (scheme.lower() == b"bearer" and hmac.compare_digest(given, expected)):
                return await call_next(http)
            e = ApiError(401, "a valid API key is required: send Authorization: Bearer KEY (the key in the server's "
                              "serve.api_key_file)", code="invalid_api_key")
            return JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health():
        if engine.fatal is not None:
            raise ApiError(503, str(engine.fatal), "server_error")
        return {"status": "ok", "served": engine.served, "cancelled": engine.cancelled, "waiting": engine.jobs.qsize(),
                "live": len(engine.live), "slots": engine.session.slots}

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "tandem"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")  # a Hub id has a slash (the openai client sends it as %2F: decoded here)
    async def model(model: str):
        if model != model_name:
            raise ApiError(404, f"the model {model[:100]!r} does not exist; this server serves {model_name!r}",
                           code="model_not_found")
        return card

    def parse_and_check(raw: bytes, parse, field: str) -> Prompt:  # in a worker thread: tokenizing may take a while
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON") from None
        prompt = parse(body, tokenizer, cfg, model_name)
        check_prompt(cfg, prompt, vocab_size, field)
        return prompt

    async def handle(http: HttpRequest, parse, form, field: str):
        """`field`: the body's field that holds the prompt (a prompt too long is a 400 naming it)."""
        arrived = time.perf_counter()
        raw = await read_body(http, cfg.serve.max_body_bytes)
        prompt = await asyncio.to_thread(parse_and_check, raw, parse, field)
        job = Job(prompt, asyncio.get_running_loop(), arrived, tokenizer=tokenizer)
        engine.submit(job)
        if prompt.stream:
            return StreamingResponse(stream(job, form(job, model_name)), media_type="text/event-stream")
        return await complete(http, job, form(job, model_name))

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        return await handle(http, parse_chat, ChatForm, "messages")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await handle(http, parse_completion, CompletionForm, "prompt")

    @app.post("/v1/responses")
    async def responses(http: HttpRequest):
        return await handle(http, parse_responses, ResponsesForm, "input")

    return app


HEADER_TIMEOUT_S = 10.0  # a request's headers must arrive within this (slowloris: half-sent requests held open)
BODY_TIMEOUT_S = 30.0  # and its body within this once the headers are in (a 408 after)
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection is closed after this
DRAIN_BYTES = 16 * 2**20  # of a refused body, read and dropped so the client can read its 413


def headers_within_timeout():
    """uvicorn's h11 protocol, closing a connection whose request headers have not all come within
    HEADER_TIMEOUT_S of its opening or of its last response (uvicorn itself waits for them forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadersWithinTimeout(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

        def _headers_late(self) -> None:
            if self.cycle is None or self.cycle.response_complete:  # no request under way: its headers are late
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._header_timer.cancel()  # the headers are in; the body has its own timeout (read_body)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_timer.cancel()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return HeadersWithinTimeout


async def read_body(http: HttpRequest, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed `limit` (its Content-Length, or
    the bytes received so far when it comes chunked)."""
    too_big = ApiError(413, f"the request body exceeds serve.max_body_bytes={limit}", param=None,
                       code="request_too_large")
    declared = http.headers.get("content-length", "0")
    if not declared.isdigit():
        raise ApiError(400, "Content-Length is not a number")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            if int(declared) > limit:
                await drain(http, DRAIN_BYTES)
                raise too_big
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    await drain(http, DRAIN_BYTES)
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s", code="request_timeout") from None
    return b"".join(chunks)


async def drain(http: HttpRequest, most: int) -> None:
    """Read and drop up to `most` bytes of a refused body: a server that closes while the client still sends
    makes the kernel reset the connection, and the client sees the reset instead of the 413."""
    dropped = 0
    async for chunk in http.stream():
        dropped += len(chunk)
        if dropped > most:
            return


def check_prompt(cfg: TandemConfig, prompt: Prompt, vocab_size: int, field: str = "prompt") -> None:
    """Refuse what cannot be served before it is queued; an absent max_tokens becomes what fits. `field`: the
    body's field the prompt came in (OpenAI names it in context_length_exceeded: messages on chat)."""
    try:
        check_ids(prompt.ids, vocab_size)
        if prompt.max_tokens is None:
            prompt.max_tokens = max(1, min(cfg.gen.max_new_tokens, output_room(cfg, len(prompt.ids))[0]))
        check_capacity(cfg, len(prompt.ids), prompt.max_tokens)
    except CapacityError as e:
        raise ApiError(400, f"{e} (prompt + max_tokens must fit)", param=field, code="context_length_exceeded") from None
    except ValueError as e:
        raise ApiError(400, str(e), param=field) from None


def route_error(method: str, path: str, e: HTTPException) -> ApiError:
    """An unknown route (404) or a wrong method (405) as OpenAI answers them."""
    where = f"{method} {path[:200]}"
    if e.status_code == 404:
        return ApiError(404, f"Unknown request URL: {where}; the endpoints are in docs/api.md", code="unknown_url")
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "another method")
        return ApiError(405, f"{where} is not allowed: this route takes {allowed}", code="method_not_allowed")
    return ApiError(e.status_code, f"{where}: {e.detail}", "invalid_request_error" if e.status_code < 500 else "server_error")


async def complete(http, job: Job, form) -> dict:
    """A non-streamed answer: wait for it, cancelling the job if the client leaves meanwhile."""
    try:
        while True:
            try:
                what, value = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise ApiError(499, "client closed the request") from None
                continue
            if what == "error":
                raise value
            if what == "done":
                return form.answer(value)
    finally:
        job.cancelled.set()  # a no-op when done; otherwise the client left or the server is stopping


async def stream(job: Job, form):
    """Server-sent events as rounds commit (what `form` makes of each); closing the connection cancels the job."""
    try:
        for event in form.start():
            yield event
        while True:
            what, value = await job.events.get()
            for event in getattr(form, what)(value):  # form.text / form.logprobs / form.done / form.error
                yield event
            if what in ("done", "error"):
                break
        for event in form.end():
            yield event
    finally:
        job.cancelled.set()  # the client went away (or we are done): the round loop stops at the next round


def sse(body: dict, event: str | None = None) -> str:
    return (f"event: {event}\n" if event else "") + f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class CompletionForm:
    """/v1/completions: a text_completion, or text_completion chunks then [DONE]."""
    OPEN = {"text": ""}  # a streamed choice's empty form

    def __init__(self, job: Job, model: str):
        self.job, self.model, self.id, self.created = job, model, f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        self.offset = 0  # streamed logprobs: where the next token's text starts in the answer
        self.scored: list[tuple] = []  # streamed logprobs that go out with the next text: (tokens, rows) per event

    def body(self, choice: dict, **extra) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "logprobs": None, **choice}], **extra}

    def chunk(self, choice: dict, **extra) -> str:
        """One streamed chunk. With stream_options.include_usage each has `usage`, null until the last (OpenAI's)."""
        if self.job.prompt.include_usage:
            extra = {"usage": None, **extra}
        return sse(self.body(choice, **extra))

    def answer(self, done: dict) -> dict:
        logprobs = done.get("logprobs") and completion_logprobs(self.job.tokenizer, *done["logprobs"])
        return self.body({"text": done["text"], "finish_reason": done["finish_reason"], "logprobs": logprobs},
                         usage=usage(self.job.prompt, done), tandem=tandem_fields(done))

    def logprobs(self, value) -> list[str]:
        """Streamed: the log-probabilities of the tokens whose text comes next (Running.relay); they go with it."""
        self.scored.append(value)
        return []

    def take_logprobs(self) -> dict | None:
        """The waiting logprobs, written for this endpoint (None when none wait)."""
        if not self.scored:
            return None
        tokens = [t for ts, _ in self.scored for t in ts]
        rows = [r for _, rs in self.scored for r in rs]
        self.scored = []
        return self.write_logprobs(tokens, rows)

    def write_logprobs(self, tokens, rows) -> dict:
        logprobs = completion_logprobs(self.job.tokenizer, tokens, rows, offset=self.offset)
        self.offset += sum(map(len, logprobs["tokens"]))
        return logprobs

    def start(self) -> list[str]:
        return []

    def text(self, delta: str) -> list[str]:
        return [self.chunk({"text": delta, "logprobs": self.take_logprobs(), "finish_reason": None})]

    def last(self, done: dict) -> dict:
        """Beside finish_reason: the usage (unless it comes in a chunk of its own) and Tandem's figures."""
        return {"usage": None if self.job.prompt.include_usage else usage(self.job.prompt, done),
                "tandem": tandem_fields(done)}

    def usage_chunk(self, done: dict) -> list[str]:
        """stream_options.include_usage: after the last choice, a chunk with `choices: []` and the usage."""
        if not self.job.prompt.include_usage:
            return []
        return [sse({**self.body(self.OPEN, usage=usage(self.job.prompt, done)), "choices": []})]

    def done(self, done: dict) -> list[str]:
        # logprobs still waiting: tokens with no text of their own (a stop string's, one that ends the answer)
        return [self.chunk({"text": "", "logprobs": self.take_logprobs(), "finish_reason": done["finish_reason"]},
                           **self.last(done))] + self.usage_chunk(done)

    def error(self, e: ApiError) -> list[str]:
        return [sse(e.body())]

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]


class ChatForm(CompletionForm):
    """/v1/chat/completions: a chat.completion, or chat.completion.chunk deltas then [DONE]. With tools (auto),
    the calls are read out of the text as it streams and sent as tool_calls (finish_reason tool_calls)."""
    OPEN = {"delta": {}}

    def __init__(self, job: Job, model: str):
        super().__init__(job, model)
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        tools = job.prompt.tools
        self.calls = tools.parser() if tools is not None and tools.parse else None

    def body(self, choice: dict, **extra) -> dict:
        streamed = "delta" in choice
        return {"id": self.id, "object": "chat.completion.chunk" if streamed else "chat.completion",
                "created": self.created, "model": self.model, "choices": [{"index": 0, "logprobs": None, **choice}],
                **extra}

    def finish_reason(self, done: dict) -> str:
        return finish_reason(self.calls, done["finish_reason"])

    def answer(self, done: dict) -> dict:
        message = {"role": "assistant", "content": done["text"]}
        if self.calls is not None:
            items = self.calls.feed(done["text"]) + self.calls.finish()
            calls = [item.openai() for kind, item in items if kind == "call"]
            message["content"] = "".join(item for kind, item in items if kind == "content") or (None if calls else "")
            if calls:
                message["tool_calls"] = calls
        logprobs = done.get("logprobs") and chat_logprobs(self.job.tokenizer, *done["logprobs"])
        return self.body({"message": message, "finish_reason": self.finish_reason(done), "logprobs": logprobs},
                         usage=usage(self.job.prompt, done), tandem=tandem_fields(done))

    def write_logprobs(self, tokens, rows) -> dict:
        return chat_logprobs(self.job.tokenizer, tokens, rows)

    def start(self) -> list[str]:
        return [self.chunk({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})]

    def text(self, delta: str) -> list[str]:
        return self.deltas([("content", delta)] if self.calls is None else self.calls.feed(delta))

    def deltas(self, items) -> list[str]:
        """Content as it is (with the logprobs of its tokens); a call as OpenAI streams one: its id and name
        (arguments ""), then its arguments."""
        out = []
        for kind, item in items:
            if kind == "content":
                out.append(self.chunk({"delta": {"content": item}, "logprobs": self.take_logprobs(), "finish_reason": None}))
                continue
            index = self.calls.calls.index(item)
            head = {"index": index, "id": item.id, "type": "function", "function": {"name": item.name, "arguments": ""}}
            for call in (head, {"index": index, "function": {"arguments": item.arguments}}):
                out.append(self.chunk({"delta": {"tool_calls": [call]}, "finish_reason": None}))
        return out

    def done(self, done: dict) -> list[str]:
        rest = self.deltas(self.calls.finish()) if self.calls is not None else []
        return rest + [self.chunk({"delta": {}, "logprobs": self.take_logprobs(), "finish_reason": self.finish_reason(done)},
                                  **self.last(done))] + self.usage_chunk(done)


def reserve_port(cfg: TandemConfig) -> socket.socket:
    """Bind serve.host:serve.port before anything else starts: the process group and gloo then open
    ephemeral ports of their own, and one of them could otherwise take a port in that range before
    uvicorn binds it (minutes later, once the models are loaded). A port in use is found at once."""
    from launch.distributed import LaunchError
    try:
        family = socket.AF_INET6 if ":" in cfg.serve.host else socket.AF_INET
        listener = socket.create_server((cfg.serve.host, cfg.serve.port), family=family)
    except OSError as e:
        raise LaunchError(f"cannot serve on {cfg.serve.host}:{cfg.serve.port}: {e.strerror}; pick another serve.port "
                          "(or stop what is using it)") from None
    return listener


def load_api_key(cfg: TandemConfig) -> str | None:
    """serve.api_key_file's first line (or serve.api_key); None when neither is set."""
    from launch.config import ConfigError
    path = cfg.serve.api_key_file
    if path is None:
        key = cfg.serve.api_key
    else:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read serve.api_key_file={path} ({getattr(e, 'strerror', None) or e}); "
                              "create it, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE") from None
    if key is not None and (not key or not key.isprintable() or not key.isascii()):
        raise ConfigError(f"the API key in {'serve.api_key_file=' + path if path else 'serve.api_key'} is empty or not printable ASCII")
    return key


def open_host_warning(host: str, api_key: str | None) -> str | None:
    """The line printed when anyone on the network could use the GPUs."""
    if api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (f"[warning: serving on {host} without an API key: anyone who can reach this port can use it; "
            "set serve.api_key_file=FILE]")


def serve(cfg: TandemConfig, session, tokenizer, eos_ids: set[int], vocab_size: int,
          listener: socket.socket | None = None, model_name: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM (raises Interrupted, once rank 1 has had its Bye), until the server is
    told to exit (returns), or until rank 1 is lost (raises its PeerError)."""
    import uvicorn
    listener = listener or reserve_port(cfg)
    host, port = listener.getsockname()[:2]
    from pathlib import Path
    model_name = model_name or cfg.serve.model_name or Path(cfg.model.target.rstrip("/")).name  # launch.plan.Models.name
    telemetry = None
    if cfg.log.dir:
        from launch.telemetry import ServeTelemetry
        telemetry = ServeTelemetry(cfg)
    api_key = load_api_key(cfg)
    warning = open_host_warning(cfg.serve.host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    engine = Engine(cfg, session, tokenizer, eos_ids, telemetry)
    app = build_app(cfg, engine, tokenizer, vocab_size, model_name, api_key)
    signals: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # SIGINT/SIGTERM (uvicorn's handler while it runs)
            if not signals:
                signals.append(sig)
                engine.interrupt(f"stopped by {signal.Signals(sig).name}")
            super().handle_exit(sig, frame)
    server = Server(uvicorn.Config(app, host=cfg.serve.host, port=cfg.serve.port, log_level="warning",
                                   lifespan="off", timeout_graceful_shutdown=2, http=headers_within_timeout(),
                                   timeout_keep_alive=KEEP_ALIVE_S))
    engine.on_fatal = lambda: setattr(server, "should_exit", True)
    if threading.current_thread() is threading.main_thread():
        # uvicorn restores the handlers it found and re-raises the signal it caught once it has shut
        # down: finding these, that re-raise is a no-op, and the entry exits cleanly
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    engine.thread.start()
    print(f"[serving {model_name} on http://{host}:{port}/v1 (OpenAI-compatible); "
          f"Ctrl-C stops both ranks]", file=sys.stderr, flush=True)
    server.run(sockets=[listener])
    if engine.fatal is None:
        engine.stop()  # ends the live requests at their next round, then says Bye to rank 1
    if telemetry is not None:
        telemetry.close()
    if engine.fatal is not None:
        raise engine.fatal
    if signals:
        from launch.distributed import Interrupted
        raise Interrupted(signals[0], f" after {engine.served} requests")
    print(f"[stopped after {engine.served} requests]", file=sys.stderr, flush=True)

