"""The fields of an OpenAI request body that Tandem reads, checked, and the Prompt they make (launch/serve/prompts.py
parses each endpoint's body with these).

Every field a request may carry is in the tables below, in one place: a field an endpoint READS is checked and
honoured by its parser (type and range, before anything reaches the engine: numbers are finite, the seed
fits the 64-bit generators, max_tokens never exceeds gen.max_new_tokens); a field in INERT is accepted only
at a value that changes nothing (logprobs false, response_format text, a penalty of 0, user, metadata);
anything else, unknown fields included, is a 400 naming the field (as OpenAI answers an unrecognized
argument) — never a 200 that silently ignores what was asked. Absent sampling fields take the launch's
gen.* values; an absent seed with temperature > 0 is drawn at random (as OpenAI does). Every field problem is a
FieldError (launch/serve/errors.py), whichever module finds it.
To honour a field: add it to READS for its endpoint, read it in the parser, and take it out of INERT.
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass

from launch.config import REQUEST_RANGES
from launch.serve.errors import ApiError, FieldError
from launch.serve.tools import ToolSetup
from netbridge.protocol import SamplingParams


@dataclass
class Prompt:
    """One request as the engine takes it: the prompt's ids and everything its answer depends on."""
    ids: list[int]
    max_tokens: int | None  # None: as many as fit, up to gen.max_new_tokens
    params: SamplingParams
    stop: list[str]
    stream: bool
    tools: ToolSetup | None = None  # chat with tools: calls are read out of the answer when tools.parse
    include_usage: bool = False  # stream_options.include_usage: the usage in a last chunk of its own


_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n"}

READS = {  # the fields each endpoint's parser reads and honours
    "chat": _SAMPLING | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                         "response_format", "logprobs", "top_logprobs"},  # these three: launch/serve/structured.py
    "completions": _SAMPLING | {"prompt", "best_of", "logprobs"},
    "responses": {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools",
                  "tool_choice", "parallel_tool_calls"},
}


def _falsy(value) -> bool:
    return not value


def _zero(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


def _anything(_) -> bool:
    return True


INERT = {  # field: whether a value changes nothing (then it is accepted; any other value is a 400 naming it)
    "logprobs": _falsy, "top_logprobs": _falsy, "echo": _falsy, "suffix": _falsy, "logit_bias": _falsy,
    "frequency_penalty": _zero, "presence_penalty": _zero,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "text": lambda v: v is None or v == {} or v == {"format": {"type": "text"}},  # the Responses API's response_format
    "modalities": lambda v: v is None or v == ["text"],
    "store": lambda v: v is not True,  # nothing is stored: a stored completion could not be fetched back
    "user": _anything, "metadata": _anything, "safety_identifier": _anything, "prompt_cache_key": _anything,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "truncation": lambda v: v in (None, "disabled"),
    "include": _falsy, "reasoning": _falsy, "reasoning_effort": _falsy, "previous_response_id": _falsy,
}


UNRECOGNIZED = "{field} is not a field this server knows for {path}; leave it out (see docs/api.md)"

UNHONOURED = "{field}={value} is not supported by this server; leave it out (see docs/api.md for what is)"


def check_fields(body, endpoint: str) -> None:
    """Every field of the body is read by this endpoint, or inert at its value: else a 400 naming it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key in READS[endpoint]:
            continue
        inert = INERT.get(key)
        if inert is None:
            path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}.get(endpoint, "/v1/responses")
            raise FieldError(UNRECOGNIZED.format(field=str(key)[:64], path=path), param=str(key)[:64],
                             code="unknown_parameter")
        if not inert(value):
            raise FieldError(UNHONOURED.format(field=key, value=_short(value)), param=key, code="unsupported_parameter")


def _short(value) -> str:
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


SEED_RANGE = REQUEST_RANGES["seed"]  # the range gen.seed takes too (launch.config: one table)

MAX_TEMPERATURE = 2.0  # OpenAI's bound: beyond it sampling is noise

MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass
class Settings:
    """Every field but the prompt, read before the prompt is tokenized (read_settings)."""
    max_tokens: int | None
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool = False


def read_settings(body: dict, cfg) -> Settings:
    """Every field besides the prompt, checked before the (costly) tokenization."""
    limit = cfg.gen.max_new_tokens
    # max_tokens (chat's older name max_completion_tokens, the Responses API's max_output_tokens)
    key = next((k for k in MAX_TOKENS_KEYS if body.get(k) is not None), "max_tokens")
    max_tokens = integer_field(body, key, None, 1, None)
    if max_tokens is not None and max_tokens > limit:
        raise FieldError(f"{key}={max_tokens} exceeds this server's gen.max_new_tokens={limit}", param=key)
    temperature = number_field(body, "temperature", cfg.gen.temperature, 0.0, MAX_TEMPERATURE)
    top_p = number_field(body, "top_p", cfg.gen.top_p, *REQUEST_RANGES["top_p"])
    if top_p == 0:
        raise FieldError("top_p must be in (0, 1]", param="top_p")
    seed = integer_field(body, "seed", None, *SEED_RANGE)
    if seed is None:
        seed = secrets.randbelow(2**31) if temperature > 0 else cfg.gen.seed
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise FieldError("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise FieldError("stream must be true or false", param="stream")
    options = body.get("stream_options")  # include_usage: the usage in a last chunk of its own (launch/serve/forms.py)
    if options is not None and not (isinstance(options, dict) and all(
            k in ("include_usage", "include_obfuscation") and isinstance(v, bool) for k, v in options.items())):
        raise FieldError("stream_options may only hold include_usage (true or false)", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    return Settings(max_tokens, SamplingParams(temperature, top_p, seed), stop, bool(stream), include_usage)


def with_ids(s: Settings, ids) -> Prompt:
    return Prompt(list(ids), s.max_tokens, s.params, s.stop, s.stream, include_usage=s.include_usage)


def integer_field(body: dict, key: str, default, low: int, high: int | None):
    """An integer field within [low, high] (JSON may spell one 3.0; never true, 1e400 or NaN)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{key} must be an integer", param=key)
    if value < low or (high is not None and value > high):
        raise FieldError(f"{key} must be in [{low}, {high if high is not None else 'inf'}]", param=key)
    return value


def number_field(body: dict, key: str, default: float, low: float, high: float) -> float:
    """A finite number within [low, high]; JSON's NaN and Infinity (which Python's parser takes) are refused."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(f"{key} must be a number", param=key)
    value = float(value) if abs(value) < 1e300 else math.inf
    if not math.isfinite(value) or not low <= value <= high:
        raise FieldError(f"{key} must be a finite number in [{low:g}, {high:g}]", param=key)
    return value
