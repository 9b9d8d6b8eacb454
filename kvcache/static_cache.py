"""A static KV cache indexed by position, with its write positions on the device, in one or more slots.

Why not transformers' StaticCache: in 5.24 each of its layers keeps its own running length and
appends at it, so a stage must crop every layer to rewind and the write position is implicit in how
many updates ran. Here every layer of a stage writes at the same positions, `length + arange(T)`, read
from one device tensor: a rejected draft is simply overwritten by the next round, rewinding is one
in-place write, and a CUDA graph captured over a step replays at whatever position the tensor holds
(no Python int is baked in at capture time, the bug behind the "the the the" loops elsewhere).

Slots (serve.max_concurrent): every request being served owns one slot, a [kv_heads, capacity, head_dim] row
of every layer's keys and values with its own length. A forward writes a batch of rows, row b into slot
`rows[b]` at that slot's positions, and reads those slots only: no request sees another's tokens. A forward
over one slot known on the host (every eager single-request step) works on views of it, as with one slot.

The decoder layers of transformers call `cache.update(key, value, layer_idx, ...)` and nothing else,
so this class implements that one method rather than subclassing `transformers.Cache` (whose layer
machinery would bring back the per-layer lengths).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def within_window(cells: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """[..., T, S]: which cache positions `cells` [S] a sliding-window layer at each of `positions` [..., T] may
    still see (at most `window` behind it; the causal part is the caller's mask)."""
    return cells > positions[..., None] - window


class CacheOverflowError(RuntimeError):
    """More tokens than the cache was allocated for; the message names the setting to raise."""


class StaticKVCache:
    def __init__(self, layer_ids, capacity: int, num_kv_heads: int, head_dim: int, dtype, device,
                 setting: str = "model.max_len", sliding_window: int | None = None, slots: int = 1):
        self.capacity = capacity
        self.num_slots = slots
        self.setting = setting  # the config key that sets `capacity`, for the overflow message
        self.sliding_window = sliding_window
        shape = (slots, num_kv_heads, capacity, head_dim)
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.length = torch.zeros(slots, dtype=torch.long, device=device)  # each slot's committed + in-flight tokens
        self.cells = torch.arange(capacity, device=device)  # the positions a slot holds
        self.first_row = torch.zeros(1, dtype=torch.long, device=device)  # rows=None: slot 0
        self.row_ids = torch.arange(slots, device=device)[:, None]  # [slots, 1]: a span's rows, for its writes
        # set by `begin` for the current forward:
        self.rows = self.first_row  # [B] the slot each row of the batch writes and reads
        # (first, stop): those slots as host ints when they are consecutive and in order (one known slot, or a batch
        # of several): its keys and values are read as a view; else gathered, a copy of every row's live part in
        # every layer (a tiny drafter layer's step over four rows: 0.058 ms a row per 1,000 cached tokens gathered,
        # 0.033 as a view, one row alone 0.027; bench/draft_context.py --rows 4)
        self.span: tuple[int, int] | None = (0, 1)
        self.positions = None  # [B, T] the positions being written
        self.live = None  # positions the current forward attends over (None: all)

    # --- the step: begin -> layers call update -> advance ------------------------------------
    def begin(self, num_tokens: int, live: int | None = None, rows: list[int] | torch.Tensor | None = None):
        """Positions [B, T] of the next T tokens of each row and the boolean attention mask [B, 1, T, positions].

        `rows`: the slot of each row (a list, or a device tensor a captured step keeps static); None: slot 0.
        `live` (a host-side int: the longest slot's length after this write) lets an eager step attend over
        the live positions only; on CPU attending over all 4096 of a default cache costs a third of a small
        model's step. A captured step passes None: shapes stay static, the mask does the work."""
        self.span = None
        if rows is None:
            rows, self.span = self.first_row, (0, 1)
        elif isinstance(rows, list):
            if rows == list(range(rows[0], rows[0] + len(rows))):
                self.span = (rows[0], rows[0] + len(rows))
            rows = self.first_row if rows == [0] else torch.tensor(rows, device=self.length.device)
        elif self.num_slots == 1:
            self.span = (0, 1)
        self.rows = rows
        positions = self.length.index_select(0, rows)[:, None] + self.cells[:num_tokens]
        self.positions = positions
        self.live = live
        cells = self.cells if live is None else self.cells[:live]
        visible = cells <= positions[..., None]
        if self.sliding_window:
            visible &= within_window(cells, positions, self.sliding_window)
        return positions, visible[:, None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self._write(self.keys[layer_idx], key), self._write(self.values[layer_idx], value)

    def _write(self, store: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write `new` [B, heads, T, dim] at each row's slot and positions; the rows' slots back, live part only."""
        if self.span is not None:
            view = store[self.span[0]:self.span[1]]
            if view.shape[0] == 1:
                view.index_copy_(2, self.positions[0], new)
            else:
                view[self.row_ids[:view.shape[0]], :, self.positions] = new.transpose(1, 2)
            return view if self.live is None else view[:, :, :self.live]
        store[self.rows[:, None], :, self.positions] = new.transpose(1, 2)
        return (store if self.live is None else store[:, :, :self.live]).index_select(0, self.rows)

    def advance(self, num_tokens: int) -> None:
        if self.span is not None:
            self.length[self.span[0]:self.span[1]].add_(num_tokens)
        else:
            self.length.index_add_(0, self.rows, torch.full_like(self.rows, num_tokens))

    # --- host-side control, outside any captured region -------------------------------------
    def rewind(self, length: int, slot: int = 0) -> None:
        """Keep the first `length` tokens of `slot`; later positions are overwritten by the next writes. O(1), in place."""
        self.length[slot:slot + 1].fill_(length)

    def copy_prefix(self, source: int, slot: int, tokens: int) -> None:
        """`slot` holds the first `tokens` positions of slot `source` (another request's prompt sharing them: a
        system prompt, a document), and nothing after. In place, on the device."""
        for store in (*self.keys.values(), *self.values.values()):
            store[slot, :, :tokens] = store[source, :, :tokens]
        self.rewind(tokens, slot)

    def check_room(self, needed: int) -> None:
        """Raise before a forward that would write past the end (index_copy_ on CUDA would assert)."""
        if needed > self.capacity:
            raise CacheOverflowError(
                f"the KV cache holds {self.capacity} tokens but this step needs {needed}; "
                f"raise {self.setting} (prompt + max_new_tokens + spec.k must fit)")

    def slot(self, slot: int) -> SlotView:
        """One slot as a cache of its own (views): what kvcache.disk reads and writes."""
        return SlotView({i: k[slot:slot + 1] for i, k in self.keys.items()},
                        {i: v[slot:slot + 1] for i, v in self.values.items()}, self, slot)


@dataclass
class SlotView:
    """One slot of a StaticKVCache: its keys and values [1, heads, capacity, dim] per layer (views) and its rewind."""
    keys: dict
    values: dict
    cache: StaticKVCache
    index: int

    @property
    def length(self) -> torch.Tensor:
        return self.cache.length[self.index]

    def rewind(self, length: int) -> None:
        self.cache.rewind(length, self.index)
