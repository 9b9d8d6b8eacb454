"""serve.max_concurrent: how many KV slots (requests served at once) every rank holds, and what they cost.

- A slot is one KV cache on every stage (every layer's keys and values at model.max_len) and, on rank 0, one
  in the drafter's cache: the estimate matches what a stage allocated with slots holds, and placement counts
  every slot (a budget that holds a rank's layers with one slot holds fewer with four).
- null: as many as every rank's budget holds, at most 8; an int: that many, or one line naming what fits; a
  one-shot run: 1. Every rank settles the same number in the handshake: the fewest asked, within every budget.
"""
from __future__ import annotations

import re

import pytest
import torch

from launch.build import build_draft_stage, build_stage
from launch.config import ConfigError, load_config
from launch.handshake import handshake
from launch.plan import AUTO_SLOTS, asked_slots, open_models, plan_here, rank_costs, settle_slots
from model_parallel.lines import human
from model_parallel.loader import ModelSource, load_stage
from model_parallel.memory import model_bytes
from model_parallel.quant import weight_bytes
from model_parallel.split import RankCosts, place_layers
from tests.support.ring_threads import in_threads

MAX_LEN = 1024  # long enough that a slot's cache weighs like a tiny layer's weights
BIG = 10**12


def held_bytes(stage) -> int:
    """What a loaded stage holds: its weights and every tensor of its cache."""
    cache = stage.cache
    tensors = [*cache.keys.values(), *cache.values.values(), cache.cells, cache.length]
    return weight_bytes(stage) + sum(t.numel() * t.element_size() for t in tensors)


def test_a_stage_with_slots_holds_what_is_estimated(tiny_qwen):
    estimate = model_bytes(ModelSource.open(tiny_qwen, "float32"), None, max_len=MAX_LEN)
    stage = load_stage(tiny_qwen, 1, 3, embed=False, head=True, dtype="float32")
    for slots in (1, 4):
        stage.allocate_cache(MAX_LEN, torch.float32, slots=slots)
        held = held_bytes(stage)
        assert abs(estimate.stage(1, 3, False, True, slots=slots) - held) <= 0.02 * held, slots
    assert estimate.stage(1, 3, False, True, slots=4) > 1.5 * estimate.stage(1, 3, False, True)  # the slots matter


def test_placement_counts_every_slot():
    """Rank 0 is fast, so it takes every layer its budget holds: three with one slot, one with four."""
    ranks = [RankCosts(100 + 3 * 150, 100, 150, layer_ms=1.0, slot_layer_bytes=50),
             RankCosts(BIG, 0, 150, layer_ms=10.0, slot_layer_bytes=50)]
    assert place_layers(4, ranks) == [3]
    assert place_layers(4, [r.at(4) for r in ranks]) == [1]
    assert ranks[0].at(4).bytes_for(1) == 100 + 150 + 3 * 50 and ranks[0].at(4).at(1) == ranks[0]


def costs_holding(slots_each: list[int], num_layers: int = 4) -> list[RankCosts]:
    """Every rank's costs (one layer each but the last, which takes the rest) with a budget that holds
    exactly slots_each[r] slots on rank r; rank 0's slot also holds a drafter's cache."""
    ranks = len(slots_each)
    layers = [1] * (ranks - 1) + [num_layers - ranks + 1]
    out = []
    for r, (n, s) in enumerate(zip(layers, slots_each)):
        fixed, layer, slot_fixed, slot_layer = 1000, 300, (200 if r == 0 else 8), 100
        budget = fixed + (s - 1) * slot_fixed + n * (layer + (s - 1) * slot_layer)
        out.append(RankCosts(budget, fixed, layer, slot_fixed_bytes=slot_fixed, slot_layer_bytes=slot_layer))
    return out


def cfg_of(*args: str):
    serving = any(a.startswith("serve.port=") for a in args)  # a server takes no prompt of its own
    return load_config(["draft.kind=none", *([] if serving else ["prompt_ids=[1]"]), *args])


SERVING = cfg_of("serve.port=0")


@pytest.mark.parametrize("slots_each, asked, agreed", [
    ([5, 9], [0, 0], 5),  # null: what fits every rank (rank 0 holds 5)
    ([9, 3], [0, 0], 3),  # ... the last rank limits
    ([20, 20], [0, 0], AUTO_SLOTS),  # ... at most 8
    ([20, 20, 6], [0, 0, 0], 6),
    ([20, 20], [0, 3], 3),  # the fewest asked (serve.max_concurrent=3 on one rank)
    ([20, 20], [1, 0], 1),  # a one-shot rank 0 asks for one
    ([20, 20, 20], [4, 0, 6], 4),
])
def test_the_ranks_agree_on_the_fewest_asked_within_every_budget(slots_each, asked, agreed):
    cuts = list(range(1, len(slots_each)))  # the split the budgets were made for
    assert settle_slots(SERVING, 4, costs_holding(slots_each), cuts, asked) == agreed


def test_null_takes_the_most_slots_some_split_holds():
    """Without a given split, the slots come first: the split is then the fastest that holds them."""
    ranks = [RankCosts(100 + 3 * 150, 100, 150, layer_ms=1.0, slot_layer_bytes=50),
             RankCosts(100 + 3 * 150, 100, 150, layer_ms=10.0, slot_layer_bytes=50)]
    assert place_layers(4, ranks) == [3]  # one slot: rank 0, the faster, takes 3 layers
    # two slots: 100 + 3 * (150 + 50) > 550 on rank 0, but 2 layers each hold them (100 + 2 * 200); three do not fit
    assert settle_slots(SERVING, 4, ranks, None, [0, 0]) == 2
    assert place_layers(4, [r.at(2) for r in ranks]) == [2]


