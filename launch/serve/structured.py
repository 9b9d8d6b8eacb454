"""The request fields that reach the last rank (issue 30) and what comes back of them: `response_format` (a JSON
schema the answer must fit, enforced by a grammar where the token is chosen: speculative.grammar) and
`logprobs` (the target's log-probabilities of the committed tokens: speculative.verify.token_logprobs, raw,
before temperature, top-p and the grammar's mask), read from an OpenAI body and written back as OpenAI does.

    chat:         response_format {"type": "json_object" | "json_schema" | "text"}, logprobs: bool, top_logprobs: 0..20
    completions:  logprobs: 0..5 (the top alternatives; 0: each token's own only)
"""
from __future__ import annotations

import functools
import threading

from launch.serve.errors import FieldError
from speculative.grammar import GrammarError, Grammars, grammar_source, schema_of
from speculative.verify import MAX_TOP_LOGPROBS

MAX_COMPLETION_LOGPROBS = 5  # what OpenAI's /v1/completions allows


def read_grammar(body: dict, tokenizer=None) -> str | None:
    """The grammar text a response_format asks for (checked here, before the request is queued: with the
    tokenizer, also tried as the last rank will use it, check_grammar), or None."""
    try:
        schema = schema_of(body.get("response_format"))
        source = None if schema is None else grammar_source(schema)
    except GrammarError as e:
        raise FieldError(str(e), param="response_format") from None
    try:
        return source if source is None or tokenizer is None else check_grammar(source, tokenizer, schema)
    except GrammarError as e:
        raise FieldError(f"response_format: {e}", param="response_format") from None


def check_grammar(source: str, tokenizer, schema: dict) -> str:
    """`source` (of the JSON schema `schema`), once tried as the last rank will use it (speculative.grammar.
    Grammars.check): a GrammarError now, a 400, rather than a request that would end in an error once its answer
    gets there."""
    request_grammars(tokenizer).check(source, schema)
    return source


def grammar_failed(tools, cause: str) -> tuple[str, str]:
    """The error of a request whose grammar failed while its answer was verified (speculative.grammar.GrammarFailure
    on the last rank): its message and the field it names (tools when tool_choice forced a call)."""
    if tools is not None and tools.forced is not None:
        return f"tools: the call's grammar failed while the answer was written ({cause}); simplify the parameters", "tools"
    return f"response_format: the grammar failed while the answer was written ({cause}); simplify the schema", \
        "response_format"


_lock = threading.Lock()
_held: list = [None, None]  # the tokenizer and its Grammars (a server has one tokenizer)


def request_grammars(tokenizer) -> Grammars:
    """Rank 0's Grammars for the request checks, made on the first request with a grammar (its tokenizer wrap
    takes ~1-5 s; requests are parsed in worker threads, so the lock makes it once). Its end token only ends the
    walk (the last rank holds the model's own)."""
    with _lock:
        if _held[0] is not tokenizer:
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [0]
            _held[:] = [tokenizer, Grammars(tokenizer, len(tokenizer), eos)]
        return _held[1]


def read_chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (true/false) and top_logprobs (0..20, only with logprobs): the top alternatives wanted, or
    None for no logprobs."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise FieldError("logprobs must be true or false", param="logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise FieldError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    if top is not None and not wanted:
        raise FieldError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def read_completion_logprobs(body: dict) -> int | None:
    """Completions' logprobs: how many top alternatives each token lists (0..5), or None (absent or null)."""
    n = body.get("logprobs")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COMPLETION_LOGPROBS:
        raise FieldError(f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] on /v1/completions",
                         param="logprobs")
    return n


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table, which Qwen and Llama 3 use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    """A token as OpenAI lists it: its text and its bytes (a byte-level token's own bytes, also when they are half
    of a character; else its decoded text's UTF-8)."""
    piece, table = tokenizer.convert_ids_to_tokens(token), _byte_of_char()
    if isinstance(piece, str) and piece and all(c in table for c in piece):
        raw = bytes(table[c] for c in piece)
    else:
        raw = tokenizer.decode([token]).encode()
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer, tokens: list[int], rows) -> dict:
    """choices[].logprobs of a chat answer: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": raw}
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                        for t, (lp, top) in zip(tokens, rows)]}


def completion_logprobs(tokenizer, tokens: list[int], rows, offset: int = 0) -> dict:
    """choices[].logprobs of a completion: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset
    (each token's start in the answer's text, from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, (lp, top) in zip(tokens, rows):
        text = token_text(tokenizer, token)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({token_text(tokenizer, i)[0]: v for i, v in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out
