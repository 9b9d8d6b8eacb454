"""A static KV cache indexed by position, with its write position on the device.

Why not transformers' StaticCache: in 5.24 each of its layers keeps its own running length and
appends at it, so a stage must crop every layer to rewind and the write position is implicit in how
many updates ran. Here every layer of a stage writes at the same slots, `length + arange(T)`, read
from one device tensor: a rejected draft is simply overwritten by the next round, rewinding is one
in-place `fill_`, and a CUDA graph captured over a step replays at whatever position the tensor holds
(no Python int is baked in at capture time, the bug behind the "the the the" loops elsewhere).

The decoder layers of transformers call `cache.update(key, value, layer_idx, ...)` and nothing else,
so this class implements that one method rather than subclassing `transformers.Cache` (whose layer
machinery would bring back the per-layer lengths).
"""
from __future__ import annotations

import torch


def within_window(slot_ids: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """[T, S]: which slots a sliding-window layer at each of `positions` may still see (at most
    `window` behind it; the causal part is the caller's mask)."""
    return slot_ids[None, :] > positions[:, None] - window


class CacheOverflowError(RuntimeError):
    """More tokens than the cache was allocated for; the message names the setting to raise."""


class StaticKVCache:
    def __init__(self, layer_ids, capacity: int, num_kv_heads: int, head_dim: int, dtype, device,
                 setting: str = "model.max_len", sliding_window: int | None = None):
        self.capacity = capacity
        self.setting = setting  # the config key that sets `capacity`, for the overflow message
        self.sliding_window = sliding_window
        shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.length = torch.zeros((), dtype=torch.long, device=device)  # committed + in-flight tokens
        self.slot_ids = torch.arange(capacity, device=device)
        self.slots = None  # positions being written by the current forward, set by `begin`
        self.live = None  # slots the current forward attends over (None: all), set by `begin`

    # --- the step: begin -> layers call update -> advance ------------------------------------
    def begin(self, num_tokens: int, live: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [1, T] of the next T tokens and the boolean attention mask [1, 1, T, slots].

        `live` (a host-side int: the cache length after this write) lets an eager step attend over
        the live slots only; on CPU attending over all 4096 slots of a default cache costs a third of
        a small model's step. A captured step passes None: shapes stay static, the mask does the work."""
        positions = self.length + self.slot_ids[:num_tokens]
        self.slots = positions
        self.live = live
        slot_ids = self.slot_ids if live is None else self.slot_ids[:live]
        visible = slot_ids[None, :] <= positions[:, None]
        if self.sliding_window:
            visible &= within_window(slot_ids, positions, self.sliding_window)
        return positions[None, :], visible[None, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.keys[layer_idx].index_copy_(2, self.slots, key)
        self.values[layer_idx].index_copy_(2, self.slots, value)
        if self.live is None:
            return self.keys[layer_idx], self.values[layer_idx]
        return self.keys[layer_idx][:, :, :self.live], self.values[layer_idx][:, :, :self.live]

    def advance(self, num_tokens: int) -> None:
        self.length.add_(num_tokens)

    # --- host-side control, outside any captured region -------------------------------------
    def rewind(self, length: int) -> None:
        """Keep the first `length` tokens; later slots are overwritten by the next writes. O(1), in place."""
        self.length.fill_(length)

    def check_room(self, needed: int) -> None:
        """Raise before a forward that would write past the end (index_copy_ on CUDA would assert)."""
        if needed > self.capacity:
            raise CacheOverflowError(
                f"the KV cache holds {self.capacity} tokens but this step needs {needed}; "
                f"raise {self.setting} (prompt + max_new_tokens + spec.k must fit)")
