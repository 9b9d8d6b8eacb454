"""The reference for structured outputs: transformers generate with llguidance's own matcher as a logits processor
(fed the whole output at every step, never speculative.grammar), under the grammar speculative.grammar builds
from the same schema with the same JSON options."""
from __future__ import annotations

import llguidance
import llguidance.hf
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from speculative.grammar import JSON_OPTIONS


class ReferenceGrammar(LogitsProcessor):
    """Feeds the matcher every token generated since the last call, then sets the logits of the tokens its
    byte mask refuses to -inf (llguidance's compute_logit_bias: one byte per token, 0 where refused)."""

    def __init__(self, tokenizer, schema: dict, prompt_len: int, vocab: int, eos: int):
        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        self.matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))
        self.prompt_len, self.fed, self.vocab = prompt_len, 0, vocab

    def allowed(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)[:self.vocab] > 0

    def __call__(self, input_ids, scores):
        new = input_ids[0, self.prompt_len + self.fed:].tolist()
        assert self.matcher.consume_tokens(new), self.matcher.get_error()
        self.fed += len(new)
        return scores.masked_fill(~self.allowed(), float("-inf"))


def constrained_greedy(model, tokenizer, prompt: list[int], schema: dict, max_new: int, eos: int):
    """(tokens, raw logits per step) of generate(do_sample=False) under the schema's grammar."""
    ids = torch.tensor([prompt])
    grammar = ReferenceGrammar(tokenizer, schema, len(prompt), model.config.vocab_size, eos)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos, output_logits=True, return_dict_in_generate=True,
                         logits_processor=LogitsProcessorList([grammar]))
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


# Schemas llguidance cannot enforce (issue 39): its lexer gives up ("too many expressions constructed") when the
# answer reaches a pattern of a million repetitions. BOMB fails on the answer's first token; late_bomb() only once
# the answer has written `chars` characters of a string before it, past the start speculative.grammar.Grammars.check
# walks (it finds the pattern by walking each regex of the schema alone). A Request that skips the checks (built
# directly, or with the check patched out) has its grammar fail while the last rank verifies: every answer of
# late_bomb() gets there (the string's length is fixed).
BOMB = {"type": "string", "pattern": "^a{1000000}$"}


def late_bomb(chars: int = 34) -> dict:
    return {"type": "object", "properties": {"k": {"type": "string", "minLength": chars, "maxLength": chars}, "b": BOMB},
            "required": ["k", "b"], "additionalProperties": False}
