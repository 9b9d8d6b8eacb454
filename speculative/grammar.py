"""Structured outputs: one request's grammar (OpenAI `response_format` json_object / json_schema) as the set
of tokens allowed at the current position, advanced by the tokens the target commits and rolled back by the
ones it does not.

The library is llguidance (bench/grammar_mask.py measures it against xgrammar on this CPU: 2 ms to make a
request's matcher from a small schema against 15 ms, ~25 us per token for the mask and the step, exact
rollback, and no dependencies where xgrammar pulls in triton). Its tokenizer wrap takes ~1 s, so a process
makes one `Grammars` and asks it for each request's `Grammar`.

The mask is applied where a token is chosen (speculative.verify): the last rank masks the target's logits at
every verified position before its argmax or its sampling, so a draft the grammar refuses is simply rejected
and the output is what the target would write alone under the same grammar.
"""
from __future__ import annotations

import json

import numpy as np
import torch


class GrammarError(ValueError):
    """A response_format that cannot be turned into a grammar; the message names the cause and the fix."""


def schema_of(response_format: dict | None) -> dict | None:
    """The JSON schema an OpenAI `response_format` asks for; None for plain text (absent or {"type": "text"})."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError(f"response_format must be an object like {{\"type\": \"json_object\"}}, not {response_format!r}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}  # any JSON object, as OpenAI's JSON mode
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise GrammarError('response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}: '
                               "the schema object is missing")
        return schema
    raise GrammarError(f"response_format type {kind!r} is not supported: use text, json_object or json_schema")


# JSON written as json.dumps writes it (", " and ": "), with no other whitespace: a model left free to choose its
# whitespace can fill an answer with it (a tiny random one does, all the way to max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_source(schema: dict) -> str:
    """The llguidance grammar of a JSON schema; a schema it cannot compile is a GrammarError naming why."""
    import llguidance
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except ValueError as e:
        raise GrammarError(f"response_format json_schema is not a JSON schema: {e}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(f"response_format json_schema cannot be enforced: {messages[0].splitlines()[0]}")
    return grammar


def lark_source(lark: str) -> str:
    """The llguidance grammar of a Lark grammar (a tool call's, launch.tools.call_grammar); checked as grammar_source."""
    import llguidance
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(f"the grammar is not valid: {messages[0].splitlines()[0]}")
    return grammar


class Grammars:
    """One per process: the tokenizer wrapped for llguidance (once: ~1 s), and a Grammar per request.
    `vocab_size`: the rows of the model's head (Qwen2.5 pads 151,665 ids to 151,936; padding is never allowed).
    `eos_ids`: the tokens that end a generation; the grammar allows only these once its JSON is complete."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        import llguidance.hf
        eos = sorted(eos_ids) or ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        if not eos:
            raise GrammarError("structured outputs need an end-of-sequence token to end the JSON: the model's "
                               "generation_config and tokenizer name none; set eos_token_id in generation_config.json")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def make(self, response_format: dict | None) -> Grammar | None:
        """The request's Grammar, or None when it asks for plain text."""
        schema = schema_of(response_format)
        return None if schema is None else self.from_schema(schema)

    def from_schema(self, schema: dict) -> Grammar:
        return self.from_source(grammar_source(schema))

    def from_source(self, source: str) -> Grammar:
        """A Grammar from llguidance's grammar text (grammar_source's, or lark_source's): what a Request carries
        to the last rank, which makes the matcher against its own copy of the tokenizer."""
        import llguidance
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {matcher.get_error().splitlines()[0]}")
        return Grammar(matcher, self.vocab_size)


class FolderGrammars:
    """The last rank's Grammars: the model folder's tokenizer loaded on the first request that carries a grammar
    (a launch that never gets one never loads it)."""

    def __init__(self, folder, vocab_size: int, eos_ids: set[int]):
        self.folder, self.vocab_size, self.eos_ids = folder, vocab_size, sorted(eos_ids)
        self._grammars: Grammars | None = None

    def from_source(self, source: str) -> Grammar:
        if self._grammars is None:
            from transformers import AutoTokenizer
            self._grammars = Grammars(AutoTokenizer.from_pretrained(self.folder), self.vocab_size, self.eos_ids)
        return self._grammars.from_source(source)


class Grammar:
    """The matcher of one request: which tokens may come next, and the tokens consumed so far (`consumed`).
    The mask is computed once per state and kept until a token is accepted or rolled back."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.tokens: list[int] = []  # the accepted tokens, in order
        self.origin: int | None = None  # the position of the answer's first token (at())
        # per accepted token, whether the matcher counted it: once the grammar is complete (stopped) it takes the
        # end-of-sequence token without counting it, and a rollback must not ask it for more than it holds
        self._counted: list[bool] = []
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._fresh = False

    @property
    def consumed(self) -> int:
        return len(self.tokens)

    def _bitmask(self) -> np.ndarray:
        if not self._fresh:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._check()
            self._fresh = True
        return self._bits

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (one bit of the mask)."""
        return 0 <= token < self.vocab_size and bool((int(self._bitmask()[token >> 5]) >> (token & 31)) & 1)

    def allowed(self) -> torch.Tensor:
        """The mask at the current position: bool [vocab_size], True where the grammar allows the token."""
        bits = np.unpackbits(self._bitmask().view(np.uint8), bitorder="little")[:self.vocab_size]
        mask = torch.from_numpy(bits.astype(bool))
        if not mask.any():  # every logit would be -inf: the choice after it is NaN
            raise RuntimeError(f"the grammar allows no token after {self.consumed} tokens: {self._error()}")
        return mask

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with -inf where the grammar refuses the token (a new tensor)."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def accept(self, token: int) -> None:
        stopped = self.matcher.is_stopped()
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token} after {self.consumed} tokens: {self._error()}")
        self._counted.append(not stopped)
        self.tokens.append(token)
        self._fresh = False

    def rollback(self, n: int) -> None:
        """Forget the last `n` accepted tokens (drafts the target did not keep)."""
        if n <= 0:
            return
        if n > self.consumed:
            raise RuntimeError(f"cannot roll the grammar back {n} tokens: it holds {self.consumed}")
        counted = sum(self._counted[-n:])
        if counted and not self.matcher.rollback(counted):
            raise RuntimeError(f"cannot roll the grammar back {n} tokens: {self._error()}")
        del self._counted[-n:]
        del self.tokens[-n:]
        self._fresh = False

    def rewind(self, consumed: int) -> None:
        """Back to `consumed` accepted tokens (rank 0 is the authority on the committed length)."""
        if consumed > self.consumed:
            raise RuntimeError(f"the grammar holds {self.consumed} tokens, fewer than the {consumed} committed")
        self.rollback(self.consumed - consumed)

    def at(self, position: int) -> bool:
        """Before verifying a round that decides the token at `position` (its start + fed - drafts): back to the
        answer's tokens before it; the first round of a request fixes where the answer starts. False when the
        grammar holds fewer: the round was sent ahead on a bet that failed (spec.in_flight) and its reply will be
        dropped (verify it without the grammar). A dropped round within what the grammar holds may leave tokens
        after its position; every later round decides at or before it, so the rewind here forgets them."""
        if self.origin is None:
            self.origin = position
        if position - self.origin > self.consumed:
            return False
        self.rewind(position - self.origin)
        return True

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed after {self.consumed} tokens: {self._error()}")

    def _error(self) -> str:
        return (self.matcher.get_error().splitlines() or ["no error"])[0]  # the rest is the parser's state dump
