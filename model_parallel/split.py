"""model.split=auto: the split that balances the two ranks' busy time per round.

With spec.overlap, rank 0 drafts the next round while rank 1 verifies this one, so a round takes about
the busier rank's time, not the sum. Per round of K drafts:
    rank 0: the drafter's steps (K, or K+1 with overlap: its guess of the target's token first)
            + layers [0, split) over a block of K+1 tokens
    rank 1: layers [split, L) + the LM head over that block
Each cost is timed on this machine before loading (`time_linears`: the layers' and heads' matmuls
with the models' shapes and dtype), since how a block compares with one token depends on the hardware:
about the same on a GPU, where a step waits on memory; up to K+1 times on a CPU without the dtype's
instructions. Embedding lookups, norms and attention over a short context are left out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def layer_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's matmuls: q, k, v, o and the gated MLP's three."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    return [(heads * head_dim, hidden), (kv, hidden), (kv, hidden), (hidden, heads * head_dim),
            (inter, hidden), (inter, hidden), (hidden, inter)]


def time_linears(shapes: list[tuple[int, int]], tokens: int, device: str, dtype: torch.dtype, repeats: int = 3,
                 max_rows: int = 16384) -> float:
    """ms for `tokens` tokens through these matmuls here (best of `repeats`). A matrix taller than
    `max_rows` (an LM head) is timed on a slice and scaled, to keep the memory small."""
    total = 0.0
    for rows, cols in shapes:
        scale = max(1.0, rows / max_rows)
        weight = torch.full((min(rows, max_rows), cols), 0.01, dtype=dtype, device=device)
        x = torch.full((tokens, cols), 0.01, dtype=dtype, device=device)
        best = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        total += best * 1000 * scale
    return total


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


@dataclass
class SplitPlan:
    split: int
    rank0_ms: float  # estimated busy per round
    rank1_ms: float

    def describe(self, num_layers: int, draft_steps: int, block: int) -> str:
        drafter = f" + the drafter's {draft_steps} steps" if draft_steps else ""
        return (f"model.split=auto: {self.split} (rank 0: layers 0-{self.split - 1}{drafter}, rank 1: layers "
                f"{self.split}-{num_layers - 1} + head, over blocks of {block}; estimated busy per round "
                f"{self.rank0_ms:.0f} vs {self.rank1_ms:.0f} ms, timed here on the models' matmuls)")


def balanced_split(num_layers: int, layer_ms: float, head_ms: float, drafting_ms: float = 0.0) -> SplitPlan:
    """The split in 1..L-1 that makes the busier rank least busy (on a tie, the one nearer half)."""
    plans = [SplitPlan(s, drafting_ms + s * layer_ms, (num_layers - s) * layer_ms + head_ms)
             for s in range(1, num_layers)]
    return min(plans, key=lambda p: (max(p.rank0_ms, p.rank1_ms), abs(p.split - num_layers / 2)))


def plan_split(target, k: int, device: str, dtype: torch.dtype, draft=None, draft_device: str = "cpu",
               draft_dtype: torch.dtype | None = None, draft_steps: int = 0) -> SplitPlan:
    """Time the pieces here and balance them. `target`/`draft`: HF configs; `draft_steps` per round."""
    block = k + 1
    layer_ms = time_linears(layer_shapes(target), block, device, dtype)
    head_ms = time_linears([(target.vocab_size, target.hidden_size)], block, device, dtype)
    drafting_ms = 0.0
    if draft is not None and draft_steps:
        dtype_d = draft_dtype or dtype
        step_ms = (draft.num_hidden_layers * time_linears(layer_shapes(draft), 1, draft_device, dtype_d)
                   + time_linears([(draft.vocab_size, draft.hidden_size)], 1, draft_device, dtype_d))
        drafting_ms = draft_steps * step_ms
    return balanced_split(target.num_hidden_layers, layer_ms, head_ms, drafting_ms)


def even_cuts(num_layers: int, ranks: int) -> list[int]:
    """model.split=auto over more than two ranks (until a timed placement over N ranks replaces it): the
    first layer of ranks 1..N-1 when the layers are shared out evenly; a layer left over goes to a middle
    rank first (rank 0 also drafts, the last rank also runs the head)."""
    sizes = [num_layers // ranks] * ranks
    for r in [*range(1, ranks - 1), ranks - 1, 0][:num_layers % ranks]:
        sizes[r] += 1
    return [sum(sizes[:r]) for r in range(1, ranks)]
