"""The OpenAI request bodies Tandem accepts, parsed into one Prompt, and its error JSON.

Every field a request may carry is in FIELDS below, in one place: a field an endpoint READS is checked and
honoured by its parser (type and range, before anything reaches the engine: numbers are finite, the seed
fits the 64-bit generators, max_tokens never exceeds gen.max_new_tokens); a field in INERT is accepted only
at a value that changes nothing (logprobs false, response_format text, a penalty of 0, user, metadata);
anything else, unknown fields included, is a 400 naming the field (as OpenAI answers an unrecognized
argument) — never a 200 that silently ignores what was asked. Absent sampling fields take the launch's
gen.* values; an absent seed with temperature > 0 is drawn at random (as OpenAI does).
To honour a field: add it to READS for its endpoint, read it in the parser, and take it out of INERT.
"""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass

from launch.config import REQUEST_RANGES
from launch.structured import FieldError, read_chat_logprobs, read_completion_logprobs, read_grammar
from launch.tools import CLOSE, ToolError, ToolSetup, template_message, tool_setup
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
    tools: ToolSetup | None = None  # chat with tools: calls are read out of the answer when tools.parse
    include_usage: bool = False  # stream_options.include_usage: the usage in a last chunk of its own


_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n"}
READS = {  # the fields each endpoint's parser reads and honours
    "chat": _SAMPLING | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                         "response_format", "logprobs", "top_logprobs"},  # these three: launch.structured
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
            raise ApiError(400, UNRECOGNIZED.format(field=str(key)[:64], path=path), param=str(key)[:64],
                           code="unknown_parameter")
        if not inert(value):
            raise ApiError(400, UNHONOURED.format(field=key, value=_short(value)), param=key, code="unsupported_parameter")


