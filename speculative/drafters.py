"""Drafters behind one small interface: `reset(keep, temperature, seed)` when a request starts,
`propose(context, k)` -> Drafts each round, `commit(n)` after it.

`context` is every committed token (prompt + output), its last one the token the target has yet to
see. A drafter returns at most k tokens (fewer is fine) and, when the target samples, the sparse
distribution each was drawn from (rank 1 needs q for rejection sampling).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.draft_step import DraftStep


@dataclass
class Drafts:
    tokens: torch.Tensor  # [k] int64
    q_ids: torch.Tensor | None = None  # [k, m] token ids of each draft's distribution
    q_probs: torch.Tensor | None = None  # [k, m] their probabilities

    def __len__(self) -> int:
        return self.tokens.numel()

    def after_first(self) -> Drafts:
        """The drafts after the first (which draft_ahead uses as its guess of the target's next token)."""
        cut = (lambda t: None if t is None else t[1:])
        return Drafts(self.tokens[1:], cut(self.q_ids), cut(self.q_probs))


def one_hot_drafts(tokens: list[int]) -> Drafts:
    """A deterministic proposal is a one-hot q: rejection sampling then keeps d with probability p(d)."""
    t = torch.tensor(tokens, dtype=torch.long)
    return Drafts(t, t[:, None].clone(), torch.ones(len(tokens), 1))


class StatelessDrafter:
    """A drafter that keeps nothing between rounds."""

    def reset(self, keep: int, temperature: float, seed: int) -> None:
        pass

    def catch_up(self, context: list[int]) -> None:
        pass

    def commit(self, n_committed: int) -> None:
        pass


class NoDrafter(StatelessDrafter):
    """K=0: one token per round trip."""

    def propose(self, context: list[int], k: int) -> Drafts:
        return Drafts(torch.zeros(0, dtype=torch.long))


class NgramDrafter(StatelessDrafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`) and propose what followed it. Free, and strong on code and quotes."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, context: list[int], k: int) -> Drafts:
        if k > 0:
            for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
                suffix = context[-n:]
                for start in range(len(context) - n - 1, -1, -1):
                    if context[start:start + n] == suffix:
                        return one_hot_drafts(context[start + n:start + n + k])
        return one_hot_drafts([])


class ModelDrafter:
    """A small causal LM (a built Stage with embeddings and head) with a static KV cache indexed by position.

    Its cache holds `cached` tokens of the context. A round feeds whatever the cache lacks (the
    prompt at first; normally just the last committed token; after a fully accepted round also dK,
    so the cache never has a hole), then runs K single-token steps."""

    def __init__(self, stage, max_k: int = 8, top_k: int = 32, use_graph: bool = False):
        self.stage = stage
        self.device = stage.device
        self.cached = 0
        self.step = DraftStep(stage, max(max_k, 1) + 1, top_k, use_graph)  # + 1: draft_ahead's guess

    @property
    def vocab_size(self) -> int:
        return self.stage.config.vocab_size

    def reset(self, keep: int, temperature: float, seed: int) -> None:
        """A new request whose context shares its first `keep` tokens with what the cache holds."""
        self.cached = min(self.cached, keep)
        self.stage.cache.rewind(self.cached)
        self.step.configure(temperature, seed)

    def catch_up(self, context: list[int]) -> None:
        """Take in every token of `context` the cache lacks (a prompt, ahead of drafting)."""
        missing = context[self.cached:]
        if missing:
            self.stage.cache.check_room(len(context))
            self.stage(torch.tensor([missing], device=self.device), num_logits=1, live=len(context))
            self.cached = len(context)

    def propose(self, context: list[int], k: int) -> Drafts:
        if k == 0:
            return one_hot_drafts([])
        self.stage.cache.check_room(len(context) + k - 1)
        self.catch_up(context[:-1])
        tokens, q_ids, q_probs = self.step.run(context[-1], k, start=len(context) - 1)
        self.cached = len(context) + k - 1
        return Drafts(tokens, q_ids, q_probs) if q_ids is not None else Drafts(tokens)

    def holds(self, n: int) -> None:
        """Its cache now holds the context's first n tokens (cache.dir loaded them: speculative.prefixes)."""
        self.cached = n
        self.stage.cache.rewind(n)

    def commit(self, n_committed: int) -> None:
        # Valid: the committed prefix the cache saw. Its last committed token is fed next round.
        self.cached = min(self.cached, n_committed - 1)
        self.stage.cache.rewind(self.cached)
