"""A stage: a contiguous slice of a decoder's layers, optionally with the embeddings in front and the
final norm + LM head behind, over its own static KV cache.

Rank 0's stage is (embeddings, layers [0, cut)); the last rank's is (layers [cut, L), norm, head); a
drafter is one stage with everything. With N > 2 ranks a middle rank's stage is its layers alone.
All of them run the same forward.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from kvcache.static_cache import StaticKVCache, within_window


class Stage(nn.Module):
    def __init__(self, config, layers: list[nn.Module], first_layer: int, rotary: nn.Module,
                 embed: nn.Module | None = None, norm: nn.Module | None = None, head: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.first_layer = first_layer
        self.layers = nn.ModuleList(layers)
        self.rotary = rotary
        self.embed, self.norm, self.head = embed, norm, head
        self.cache: StaticKVCache | None = None
        # Families that mix sliding-window and global layers (gemma3_text, qwen3 with a window) name each
        # layer's kind; each kind has its own mask, and Gemma's its own rotary base.
        kinds = getattr(config, "layer_types", None)
        self.layer_kinds = [kinds[i] for i in self.layer_ids] if kinds else None
        self.rotary_per_kind = "layer_type" in inspect.signature(rotary.forward).parameters
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.cache_kwarg = cache_kwarg(layers[0]) if layers else "cache"

    @property
    def layer_ids(self) -> range:
        return range(self.first_layer, self.first_layer + len(self.layers))

    def allocate_cache(self, capacity: int, dtype, setting: str = "model.max_len", slots: int = 1) -> StaticKVCache:
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        window = None if self.layer_kinds else window  # per kind, in forward
        self.cache = StaticKVCache(self.layer_ids, capacity, cfg.num_key_value_heads, head_dim, dtype,
                                   self.device, setting=setting, sliding_window=window, slots=slots)
        return self.cache

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def run(self, start: int, x: torch.Tensor, num_logits: int | None = 0, slot: int = 0) -> torch.Tensor:
        """The forward of a block that begins at position `start` of `slot`: the slot is rewound there first
        (rank 0 is the authority on the committed length; positions of rejected drafts are simply overwritten)
        and checked for room, so a block that would not fit is one clear error, not a device assert."""
        live = start + x.shape[1]
        self.cache.rewind(start, slot)
        self.cache.check_room(live)
        return self(x, num_logits=num_logits, live=live, rows=[slot])

    def run_rows(self, starts: list[int], x: torch.Tensor, slots: list[int], ends: list[int],
                 num_logits: int | None = 0) -> torch.Tensor:
        """Several requests' blocks as one forward (serve.max_concurrent): row b of x [B, T(, H)] is slot
        slots[b]'s block from starts[b], its real tokens the first ends[b] (the rest pad it on the right: they
        are written past the block, where the next round overwrites them, and no real token attends to them).
        With a head: the logits of each row's last `num_logits` real positions [B, n, V]."""
        for slot, start in zip(slots, starts):
            self.cache.rewind(start, slot)
        live = max(starts) + x.shape[1]
        self.cache.check_room(live)
        return self(x, num_logits=num_logits, live=live, rows=slots, ends=ends)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, num_logits: int | None = 0, live: int | None = None, rows=None,
                ends: list[int] | None = None) -> torch.Tensor:
        """x: token ids [B, T] when this stage has the embeddings, else hidden states [B, T, H], row b for the
        cache slot rows[b] (None: slot 0; see StaticKVCache.begin).

        Writes the T tokens into each row's slot at its current length and advances it. Returns hidden
        states [B, T, H], or with a head the logits of the last `num_logits` positions [B, n, V] (of each
        row's first ends[b] when given; the head over a long prompt's every position would cost more than
        the layers). `live`: the longest slot's length after this call when the caller knows it (eager)."""
        h = self.embed(x) if self.embed is not None else x
        positions, mask = self.cache.begin(h.shape[1], live, rows)
        kinds = self.layer_kinds or [None] * len(self.layers)
        masks, cos_sin = {}, {}
        for kind in set(kinds):
            masks[kind] = self.windowed(mask, positions) if kind == "sliding_attention" else mask
            cos_sin[kind] = self.rotary(h, positions, kind) if self.rotary_per_kind else self.rotary(h, positions)
        for layer, kind in zip(self.layers, kinds):
            h = layer(h, attention_mask=masks[kind], position_ids=positions, **{self.cache_kwarg: self.cache},
                      use_cache=True, position_embeddings=cos_sin[kind])
        self.cache.advance(h.shape[1])
        if self.head is None or num_logits is None:  # None: only the cache wanted (a prefill chunk, a catch-up)
            return h
        logits = self.head(self.norm(last_positions(h, num_logits, ends))).float()
        if self.softcap:  # Gemma's final logit soft-capping, as its ForCausalLM applies it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def windowed(self, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A sliding-window layer's mask: the causal mask, minus slots more than the window behind."""
        window = self.config.sliding_window
        if not window:
            return mask
        cells = torch.arange(mask.shape[-1], device=mask.device)
        return mask & within_window(cells, positions, window)[:, None]


def last_positions(h: torch.Tensor, n: int, ends: list[int] | None) -> torch.Tensor:
    """h's last n positions [B, n, H]; of each row's first ends[b] positions when given (rows padded on the right)."""
    if ends is None or all(end == h.shape[1] for end in ends):
        return h[:, -n:]
    index = (torch.tensor(ends)[:, None] - n + torch.arange(n)).clamp(min=0).to(h.device)
    return h.gather(1, index[:, :, None].expand(-1, -1, h.shape[-1]))


def cache_kwarg(layer: nn.Module) -> str:
    """The name a decoder layer takes its KV cache by: `cache` in transformers 5.24, `past_key_values` in 5.17
    (the lowest supported). The one place the two differ for us; a wrong name is worse than an error: the
    layer swallows it in **kwargs and attends over the current block alone."""
    parameters = inspect.signature(type(layer).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