def _short(value) -> str:
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_chat(body, tokenizer, cfg, model_name: str) -> Prompt:
    _check_common(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", param="messages")
    if tokenizer is None or not tokenizer.chat_template:
        raise ApiError(400, f"{model_name} has no chat template: use /v1/completions", param="messages")
    try:
        tools = tool_setup(body, tokenizer.chat_template)
        conversation = [template_message(m, _role(m), _content(m)) for m in messages]
    except ToolError as e:
        raise ApiError(400, str(e), param=e.param) from None
    settings = read_settings(body, cfg)
    check_fields(body, "chat")
    try:
        settings.request.grammar, settings.request.logprobs = read_grammar(body, tokenizer), read_chat_logprobs(body)
    except FieldError as e:
        raise ApiError(400, str(e), param=e.param) from None
    settings.request.grammar = forced_call(tools, tokenizer, settings.request.grammar)
    prompt = with_ids(settings, template_ids(tokenizer, conversation, tools.specs if tools else None))
    prompt.tools = tools
    if tools and tools.parse and not tools.parallel:
        prompt.stop = [*prompt.stop, CLOSE]  # one call (parallel_tool_calls=false): the answer ends with it
    return prompt


def forced_call(tools: ToolSetup | None, tokenizer, grammar: str | None) -> str | None:
    """The request's grammar once tool_choice required / named holds the answer to a call (launch.tools)."""
    if tools is None or tools.forced is None:
        return grammar
    if grammar is not None:
        raise ApiError(400, "tool_choice required or a named function already constrains the answer to a call: "
                       "drop response_format", param="response_format")
    try:
        return tools.grammar(tokenizer)
    except ValueError as e:  # speculative.grammar.GrammarError: a tool's parameters no grammar can hold
        raise ApiError(400, f"the tools' parameters cannot be enforced: {e}", param="tools") from None


def template_ids(tokenizer, conversation: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The conversation (and the tools) through the model's chat template, ready for the assistant's answer."""
    try:
        out = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    except Exception as e:  # noqa: BLE001 - a template may raise anything on a conversation it does not expect
        raise ApiError(400, f"the chat template refused these messages ({type(e).__name__}: {str(e)[:200]})",
                       param="messages") from None
    return list(out["input_ids"])


def parse_completion(body, tokenizer, cfg, model_name: str) -> Prompt:
    _check_common(body, model_name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    request = read_settings(body, cfg)
    check_fields(body, "completions")
    try:
        request.request.logprobs = read_completion_logprobs(body)
    except FieldError as e:
        raise ApiError(400, str(e), param=e.param) from None
    if isinstance(prompt, str) and prompt:
        if tokenizer is None:
            raise ApiError(400, f"{model_name} has no tokenizer: send the prompt as a list of token ids", param="prompt")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")
    return with_ids(request, ids)


def check_model(body, model_name: str) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise ApiError(404, f"the model {str(body.get('model'))[:100]!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")


def _check_common(body, model_name: str) -> None:
    check_model(body, model_name)
    if _integer(body, "n", 1, 1, 1) != 1:
        raise ApiError(400, "n must be 1: one answer per request", param="n")
    _integer(body, "best_of", 1, 1, 1)  # one answer per request (n, best_of); logprobs and echo: INERT


SEED_RANGE = REQUEST_RANGES["seed"]  # the range gen.seed takes too (launch.config: one table)
MAX_TEMPERATURE = 2.0  # OpenAI's bound: beyond it sampling is noise


MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass
class Settings:
    max_tokens: int | None
    request: Request
    stop: list[str]
    stream: bool
    include_usage: bool = False


def read_settings(body: dict, cfg) -> Settings:
    """Every field besides the prompt, checked before the (costly) tokenization."""
    limit = cfg.gen.max_new_tokens
    # max_tokens (chat's older name max_completion_tokens, the Responses API's max_output_tokens)
    key = next((k for k in MAX_TOKENS_KEYS if body.get(k) is not None), "max_tokens")
    max_tokens = _integer(body, key, None, 1, None)
    if max_tokens is not None and max_tokens > limit:
        raise ApiError(400, f"{key}={max_tokens} exceeds this server's gen.max_new_tokens={limit}", param=key)
    temperature = _float(body, "temperature", cfg.gen.temperature, 0.0, MAX_TEMPERATURE)
    top_p = _float(body, "top_p", cfg.gen.top_p, *REQUEST_RANGES["top_p"])
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
    options = body.get("stream_options")  # include_usage: the usage in a last chunk of its own (launch.server)
    if options is not None and not (isinstance(options, dict) and all(
            k in ("include_usage", "include_obfuscation") and isinstance(v, bool) for k, v in options.items())):
        raise ApiError(400, "stream_options may only hold include_usage (true or false)", param="stream_options")
    include_usage = bool(options and options.get("include_usage"))
    return Settings(max_tokens, Request(temperature, top_p, seed), stop, bool(stream), include_usage)


def with_ids(s: Settings, ids) -> Prompt:
    return Prompt(list(ids), s.max_tokens, s.request, s.stop, s.stream, include_usage=s.include_usage)


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
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ApiError(400, f"each message needs a role of system, user, assistant or tool (got {str(role)[:40]!r})",
                       param="messages")
    return "system" if role == "developer" else role


def _content(message) -> str | None:
    content = message.get("content")
    if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        return None  # an assistant turn that only called tools
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


def usage(prompt: Prompt, done: dict) -> dict:
    n_prompt, n_out = len(prompt.ids), len(done["token_ids"])
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def tandem_fields(done: dict) -> dict:
    """Beyond OpenAI's fields: what Tandem measured for this request."""
    s = done["stats"]
    return {"token_ids": done["token_ids"], "prompt_tokens_reused": s["prompt_tokens_reused"],
            "prefilled_tokens": s["prefilled_tokens"], "ttft_ms": s["ttft_s"] * 1000, "queue_ms": s["queue_s"] * 1000,
            "tokens_per_s": s["tokens_per_s"], "tokens_per_round": s["tokens_per_round"],
            "acceptance_rate": s["acceptance_rate"]}
