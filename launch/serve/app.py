"""The HTTP app (FastAPI on uvicorn): its routes, the API key, the limits and the connection hardening. It only
parses and queues: a body over serve.max_body_bytes is refused (413) before it is read, and parsing and
tokenizing run in worker threads, so /health and other clients never wait on one request; each request becomes a
Job for the engine (launch/serve/engine.py), whose events an answer form (launch/serve/forms.py) writes out.

    POST /v1/chat/completions   POST /v1/completions   (stream=true: server-sent events, then [DONE])
    POST /v1/responses          (stream=true: the Responses API's typed events)
    GET  /v1/models             GET  /v1/models/{id}        GET  /health

What each accepts and refuses (launch/serve/fields.py's field table) is in docs/api.md.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from launch.build import CapacityError, check_capacity, check_ids, output_room
from launch.config import TandemConfig
from launch.serve.engine import Engine, Job
from launch.serve.errors import ApiError, FieldError
from launch.serve.fields import Prompt
from launch.serve.forms import ChatForm, CompletionForm, ResponsesForm
from launch.serve.prompts import parse_chat, parse_completion, parse_responses


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


def check_prompt(cfg: TandemConfig, prompt: Prompt, vocab_size: int, field: str = "prompt") -> None:
    """Refuse what cannot be served before it is queued; an absent max_tokens becomes what fits. `field`: the
    body's field the prompt came in (OpenAI names it in context_length_exceeded: messages on chat)."""
    try:
        check_ids(prompt.ids, vocab_size)
        if prompt.max_tokens is None:
            prompt.max_tokens = max(1, min(cfg.gen.max_new_tokens, output_room(cfg, len(prompt.ids))[0]))
        check_capacity(cfg, len(prompt.ids), prompt.max_tokens)
    except CapacityError as e:
        raise FieldError(f"{e} (prompt + max_tokens must fit)", field, code="context_length_exceeded") from None
    except ValueError as e:
        raise FieldError(str(e), field) from None


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
