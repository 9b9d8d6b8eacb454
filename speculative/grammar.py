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


class GrammarFailure(RuntimeError):
    """A request's grammar failed while its answer was verified (llguidance's matcher in its error state, e.g. a
    lexer limit reached on a token; or an exception from it): that request ends with this, the others go on."""


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


PROBE_CHOICES = 32  # free choices Grammars.check walks (forced tokens between them come free)
PROBE_TOKENS = 512  # and tokens in all (~25 us each on Qwen's vocabulary: a long forced constant stops here)
PROBE_PATTERNS = 64  # regexes of a schema it walks alone (a few ms each; llguidance's limits bound the worst)


def patterns(schema) -> set[str]:
    """Every regex of a JSON schema, however deep: each "pattern", and "patternProperties"' keys (not inside
    values: const, enum, default, examples)."""
    found, todo = set(), [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.add(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.update(node["patternProperties"])
            todo.extend(v for k, v in node.items() if k not in VALUES)
        elif isinstance(node, list):
            todo.extend(node)
    return found


VALUES = {"const", "enum", "default", "examples"}  # a schema's keys whose values are JSON, not schemas


def first_line(error) -> str:
    """An llguidance error's first line (the rest is the parser's state dump, with the grammar in it)."""
    return (str(error).splitlines() or ["no error"])[0]


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
    """The llguidance grammar of a Lark grammar (a tool call's, launch.serve.tools.call_grammar); checked as grammar_source."""
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
        self.vocab_size, self.eos = vocab_size, set(eos)
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
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        except Exception as e:  # noqa: BLE001 - it says it never raises on a grammar; one line if it does
            raise GrammarError(f"the grammar cannot be enforced: {first_line(e)}") from None
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be enforced: {first_line(matcher.get_error())}")
        return Grammar(matcher, self.vocab_size)

    def check(self, source: str, schema: dict | None = None) -> None:
        """The grammar tried here as the last rank will use it, so that what fails at once is a 400 instead of a
        request that ends in an error: its matcher made and its answer's start walked (walk), and each regex of its
        JSON schema (`schema`: a response_format's, a tool's parameters) walked alone, wherever it lies. llguidance
        builds a lexeme's regex when the answer reaches it: `{"type": "string", "pattern": "^a{1000000}$"}` fails on
        its opening quote, not before. A failure past this still ends only its own request (speculative.rounds)."""
        try:
            self.walk(source, PROBE_CHOICES)
        except GrammarFailure as e:
            raise GrammarError(f"the grammar fails on its first tokens ({e}); simplify the schema") from None
        for pattern in sorted(patterns(schema))[:PROBE_PATTERNS]:
            try:
                self.walk(grammar_source({"type": "string", "pattern": pattern}), 2)
            except GrammarError:  # not a regex llguidance reads alone: the whole schema compiled, so not one of its own
                continue
            except GrammarFailure as e:
                raise GrammarError(f"the pattern {pattern[:40]!r} fails on its first tokens ({e}); simplify it") from None

    def walk(self, source: str, choices: int) -> None:
        """The answer's first `choices` free choices (each the lowest token allowed; what the grammar forces between
        them, llguidance's fast-forward tokens, comes free), the mask computed before every token as verification
        does; GrammarFailure where it fails."""
        grammar, walked = self.from_source(source), 0
        for _ in range(choices):
            for token in grammar.matcher.compute_ff_tokens() or [grammar.lowest_allowed()]:
                if token in self.eos or grammar.matcher.is_stopped() or walked == PROBE_TOKENS:
                    return
                grammar.allows(token)  # the mask first, as the last rank computes it
                grammar.accept(token)
                walked += 1


class FolderGrammars:
    """The last rank's Grammars: the model folder's tokenizer loaded on the first request that carries a grammar
    (a launch that never gets one never loads it)."""

    def __init__(self, folder, vocab_size: int, eos_ids: set[int]):
        self.folder, self.vocab_size, self.eos_ids = folder, vocab_size, sorted(eos_ids)
        self._grammars: Grammars | None = None

    def from_source(self, source: str) -> Grammar:
        if self._grammars is None:
            from transformers import AutoTokenizer
            try:
                tokenizer = AutoTokenizer.from_pretrained(self.folder)
            except (OSError, ValueError) as e:
                raise GrammarError(f"the last rank cannot load the tokenizer of {self.folder} to enforce the grammar "
                                   f"({first_line(e)}); give it the model folder's tokenizer files") from None
            self._grammars = Grammars(tokenizer, self.vocab_size, self.eos_ids)
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

    def lowest_allowed(self) -> int:
        """The lowest token the grammar allows next (Grammars.check's walk)."""
        words = np.flatnonzero(self._bitmask())
        if not words.size:
            raise GrammarFailure(f"the grammar allows no token after {self.consumed} tokens: {self._error()}")
        word = int(self._bits[words[0]]) & 0xFFFFFFFF
        return int(words[0]) * 32 + (word & -word).bit_length() - 1

    def allowed(self) -> torch.Tensor:
        """The mask at the current position: bool [vocab_size], True where the grammar allows the token."""
        bits = np.unpackbits(self._bitmask().view(np.uint8), bitorder="little")[:self.vocab_size]
        mask = torch.from_numpy(bits.astype(bool))
        if not mask.any():  # every logit would be -inf: the choice after it is NaN
            raise GrammarFailure(f"the grammar allows no token after {self.consumed} tokens: {self._error()}")
        return mask

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with -inf where the grammar refuses the token (a new tensor)."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def accept(self, token: int) -> None:
        stopped = self.matcher.is_stopped()
        if not self.matcher.consume_token(token):
            raise GrammarFailure(f"the grammar refused token {token} after {self.consumed} tokens: {self._error()}")
        self._counted.append(not stopped)
        self.tokens.append(token)
        self._fresh = False

    def rollback(self, n: int) -> None:
        """Forget the last `n` accepted tokens (drafts the target did not keep)."""
        if n <= 0:
            return
        if n > self.consumed:
            raise GrammarFailure(f"cannot roll the grammar back {n} tokens: it holds {self.consumed}")
        counted = sum(self._counted[-n:])
        if counted and not self.matcher.rollback(counted):
            raise GrammarFailure(f"cannot roll the grammar back {n} tokens: {self._error()}")
        del self._counted[-n:]
        del self.tokens[-n:]
        self._fresh = False

    def rewind(self, consumed: int) -> None:
        """Back to `consumed` accepted tokens (rank 0 is the authority on the committed length)."""
        if consumed > self.consumed:
            raise GrammarFailure(f"the grammar holds {self.consumed} tokens, fewer than the {consumed} committed")
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
            raise GrammarFailure(f"the grammar failed after {self.consumed} tokens: {self._error()}")

    def _error(self) -> str:
        return first_line(self.matcher.get_error())