def test_slots_asked_that_do_not_fit_are_one_line():
    with pytest.raises(ConfigError) as info:
        settle_slots(cfg_of("serve.port=0", "serve.max_concurrent=6"), 4, costs_holding([9, 4]), [1], [6, 6])
    message = str(info.value)
    assert "\n" not in message and message.startswith("serve.max_concurrent=6: 6 KV slots do not fit model.max_memory")
    for part in ("model.split=1", "4 fit: give serve.max_concurrent=4", "model.max_len=4096", "model.quant=nf4"):
        assert part in message, message
    # not even one slot: the split's own line (settle_cuts) says why, at one slot
    assert settle_slots(SERVING, 4, costs_holding([0, 4]), [1], [6, 6]) == 1


def test_a_one_shot_run_uses_one_slot_and_a_server_what_it_asks(tiny_qwen, tiny_qwen_draft):
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=2", f"model.max_len={MAX_LEN}",
            "draft.kind=model", f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "draft.max_len=512", "gen.max_new_tokens=16"]
    assert asked_slots(cfg_of(*args, "serve.max_concurrent=4")) == 1  # no serve.port
    assert [asked_slots(cfg_of(*args, "serve.port=0", *more)) for more in ([], ["serve.max_concurrent=5"])] == [0, 5]
    one_shot = plan_here(load_config([*args, "prompt_ids=[1]", "serve.max_concurrent=4"]), 0)
    served = plan_here(load_config([*args, "serve.port=0", "serve.max_concurrent=3"]), 0)
    assert (one_shot.slots, served.slots) == (1, 3)
    assert build_stage(served).cache.num_slots == 3 and build_draft_stage(served).cache.num_slots == 3
    assert plan_here(load_config([*args, "serve.port=0"]), 1).slots == AUTO_SLOTS  # free memory holds 8 tiny slots


def test_a_slot_on_rank_0_counts_the_drafters_cache(tiny_qwen, tiny_qwen_draft):
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", f"model.max_len={MAX_LEN}", "draft.kind=model",
            f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "draft.max_len=512", "serve.port=0"]
    cfg = load_config(args)
    with_drafter = rank_costs(cfg, open_models(cfg, 0), 0, 2)[0]
    alone = rank_costs(load_config([*args, "draft.kind=none"]), open_models(load_config([*args, "draft.kind=none"]), 0), 0, 2)[0]
    drafter = build_draft_stage(plan_here(load_config([*args, "serve.max_concurrent=2"]), 0))
    two = held_bytes(drafter)
    drafter.allocate_cache(512, torch.float32, slots=1)
    one_slot = two - held_bytes(drafter)  # what the drafter's second slot holds
    assert abs(with_drafter.slot_fixed_bytes - alone.slot_fixed_bytes - one_slot) <= 0.02 * one_slot


def budget_for(tiny_qwen, rank: int, layers: range, slots: int, ranks: int) -> int:
    """Between what rank `rank` holds with `slots` and with one more (the estimate, checked above)."""
    b = model_bytes(ModelSource.open(tiny_qwen, "float32"), None, max_len=MAX_LEN)
    held = [b.stage(layers.start, layers.stop, rank == 0, rank == ranks - 1, slots=s) for s in (slots, slots + 1)]
    return sum(held) // 2


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_handshake_settles_one_number_and_each_rank_says_it(tiny_qwen, ranks, capsys):
    """serve.max_concurrent=null on every rank; the last rank's budget holds 3 slots of its layers, the others 8+:
    every rank's Plan has 3 slots and its start-up line says so, with what a slot costs there."""
    split, layers = ("2", [range(0, 2), range(2, 4)]) if ranks == 2 else ("[1,2]", [range(0, 1), range(1, 2), range(2, 4)])
    sizes = [budget_for(tiny_qwen, r, layers[r], 3 if r == ranks - 1 else 9, ranks) for r in range(ranks)]
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", f"model.split={split}", f"model.max_len={MAX_LEN}",
            "draft.kind=none", "serve.port=0", f"model.max_memory=[{','.join(map(str, sizes))}]"]

    def body(r, prev, next):
        cfg = load_config(args)
        return handshake(cfg, open_models(cfg, r), prev, next, r, ranks)
    plans = in_threads(ranks, body)
    assert [p.slots for p in plans.values()] == [3] * ranks, plans
    lines = sorted(re.findall(r"^\[rank \d: .*\]$", capsys.readouterr().err, re.MULTILINE))
    assert len(lines) == ranks
    for r, line in enumerate(lines):
        per_slot = plans[r].costs[r].slot_bytes(len(layers[r]))
        assert line.endswith(f"; serving up to 3 requests at once (serve.max_concurrent=null: as many as every rank's "
                             f"budget holds, at most 8): 3 KV slots of {MAX_LEN} tokens, {human(per_slot)} each on rank {r}]"), line

    def rank_0_asks_two(r, prev, next):
        cfg = load_config([*args, *(["serve.max_concurrent=2"] if r == 0 else [])])
        return handshake(cfg, open_models(cfg, r), prev, next, r, ranks)
    assert [p.slots for p in in_threads(ranks, rank_0_asks_two).values()] == [2] * ranks

    def too_many(r, prev, next):
        cfg = load_config([*args, "serve.max_concurrent=5"])
        return handshake(cfg, open_models(cfg, r), prev, next, r, ranks)
    errors = in_threads(ranks, too_many)
    assert all(isinstance(e, ConfigError) for e in errors.values()), errors
    assert len({str(e) for e in errors.values()}) == 1  # the same line on every rank
    assert "serve.max_concurrent=5: 5 KV slots do not fit" in str(errors[0]) and "3 fit" in str(errors[0])

