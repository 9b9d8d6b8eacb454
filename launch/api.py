"""The OpenAI request bodies Tandem accepts, parsed into one Prompt, and its error JSON.

Fields read: model, messages | prompt, max_tokens (max_completion_tokens), temperature, top_p, seed,
stop, stream, n. Absent sampling fields take the launch's gen.* values; an absent seed with
temperature > 0 is drawn at random (as OpenAI does). What Tandem cannot honour (n > 1, tools, logprobs)
is refused with a 400 rather than silently ignored; unknown fields are ignored, as clients send many.
"""
from __future__ import annotations

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
    ids = chat_ids(tokenizer, [{"role": _role(m), "content": _content(m)} for m in messages])
    return _prompt(body, ids, cfg)


def parse_completion(body, tokenizer, cfg, model_name: str) -> Prompt:
    _check_common(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise ApiError(400, f"{model_name} has no tokenizer: send the prompt as a list of token ids", param="prompt")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")
    return _prompt(body, ids, cfg)


def _check_common(body, model_name: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise ApiError(404, f"the model {body.get('model')!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: one answer per request", param="n")
    if body.get("logprobs") or body.get("best_of", 1) != 1 or body.get("echo"):
        raise ApiError(400, "logprobs, best_of and echo are not supported", param="logprobs")


def _prompt(body: dict, ids: list[int], cfg) -> Prompt:
    max_tokens = _number(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _number(body, "max_completion_tokens", int, None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, "max_tokens must be >= 1", param="max_tokens")
    temperature = _number(body, "temperature", float, cfg.gen.temperature)
    top_p = _number(body, "top_p", float, cfg.gen.top_p)
    if temperature < 0 or not 0 < top_p <= 1:
        raise ApiError(400, "temperature must be >= 0 and top_p in (0, 1]", param="temperature")
    seed = _number(body, "seed", int, None)
    if seed is None:
        seed = secrets.randbelow(2**31) if temperature > 0 else cfg.gen.seed
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
    return Prompt(ids, max_tokens, Request(temperature, top_p, seed), stop, bool(body.get("stream", False)))


def _number(body: dict, key: str, kind, default):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ApiError(400, f"{key} must be {'an integer' if kind is int else 'a number'}", param=key)
    return kind(value)


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
