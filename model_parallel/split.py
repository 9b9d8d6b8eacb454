"""model.split=auto: the split that balances the two ranks' busy time per round.

With spec.overlap, rank 0 drafts the next round while rank 1 verifies this one, so a round takes about
the busier rank's time, not the sum. Per round of K drafts:
    rank 0: K drafter steps (one token each) + layers [0, split) over a block of K+1 tokens
    rank 1: layers [split, L) + the LM head over that block
Costs are counted in parameters touched, a one-token step touching each parameter once and a block of
K+1 tokens `block_factor` times (about 1 where a step is bound by memory, as on a GPU; up to K+1 where
it is bound by arithmetic, as on a CPU without the dtype's instructions). Embedding lookups are free.
"""
from __future__ import annotations

from dataclasses import dataclass


def layer_params(config) -> int:
    """Parameters of one decoder layer (attention + gated MLP; norms are negligible)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    return attention + 3 * hidden * inter


def head_params(config) -> int:
    return config.vocab_size * config.hidden_size


def model_step_params(config) -> int:
    """What one token through a whole model (its drafter) touches: every layer and the head."""
    return config.num_hidden_layers * layer_params(config) + head_params(config)


@dataclass
class SplitPlan:
    split: int
    rank0: float  # estimated busy per round, parameters touched
    rank1: float

    def describe(self, num_layers: int, k: int, block: int, block_factor: float) -> str:
        drafter = f" + the drafter's {k} steps" if k else ""
        return (f"model.split=auto: {self.split} (rank 0: layers 0-{self.split - 1}{drafter}, rank 1: layers "
                f"{self.split}-{num_layers - 1} + head; estimated busy per round {self.rank0 / 1e9:.2f} vs "
                f"{self.rank1 / 1e9:.2f} G parameter-tokens; a block of {block} costs {block_factor:.1f}x one token here)")


def balanced_split(target, k: int, draft=None, block_factor: float = 1.0) -> SplitPlan:
    """The split in 1..L-1 that makes the busier rank least busy. `target`/`draft`: HF configs."""
    layers, per_layer = target.num_hidden_layers, layer_params(target) * block_factor
    drafting = k * model_step_params(draft) if draft is not None and k > 0 else 0
    head = head_params(target) * block_factor
    plans = [SplitPlan(s, drafting + s * per_layer, (layers - s) * per_layer + head) for s in range(1, layers)]
    return min(plans, key=lambda p: (max(p.rank0, p.rank1), abs(p.split - layers / 2)))
