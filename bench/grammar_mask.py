"""What a grammar costs per token on this CPU, for the two libraries that constrain decoding to a JSON schema
(xgrammar, llguidance), with the embedded Qwen2.5-Coder tokenizer (vocab 151,936 rows in the head).

Per token of a valid answer: the allowed-token mask at the position, then the token consumed (what the last rank
does at every verified position), timed over the whole answer; then a rollback of a speculative block (consume K
tokens, roll back K, the mask must equal the one before). One-off costs (tokenizer wrap, schema compile) apart.

    .venv/bin/python bench/grammar_mask.py [--repeat 20] [--model ~/.cache/tandem/models/qwen2.5-coder-0.5b-instruct]

Both libraries are optional here: one not installed is skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "languages"], "additionalProperties": False}
ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
ANSWER = '{"name": "Ada Lovelace", "age": 36, "languages": ["English", "French", "Italian"]}'
VOCAB = 151936  # the model's head (the tokenizer has 151,665 ids; the rest are padding rows, never allowed)
K = 8  # drafts rolled back


def ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr
        self.xgr = xgr
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.setup_ms = ms_since(t0)
        self.bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, m) -> torch.Tensor:
        m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, n: int) -> None:
        m.rollback(n)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        t0 = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
        self.setup_ms = ms_since(t0)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, VOCAB)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        assert not error, error
        return grammar

    def matcher(self, grammar):
        m = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def mask(self, m) -> torch.Tensor:
        self.llg.torch.fill_next_token_bitmask(m, self.bitmask)
        return self.bitmask

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m, n: int) -> None:
        assert m.rollback(n)


def measure(lib, schema: dict, tokens: list[int], repeat: int) -> dict:
    t0 = time.perf_counter()
    compiled = lib.compile(schema)
    lib.matcher(compiled)
    compile_ms = ms_since(t0)  # what a request pays before its first token: the schema compiled, a matcher made
    per_token = []
    for _ in range(repeat):
        m = lib.matcher(compiled)
        t0 = time.perf_counter()
        for token in tokens:
            bits = lib.mask(m)
            assert (int(bits[0, token // 32]) >> (token % 32)) & 1, f"{lib.name} refused a token of a valid answer"
            assert lib.consume(m, token)
        per_token.append(ms_since(t0) / len(tokens))
    # rollback: K tokens consumed then undone; the mask after must be the one before
    m = lib.matcher(compiled)
    for token in tokens[:5]:
        lib.consume(m, token)
    before = lib.mask(m).clone()
    t0 = time.perf_counter()
    for token in tokens[5:5 + K]:
        lib.consume(m, token)
    lib.rollback(m, K)
    rollback_ms = ms_since(t0)
    same = torch.equal(before, lib.mask(m))
    return dict(library=lib.name, schema="json_object" if schema == ANY_OBJECT else "json_schema", setup_ms=round(lib.setup_ms), request_setup_ms=round(compile_ms, 1),
                mask_and_consume_ms_per_token=round(statistics.median(per_token), 4),
                worst_run_ms_per_token=round(max(per_token), 4), tokens=len(tokens),
                consume_and_rollback_of_K_ms=round(rollback_ms, 3), K=K, mask_same_after_rollback=same)


def verify_cost(tok, tokens: list[int], repeat: int) -> dict:
    """What the grammar adds to the last rank's verification per verified position (speculative.verify with
    speculative.grammar), over the answer's positions, against the same verification without one: when the
    target's own argmax is allowed (one bit of the mask is read) and when it is refused (the whole mask, then a
    masked argmax over the vocabulary)."""
    from speculative.grammar import Grammars
    from speculative.verify import verify_greedy
    grammars = Grammars(tok, VOCAB, [tok.eos_token_id])
    none = torch.zeros(0, dtype=torch.long)
    logits = torch.randn(len(tokens), VOCAB)
    allowed_best = logits.clone()
    allowed_best[torch.arange(len(tokens)), torch.tensor(tokens)] = 100.0  # the answer's token is the argmax
    refused_best = logits.clone()
    refused_best[:, tok.encode("x", add_special_tokens=False)[0]] = 100.0  # a token no JSON position allows
    result = {}
    for name, rows in (("argmax_allowed", allowed_best), ("argmax_refused", refused_best)):
        with_grammar, without = [], []
        for _ in range(repeat):
            grammar = grammars.from_schema(SCHEMA)
            t0 = time.perf_counter()
            for i, token in enumerate(tokens):
                verify_greedy(rows[i:i + 1], none, grammar)
                if grammar.consumed and grammar.consumed > i:  # keep the grammar on the answer's path
                    grammar.rollback(1)
                grammar.accept(token)
            with_grammar.append(ms_since(t0) / len(tokens))
            t0 = time.perf_counter()
            for i in range(len(tokens)):
                verify_greedy(rows[i:i + 1], none)
            without.append(ms_since(t0) / len(tokens))
        result[f"{name}_ms_per_position"] = round(statistics.median(with_grammar), 4)
        result[f"{name}_without_grammar_ms"] = round(statistics.median(without), 4)
    return dict(library="llguidance (speculative.verify)", vocab=VOCAB, **result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/tandem/models/qwen2.5-coder-0.5b-instruct"))
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    tokens = tok.encode(ANSWER, add_special_tokens=False)
    torch.set_num_threads(1)
    for cls in (XGrammar, LLGuidance):
        try:
            lib = cls(tok)
        except ImportError as e:
            print(json.dumps({"library": cls.name, "skipped": str(e)}))
            continue
        for schema in (SCHEMA, ANY_OBJECT):
            print(json.dumps(measure(lib, schema, tokens, args.repeat)), flush=True)
    print(json.dumps(verify_cost(tok, tokens, max(1, args.repeat // 4))), flush=True)


if __name__ == "__main__":
    main()
