"""Drafters behind one small interface: `propose(context, k)` -> Drafts; `commit(n)` after the round.

`context` is every committed token (prompt + output), its last one the token the target has yet to
see. A drafter returns at most k tokens (fewer is fine) and, when the target samples, the sparse
distribution each was drawn from (rank 1 needs q for rejection sampling).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.draft_step import DraftStep
from model_parallel.loader import load_stage


@dataclass
class Drafts:
    tokens: torch.Tensor  # [k] int64
    q_ids: torch.Tensor | None = None  # [k, m] token ids of each draft's distribution
    q_probs: torch.Tensor | None = None  # [k, m] their probabilities

    def __len__(self) -> int:
        return self.tokens.numel()


def one_hot_drafts(tokens: list[int]) -> Drafts:
    """A deterministic proposal is a one-hot q: rejection sampling then keeps d with probability p(d)."""
    t = torch.tensor(tokens, dtype=torch.long)
    return Drafts(t, t[:, None].clone(), torch.ones(len(tokens), 1))


class NoDrafter:
    """K=0: one token per round trip."""

    def propose(self, context: list[int], k: int) -> Drafts:
        return Drafts(torch.zeros(0, dtype=torch.long))

    def commit(self, n_committed: int) -> None:
        pass


class NgramDrafter:
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

    def commit(self, n_committed: int) -> None:
        pass


class ModelDrafter:
    """A small causal LM on its own device with a static KV cache indexed by position.

    Its cache holds `cached` tokens of the context. A round feeds whatever the cache lacks (the
    prompt at first; normally just the last committed token; after a fully accepted round also dK,
    so the cache never has a hole), then runs K single-token steps."""

    def __init__(self, folder: str, device: str = "cpu", dtype: str = "float32", max_len: int = 4096,
                 max_k: int = 8, temperature: float = 0.0, top_k: int = 32, seed: int = 0,
                 graph: str = "auto", quant=None):
        use_graph = {"on": True, "off": False, "auto": device.startswith("cuda")}[graph]
        if use_graph and not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError(f"draft.graph=on needs a CUDA draft.device (got {device!r}{', no CUDA here' if not torch.cuda.is_available() else ''}); use draft.graph=auto")
        self.stage = load_stage(folder, 0, _num_layers(folder), embed=True, head=True, dtype=dtype,
                                device=device, progress="drafter", quant=quant)
        self.stage.allocate_cache(max_len, self.stage.embed.weight.dtype, setting="draft.max_len")
        self.device = device
        self.cached = 0
        generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
        self.step = DraftStep(self.stage, max(max_k, 1), top_k, temperature, generator, use_graph)

    @property
    def vocab_size(self) -> int:
        return self.stage.config.vocab_size

    def propose(self, context: list[int], k: int) -> Drafts:
        if k == 0:
            return one_hot_drafts([])
        catch_up = context[self.cached:]
        self.stage.cache.check_room(len(context) + k - 1)
        if len(catch_up) > 1:
            self.stage(torch.tensor([catch_up[:-1]], device=self.device), num_logits=1, live=len(context) - 1)
        tokens, q_ids, q_probs = self.step.run(catch_up[-1], k, start=len(context) - 1)
        self.cached = len(context) + k - 1
        return Drafts(tokens, q_ids, q_probs) if q_ids is not None else Drafts(tokens)

    def commit(self, n_committed: int) -> None:
        # Valid: the committed prefix the cache saw. Its last committed token is fed next round.
        self.cached = min(self.cached, n_committed - 1)
        self.stage.cache.rewind(self.cached)


def _num_layers(folder: str) -> int:
    from model_parallel.loader import load_config
    return load_config(folder).num_hidden_layers
