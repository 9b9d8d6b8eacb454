"""The OpenAI request bodies Tandem accepts, parsed into one Prompt, and its error JSON.

Fields read: model, messages | prompt, max_tokens (max_completion_tokens), temperature, top_p, seed,
stop, stream, n. Absent sampling fields take the launch's gen.* values; an absent seed with
temperature > 0 is drawn at random (as OpenAI does). What Tandem cannot honour (n > 1, tools, logprobs)
is refused with a 400 rather than silently ignored; unknown fields are ignored, as clients send many.
Every field read is checked here, type and range, before anything reaches the engine: numbers are
finite, the seed fits the 64-bit generators, max_tokens never exceeds gen.max_new_tokens.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from launch.build import chat_ids
from netbridge.protocol import Request


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Prompt:
    ids: list[int]
    max_tokens: int | None  # None: as many as fit, up to gen.max_new_tokens
    request: Request
    stop: list[str]
    stream: bool


def parse_chat(body, tokenizer, cfg, model_name: str) -> Prompt:
    _check_common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", param="messages")
    if tokenizer is None or not tokenizer.chat_template:
        raise ApiError(400, f"{model_name} has no chat template: use /v1/completions", param="messages")
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools and function calling are not supported", param="tools")
    conversation = [{"role": _role(m), "content": _content(m)} for m in messages]
    request = _settings(body, cfg)
    try:
        ids = chat_ids(tokenizer, conversation)
    except Exception as e:  # noqa: BLE001 - a template may raise anything on a conversation it does not expect
        raise ApiError(400, f"the chat template refused these messages ({type(e).__name__}: {str(e)[:200]})",
                       param="messages") from None
    return _with_ids(request, ids)


def parse_completion(body, tokenizer, cfg, model_name: str) -> Prompt:
    _check_common(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    request = _settings(body, cfg)
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise ApiError(400, f"{model_name} has no tokenizer: send the prompt as a list of token ids", param="prompt")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")
    return _with_ids(request, ids)


def _check_common(body, model_name: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise ApiError(404, f"the model {str(body.get('model'))[:100]!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    if _integer(body, "n", 1, 1, 1) != 1:
        raise ApiError(400, "n must be 1: one answer per request", param="n")
    if body.get("logprobs") or body.get("echo") or _integer(body, "best_of", 1, 1, 1) != 1:
        raise ApiError(400, "logprobs, best_of and echo are not supported", param="logprobs")


SEED_RANGE = (-2**63, 2**63 - 1)  # what every generator it seeds takes (torch.Generator: 64 bits; the drafter's is seed + 1)
MAX_TEMPERATURE = 2.0  # OpenAI's bound: beyond it sampling is noise


@dataclass
class Settings:
    max_tokens: int | None
    request: Request
    stop: list[str]
    stream: bool


def _settings(body: dict, cfg) -> Settings:
    """Every field besides the prompt, checked before the (costly) tokenization."""
    limit = cfg.gen.max_new_tokens
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = _integer(body, key, None, 1, None)
    if max_tokens is not None and max_tokens > limit:
        raise ApiError(400, f"{key}={max_tokens} exceeds this server's gen.max_new_tokens={limit}", param=key)
    temperature = _float(body, "temperature", cfg.gen.temperature, 0.0, MAX_TEMPERATURE)
    top_p = _float(body, "top_p", cfg.gen.top_p, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
    seed = _integer(body, "seed", None, *SEED_RANGE)
    if seed is None:
        seed = secrets.randbelow(2**31) if temperature > 0 else cfg.gen.seed
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    return Settings(max_tokens, Request(temperature, top_p, seed), stop, bool(stream))


def _with_ids(s: Settings, ids) -> Prompt:
    return Prompt(list(ids), s.max_tokens, s.request, s.stop, s.stream)


def _integer(body: dict, key: str, default, low: int, high: int | None):
    """An integer field within [low, high] (JSON may spell one 3.0; never true, 1e400 or NaN)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer", param=key)
    if value < low or (high is not None and value > high):
        raise ApiError(400, f"{key} must be in [{low}, {high if high is not None else 'inf'}]", param=key)
    return value


def _float(body: dict, key: str, default: float, low: float, high: float) -> float:
    """A finite number within [low, high]; JSON's NaN and Infinity (which Python's parser takes) are refused."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{key} must be a number", param=key)
    value = float(value) if abs(value) < 1e300 else math.inf
    if not math.isfinite(value) or not low <= value <= high:
        raise ApiError(400, f"{key} must be a finite number in [{low:g}, {high:g}]", param=key)
    return value


def _role(message) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("system", "developer", "user", "assistant"):
        raise ApiError(400, f"each message needs a role of system, user or assistant (got {role!r})", param="messages")
    return "system" if role == "developer" else role


def _content(message) -> str:
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, "each message needs a string content", param="messages")
    return content


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
