"""model.max_memory and model.split=auto: layers placed by memory first, speed second.

- place_layers (N ranks) against a brute force over every split: it fits every budget and its busiest
  rank is as little busy as the best split's; budgets no split fits are one NoFit line.
- The bytes a stage is estimated to hold (model_parallel.memory, from config.json's shapes) against what
  the loaded stage holds (parameters, buffers, NF4 states, KV cache): within 5%, fp32, bf16, NF4.
- End to end (both ranks in-process): an asymmetric pair (a small rank 0 budget and a large rank 1, and
  the reverse) places by memory and its output is identical to transformers generate; a split that breaks
  a budget, or budgets that no split fits, stop both ranks in one line before any weight is read.
"""
from __future__ import annotations

import itertools
import os
import re
import random

import pytest
import torch

from launch.build import build_draft_stage
from launch.config import ConfigError, load_config as load_tandem_config
from launch.plan import core_share, open_models, plan_here, rank_costs
from model_parallel.lines import human
from model_parallel.loader import ModelSource, load_stage
from model_parallel.memory import model_bytes, nf4_bytes, parse_size
from model_parallel.quant import NF4Settings, nf4_linear, weight_bytes
from model_parallel.split import NoFit, RankCosts, best_split, layer_counts, place_layers
from tests.support.tiny_models import ids_arg, reference_greedy, run_pair

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5]
BIG = 10**12


# --- placement ----------------------------------------------------------------------------------

def brute_force(num_layers: int, ranks: list[RankCosts]) -> float | None:
    """The least busiest-rank ms over every split that fits, by enumeration (None: nothing fits)."""
    best = None
    for cuts in itertools.combinations(range(1, num_layers), len(ranks) - 1):
        counts = layer_counts(num_layers, list(cuts))
        if all(r.fixed_bytes + c * r.layer_bytes <= r.budget for r, c in zip(ranks, counts)):
            busiest = max(r.fixed_ms + c * r.layer_ms for r, c in zip(ranks, counts))
            best = busiest if best is None else min(best, busiest)
    return best


@pytest.mark.parametrize("n_ranks", [2, 3, 4])
def test_place_layers_is_as_good_as_every_split_tried(n_ranks):
    rng = random.Random(n_ranks)
    for _ in range(150):
        num_layers = rng.randint(n_ranks, 14)
        ranks = [RankCosts(budget=rng.choice([BIG, rng.randint(1, 12) * 100]), fixed_bytes=rng.choice([0, 100, 250]),
                           layer_bytes=100, layer_ms=rng.uniform(1, 20), fixed_ms=rng.choice([0.0, rng.uniform(0, 100)]))
                 for _ in range(n_ranks)]
        best = brute_force(num_layers, ranks)
        if best is None:
            with pytest.raises(NoFit, match="model.max_memory: no split of the"):
                place_layers(num_layers, ranks)
            continue
        cuts = place_layers(num_layers, ranks)
        counts = layer_counts(num_layers, cuts)
        assert len(cuts) == n_ranks - 1 and min(counts) >= 1 and sum(counts) == num_layers
        assert all(r.fixed_bytes + c * r.layer_bytes <= r.budget for r, c in zip(ranks, counts)), (ranks, cuts)
        assert max(r.fixed_ms + c * r.layer_ms for r, c in zip(ranks, counts)) == pytest.approx(best), (ranks, cuts)


def test_two_ranks_memory_first_then_speed():
    fast = [RankCosts(BIG, 0, 100, layer_ms=10.0), RankCosts(BIG, 0, 100, layer_ms=10.0, fixed_ms=50.0)]
    assert place_layers(28, fast) == [16]  # rank 1 also runs the head; 160 vs 170 ms (17 would be 170 vs 160: the more even)
    drafter = [RankCosts(BIG, 0, 100, 10.0, fixed_ms=1000.0), RankCosts(BIG, 0, 100, 10.0, 50.0)]
    assert place_layers(28, drafter) == [1]  # the drafter alone outweighs the rest
    rank1_small = [drafter[0], RankCosts(50 + 10 * 100, 50, 100, 10.0, 50.0)]
    assert place_layers(28, rank1_small) == [18]  # rank 1 holds at most 10 layers, whatever the speed says
    rank0_small = [RankCosts(300 + 2 * 100, 300, 100, 1.0), RankCosts(BIG, 0, 100, 100.0)]
    assert place_layers(28, rank0_small) == [2]  # rank 0 is 100x faster but holds 2 layers
    assert place_layers(2, fast) == [1]


def test_a_workloads_split_is_the_soonest_of_those_that_fit():
    """best_split over every split of 10 layers on two ranks: the one the seconds favour (7), the nearest that fits
    when rank 1 holds at most 2 layers (8), `start` on a tie."""
    two = [RankCosts(BIG, 0, 100), RankCosts(BIG, 0, 100)]
    seconds = lambda cuts: abs(cuts[0] - 7) + 1.0
    assert best_split(10, two, [1], seconds) == [7]
    assert best_split(10, [two[0], RankCosts(250, 50, 100)], [9], seconds) == [8]
    assert best_split(10, two, [4], lambda cuts: 1.0) == [4]


def test_a_workloads_split_past_max_splits_steps_a_cut_at_a_time(monkeypatch):
    """Past MAX_SPLITS, from `start` one cut a layer at a time while it ends sooner: three ranks of 12 layers, from
    [5, 6] to the seconds' least [3, 9], each step keeping the cuts increasing and within the budgets."""
    import model_parallel.split as split
    monkeypatch.setattr(split, "MAX_SPLITS", 0)
    three = [RankCosts(BIG, 0, 100)] * 3
    tried = []
    def seconds(cuts):
        tried.append(list(cuts))
        return (cuts[0] - 3) ** 2 + (cuts[1] - 9) ** 2
    assert best_split(12, three, [5, 6], seconds) == [3, 9]
    assert all(0 < a < b < 12 for a, b in tried) and len(tried) < 60
    rank_2_small = [*three[:2], RankCosts(200, 0, 100)]  # at most 2 layers: rank 2 from layer 10 on
    assert best_split(12, rank_2_small, [5, 10], seconds) == [3, 10]


def test_no_fit_names_the_budgets_and_the_bytes():
    ranks = [RankCosts(2 * 2**30, 1 * 2**30, 100 * 2**20), RankCosts(2 * 2**30, 500 * 2**20, 100 * 2**20)]
    with pytest.raises(NoFit) as info:
        place_layers(28, ranks)
    message = str(info.value)
    assert "\n" not in message and "model.max_memory" in message
    assert "rank 0 may hold 2.00 GiB and needs 1.00 GiB before its layers" in message
    assert "a layer with its KV cache needs 100.00 MiB" in message and "all together need 4.22 GiB" in message


def test_sizes():
    assert parse_size("500MB") == 500 * 10**6 and parse_size("6GiB") == 6 * 2**30 and parse_size(123) == 123
    assert parse_size("1.5 gb") == 1_500_000_000 and parse_size("2048") == 2048
    for bad in ("6 parsecs", "-1GB", "", True, 0):
        with pytest.raises(ValueError, match="is not a size"):
            parse_size(bad)
    with pytest.raises(ConfigError, match=r"model.max_memory\[1\]='lots' is not a size"):
        load_tandem_config(["prompt=hi", "model.max_memory=[1GB,lots]"])


# --- bytes: estimated from config.json vs what a loaded stage holds ------------------------------

def held_bytes(stage) -> int:
    """What a loaded stage holds: parameters, buffers and NF4 states (quant.weight_bytes), and its cache."""
    cache = stage.cache
    tensors = [*cache.keys.values(), *cache.values.values(), cache.cells, cache.length]
    return weight_bytes(stage) + sum(t.numel() * t.element_size() for t in tensors)


def stored_parts(linear) -> list:
    """A Linear4bit's tensors as bitsandbytes holds them: (name, shape, dtype, address)."""
    state = linear.weight.quant_state
    named = [("weight", linear.weight), ("absmax", state.absmax), ("code", state.code), ("offset", state.offset)]
    if state.state2 is not None:
        named += [("absmax2", state.state2.absmax), ("code2", state.state2.code)]
    return [(n, tuple(t.shape), str(t.dtype), t.data_ptr()) for n, t in named if isinstance(t, torch.Tensor)]


def test_nf4_bytes_are_what_bitsandbytes_stores():
    for rows, cols in [(64, 32), (100, 30), (1536, 256), (8960, 1536)]:
        for double in (True, False):
            linear = nf4_linear(torch.nn.Linear(cols, rows, bias=False), NF4Settings(torch.float32, double_quant=double))
            assert weight_bytes(linear) == nf4_bytes(rows * cols, double), (rows, cols, double, stored_parts(linear))


def test_weight_bytes_tells_tensors_at_one_address_apart():
    """A view that starts where its base starts has the base's address: both are counted (the absmax once seen at
    the packed weight's address was left out when tensors were known by address alone); one tensor held twice (a
    tied head, bitsandbytes' shared code table) is counted once."""
    module = torch.nn.Module()
    base = torch.zeros(256, dtype=torch.uint8)
    module.register_buffer("packed", base)
    module.register_buffer("absmax", base[:32])  # what an allocator reusing a freed address looks like to data_ptr
    module.register_buffer("tail", base[224:])
    module.tied = module.packed  # the same tensor twice
    module.register_buffer("same", module.packed)
    assert weight_bytes(module) == 256 + 32 + 32


QUANTS = {"none": None, "nf4": NF4Settings(torch.float32), "nf4-single-head": NF4Settings(torch.float32, False, True)}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype,quant", [("float32", "none"), ("bfloat16", "none"), ("float32", "nf4"),
                                         ("bfloat16", "nf4-single-head")])
def test_estimated_bytes_match_a_loaded_stage(family, dtype, quant, tiny_qwen, tiny_llama):
    folder = tiny_qwen if family == "qwen2" else tiny_llama
    estimate = model_bytes(ModelSource.open(folder, dtype), QUANTS[quant], max_len=96)
    for first, last, embed, head in [(0, 1, True, False), (1, 4, False, True), (0, 4, True, True), (2, 3, False, False)]:
        stage = load_stage(folder, first, last, embed=embed, head=head, dtype=dtype, quant=QUANTS[quant])
        stage.allocate_cache(96, torch.float32 if dtype == "float32" else torch.bfloat16)
        held, estimated = held_bytes(stage), estimate.stage(first, last, embed, head)
        assert abs(estimated - held) <= 0.05 * held, (first, last, embed, head, estimated, held)


def costs_of(cfg, rank: int):
    """(RankCosts, where the budget came from) of rank `rank` of two, from shapes alone (launch.plan)."""
    return rank_costs(cfg, open_models(cfg, rank), rank, 2)


def test_rank_costs_count_the_drafter_and_its_cache_on_rank_0(tiny_qwen, tiny_qwen_draft):
    args = [f"model.target={tiny_qwen}", "prompt=hi", "model.dtype=float32", "draft.kind=model",
            f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "draft.max_len=200", "gen.max_new_tokens=64",
            "model.max_memory=[1GB,2GB]"]
    cfg = load_tandem_config(args)
    (rank0, source0), (rank1, source1) = (costs_of(cfg, r) for r in (0, 1))
    assert (rank0.budget, source0, rank1.budget, source1) == (10**9, "model.max_memory[0]", 2 * 10**9, "model.max_memory[1]")
    assert costs_of(load_tandem_config([*args, "model.max_memory=[null,2GB]"]), 0)[1] == "MemAvailable, less 10%"
    with pytest.raises(ConfigError, match="model.max_memory lists 3 sizes for 2 ranks"):
        costs_of(load_tandem_config([*args, "model.max_memory=[1GB,1GB,1GB]"]), 0)
    drafter = build_draft_stage(plan_here(cfg, 0))
    no_draft = costs_of(load_tandem_config([*args, "draft.kind=none"]), 0)[0]
    assert abs(rank0.fixed_bytes - no_draft.fixed_bytes - held_bytes(drafter)) <= 0.05 * held_bytes(drafter)
    stage = load_stage(tiny_qwen, 2, 4, embed=False, head=True, dtype="float32")
    stage.allocate_cache(cfg.model.max_len, torch.float32)
    assert abs(rank1.bytes_for(2) - held_bytes(stage)) <= 0.05 * held_bytes(stage)


def test_unset_budget_is_free_memory_less_headroom(tiny_qwen, monkeypatch):
    cfg = load_tandem_config([f"model.target={tiny_qwen}", "prompt=hi", "draft.kind=none"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    costs, source = costs_of(cfg, 1)
    available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    assert source == "MemAvailable / 2 ranks on this host, less 10%"
    assert 0.8 * available / 2 < costs.budget < 0.95 * available / 2


# --- end to end: both ranks, their own budgets, output identical to generate ----------------------

def budgets(folder, rank0_layers: int | None, rank1_layers: int | None, dtype="float32") -> str:
    """model.max_memory that lets each rank hold exactly this many layers (None: plenty)."""
    b = model_bytes(ModelSource.open(folder, dtype), None, max_len=4096)
    fixed = [b.stage(0, 0, True, False), b.stage(0, 0, False, True)]
    sizes = [BIG if n is None else f + n * b.layer() for f, n in zip(fixed, (rank0_layers, rank1_layers))]
    return f"model.max_memory=[{sizes[0]},{sizes[1]}]"


@pytest.mark.parametrize("rank0_layers,rank1_layers,split", [(1, None, 1), (None, 1, 3), (2, 2, 2)])
def test_asymmetric_budgets_place_by_memory_and_match_generate(tiny_qwen, rank0_layers, rank1_layers, split, capsys):
    out = run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=auto", "draft.kind=none",
                   budgets(tiny_qwen, rank0_layers, rank1_layers), f"prompt_ids={ids_arg(PROMPT)}", "gen.max_new_tokens=16")
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, 16)
    # each rank's start-up line, wherever it lands: the other thread's loading bar may hold the same terminal line
    lines = re.findall(r"\[rank \d: [^\n]*\]$", capsys.readouterr().err, re.MULTILINE)
    assert sorted(lines)[0].startswith(f"[rank 0: layers 0-{split - 1} ({split} of 4) + embeddings; ")
    assert sorted(lines)[1].startswith(f"[rank 1: layers {split}-3 ({4 - split} of 4) + norm + head; ")
    assert all(" of " in line and "model.max_memory[" in line and "estimated " in line and "ms per round" in line
               for line in lines), lines


def test_auto_split_with_a_drafter_runs_and_is_exact(tiny_qwen, tiny_qwen_draft, capsys):
    out = run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=auto", "draft.kind=model",
                   f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "spec.k=4", "spec.overlap=true",
                   f"prompt_ids={ids_arg(PROMPT)}", "gen.max_new_tokens=16")
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, 16)
    # wherever it lands: rank 1's loading bar may hold the same terminal line
    line = re.findall(r"\[rank 0: [^\n]*\]$", capsys.readouterr().err, re.MULTILINE)[0]
    assert "+ embeddings + the drafter;" in line and "the drafter's 5 steps" in line and "(MemAvailable" in line, line


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if any stage starts loading weights."""
    import launch.build

    def refuse(*args, **kwargs):
        raise AssertionError("a stage was loaded")
    monkeypatch.setattr(launch.build, "load_stage", refuse)


def test_a_given_split_over_budget_stops_before_loading(tiny_qwen, no_loading):
    with pytest.raises(ConfigError) as info:
        run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=1", "draft.kind=none",
                 budgets(tiny_qwen, None, 2), f"prompt_ids={ids_arg(PROMPT)}")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model.split=1 gives rank 1 ") and "over its model.max_memory of" in message
    assert "splits that fit: 2-3 (model.split=auto picks among them)" in message and "model.quant=nf4" in message


def test_budgets_no_split_fits_stop_before_loading(tiny_qwen, no_loading):
    with pytest.raises(ConfigError) as info:
        run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=auto", "draft.kind=none",
                 budgets(tiny_qwen, 1, 2), f"prompt_ids={ids_arg(PROMPT)}")
    message = str(info.value)
    assert "\n" not in message and message.startswith("model.max_memory: no split of the 4 layers fits")
    for fix in ("model.quant=nf4", "a smaller model.max_len", "the drafter elsewhere", "another machine"):
        assert fix in message
    b = model_bytes(ModelSource.open(tiny_qwen, "float32"), None, max_len=4096)
    assert f"a layer with its KV cache needs {human(b.layer())}" in message


@pytest.mark.parametrize("overlap", [True, False])
def test_ranks_time_at_once_with_overlap_and_in_turns_without(tiny_qwen, tiny_qwen_draft, overlap, monkeypatch):
    """model.split=auto's timing runs the way a round runs (each rank's spec.overlap: the same config on every rank): with
    overlap the ranks work at the same time, so they time at the same time (ranks sharing a host's cores
    then see each other); without it they take turns, so rank 1 times only after rank 0 is done."""
    import time

    import launch.handshake
    spans = {}
    real = launch.handshake.rank_speed

    def timed(cfg, models, rank, ranks):
        start = time.perf_counter()
        result = real(cfg, models, rank, ranks)
        time.sleep(0.3)  # a span long enough that two at once cannot miss each other
        spans[rank] = (start, time.perf_counter())
        return result
    monkeypatch.setattr(launch.handshake, "rank_speed", timed)
    out = run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=auto", "draft.kind=model",
                   f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", f"spec.overlap={str(overlap).lower()}",
                   f"prompt_ids={ids_arg(PROMPT)}", "gen.max_new_tokens=8")
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, 8)
    (start0, end0), (start1, end1) = spans[0], spans[1]
    if overlap:
        assert start1 < end0 and start0 < end1, spans
    else:
        assert start1 >= end0, spans


def test_a_drafters_steps_are_timed_back_to_back_as_a_round_runs_them(monkeypatch):
    """steps_ms: each run's calls back to back (a round's steps over one cache), one run after the other, never in
    turn: the fastest mean of `calls` calls over the tries."""
    import model_parallel.split as split
    order, clock = [], [0.0]

    def step(name: str, ms: float):
        return lambda: order.append(name) or clock.__setitem__(0, clock[0] + ms / 1000)
    monkeypatch.setattr(split.time, "perf_counter", lambda: clock[0])
    ms = split.steps_ms({"short": step("short", 2.0), "long": step("long", 5.0)}, calls=3, reps=2)
    assert order == ["short"] * 7 + ["long"] * 7  # one warm-up call each, then 2 tries of 3
    assert ms == pytest.approx({"short": 2.0, "long": 5.0})


def test_timing_measures_what_a_long_prompt_and_more_rows_cost(tiny_qwen, monkeypatch):
    """A rank's timing besides its round (medians given, so the arithmetic is checked): a target layer 1 ms over
    the block of 5 and 0.01 ms a token more, attention 0.001 ms per token per earlier token (128 tokens after 128
    and after 1024 cached); the drafter's layer 0.2 ms a step, 0.002 ms a token more (its catch-up on a prompt,
    another row in a step) and 0.0005 per earlier token, times its 4 layers. A decode block after 2048 cached
    tokens instead of 128 (the 1-layer stages): the target's 0.0002 ms a layer per block token per cached token,
    the drafter's 0.0001 a layer per cached token, times its 4 layers. Four rows of the block in one forward: a
    target layer 0.4 ms a row more; the last rank's head (timed on a slice, 0.2 ms over one row) 0.1 a row more; a
    drafter step over four rows: its layer 0.3 ms a row more (its steps back to back: 1.6 ms over four rows, 0.7 over
    one), its head 0.05, so 4 x 0.3 + 0.05 x scale a step. The four rows after 2048 cached tokens: each row more
    0.00015 ms a target layer per block token per cached token, 0.00012 a drafter layer per cached token (its 4
    layers: 0.00048)."""
    import model_parallel.split as split
    from model_parallel.loader import ModelSource
    probe, extra = split.PROBE_TOKENS, 128 * (split.LONG_CONTEXT - split.CONTEXT)
    given = {("target", 1): 1.5, ("target", 3): 3.5, ("probe", split.CONTEXT): 1.5 + 0.01 * (probe - 5),
             ("drafter", 1): 0.7, ("drafter", 3): 1.1, ("drafter", "head"): 0.3,
             ("drafter probe", split.CONTEXT): 0.7 + 0.002 * (probe - 1)}
    given["probe", split.LONG_CONTEXT] = given["probe", split.CONTEXT] + 0.001 * extra
    given["drafter probe", split.LONG_CONTEXT] = given["drafter probe", split.CONTEXT] + 0.0005 * extra
    cached = split.DECODE_CONTEXT - split.CONTEXT
    given["target", "long"] = 1.5 + 5 * 0.0002 * cached
    given["target", "rows"] = 1.5 + (split.ROW_PROBE - 1) * 0.4
    given["target", "head"], given["target", "rows head"] = 0.2, 0.2 + (split.ROW_PROBE - 1) * 0.1
    given["drafter", "rows head"] = 0.3 + (split.ROW_PROBE - 1) * 0.05
    given["target", "rows long"] = given["target", "rows"] + 5 * cached * (0.0002 + (split.ROW_PROBE - 1) * 0.00015)
    monkeypatch.setattr(split, "sample_ms", lambda runs, window_s: {name: [given[name]] for name in runs})
    steps = {(1, split.CONTEXT): 0.7, (1, split.DECODE_CONTEXT): 0.7 + 0.0001 * cached,  # a drafter step's layer,
             (split.ROW_PROBE, split.CONTEXT): 1.6}  # back to back, over one row and over ROW_PROBE rows
    steps[split.ROW_PROBE, split.DECODE_CONTEXT] = 1.6 + cached * (0.0001 + (split.ROW_PROBE - 1) * 0.00012)
    monkeypatch.setattr(split, "steps_ms", lambda runs, calls: {context: steps[context] for context in runs})
    model = ModelSource.open(tiny_qwen, "float32")
    speed = split.time_rank(split.Timed(model, 5, "cpu", torch.float32),
                            split.Timed(model, 1, "cpu", torch.float32, head=True, calls=5))
    assert (speed.layer_ms, speed.layer_token_ms, speed.attend_ms) == pytest.approx((1.0, 0.01, 0.001))
    assert speed.draft_step_ms == pytest.approx(0.5 + 4 * 0.2 + 0.3)
    assert speed.fixed_ms == pytest.approx(0.5 + 5 * speed.draft_step_ms)
    assert (speed.draft_token_ms, speed.draft_attend_ms) == pytest.approx((4 * 0.002, 4 * 0.0005))
    assert (speed.context_ms, speed.draft_context_ms) == pytest.approx((0.0002, 4 * 0.0001))
    assert (speed.context_row_ms, speed.draft_context_row_ms) == pytest.approx((0.00015, 4 * 0.00012))
    assert (speed.layer_row_ms, speed.head_row_ms) == pytest.approx((0.4, 0.0))  # rank 0: no head
    scale = model.config.vocab_size / min(model.config.vocab_size, split.MAX_HEAD_ROWS)
    assert speed.draft_row_ms == pytest.approx(4 * 0.3 + 0.05 * scale)
    last = split.time_rank(split.Timed(model, 5, "cpu", torch.float32, head=True))
    assert last.draft_row_ms == 0.0
    assert (last.layer_row_ms, last.head_row_ms) == pytest.approx((0.4, 0.1 * scale))


def test_timing_alone_measures_each_chunk_size_and_attention_over_a_whole_chunk(tiny_qwen, monkeypatch):
    """Timed alone (medians given): a target layer 1 ms over the block of 5 (its one- and three-layer stages 1.5 and
    3.5 ms); the three-layer chunk stage over 32, 33, 48, 64, 128, 256 and a whole chunk of 512 tokens after 128
    cached: 3.5 ms more by 0.9, 2.4, 2.7, 3.0, 3.69, 7.5 and 19.5, and over 512 after 1,024 3 x 2e-5 ms a token per
    earlier token more than after 128. Each size's layer is the block's 1 ms and a third of its stage's more than
    the stage as deep over the block; the line's slope is 128's, attention's the whole chunk's."""
    import model_parallel.split as split
    from model_parallel.loader import ModelSource
    more = {32: 0.9, 33: 2.4, 48: 2.7, 64: 3.0, 128: 3 * 0.01 * 123, 256: 7.5, 512: 19.5}
    given = {("target", 1): 1.5, ("target", 3): 3.5, **{("chunk", n): 3.5 + ms for n, ms in more.items()},
             ("chunk", "long"): 3.5 + 19.5 + 3 * 2e-5 * 512 * (split.LONG_CONTEXT - split.CONTEXT)}
    monkeypatch.setattr(split, "sample_ms", lambda runs, window_s: {name: [given[name]] for name in runs})
    alone = split.time_alone(split.Timed(ModelSource.open(tiny_qwen, "float32"), 5, "cpu", torch.float32), 512)
    assert dict(alone["alone_prefill_ms"]) == pytest.approx(
        {5: 1.0, 32: 1.3, 33: 1.8, 48: 1.9, 64: 2.0, 128: 2.23, 256: 3.5, 512: 7.5})
    assert (alone["alone_layer_ms"], alone["alone_layer_token_ms"], alone["alone_attend_ms"]) == pytest.approx(
        (1.0, 0.01, 2e-5))


def test_the_drafters_intake_is_timed_at_each_chunk_size(tiny_qwen, monkeypatch):
    """time_intake (medians given): the drafter's three-layer chunk stage over 1, 32, 33, 48, 64, 128, 256 and 512
    tokens after 128 cached: 3 ms, then 3 ms more by 1.5, 1.5, 3, 3, 6, 12 and 24. The tiny drafter has 4 layers: a
    chunk's intake is the 2 ms step and each layer's third of its stage's more."""
    import model_parallel.split as split
    from model_parallel.loader import ModelSource
    more = {1: 0.0, 32: 1.5, 33: 1.5, 48: 3.0, 64: 3.0, 128: 6.0, 256: 12.0, 512: 24.0}
    timed = []
    monkeypatch.setattr(split, "sample_ms", lambda runs, window_s: timed.append(sorted(runs)) or {
        n: [3.0 + more[n]] for n in runs})
    model = ModelSource.open(tiny_qwen, "float32")
    intake = split.time_intake(split.Timed(model, 1, "cpu", torch.float32, head=True), 512, 2.0)
    assert timed == [sorted(more)]
    layers = model.config.num_hidden_layers
    assert dict(intake) == pytest.approx({n: 2.0 + layers * ms / 3 for n, ms in more.items()})


def test_chunks_are_timed_through_one_stage_as_deep_as_the_blocks(tiny_qwen, monkeypatch):
    """chunk_runs: every shape through one stage of STAGE_SIZES[-1] layers (a stage of many streams its weights on
    every call; one layer called again and again keeps part of it in the CPU's caches), its cache as long as the
    longest shape needs."""
    import model_parallel.split as split
    from model_parallel.loader import ModelSource
    built, stage = [], split._stage
    monkeypatch.setattr(split, "_stage", lambda *a, **kw: built.append(stage(*a, **kw)) or built[-1])
    runs = split.chunk_runs(ModelSource.open(tiny_qwen, "float32"), [(32, 128), (8, 1024)], "cpu", torch.float32)
    assert [len(stage.layers) for stage in built] == [split.STAGE_SIZES[-1]]
    for run in runs.values():
        run()  # room for 8 after 1,024 in the one cache: no CacheFull


def test_rank_costs_say_the_ranks_host_and_its_share_of_the_cores(tiny_qwen, monkeypatch):
    """One thread of a host's four cores, second of its host's ranks (torchrun's LOCAL_RANK=1): a quarter of them,
    place 1; on a GPU it takes none of them."""
    cfg = load_tandem_config([f"model.target={tiny_qwen}", "prompt=hi", "draft.kind=none"])
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    costs, _ = costs_of(cfg, 1)
    assert (costs.host_rank, costs.core_share) == (1, 0.25)
    assert core_share("cuda:0") == 0.0


def test_a_timing_slower_than_its_window_warms_up_once_and_takes_three_cycles():
    """Start-up timings run each probe in cycles (split.sample_ms): two warm-up cycles and at least five timed. A
    cycle that outlasts the window (the embedded pair's 1.5B in bf16 on a CPU without avx512_bf16: ~14 s) is its
    own warm-up, and three timed cycles follow: seven such took rank 0 ~100 s, while rank 1 waited for its Hello."""
    import time
    from model_parallel import split
    calls = {"slow": 0, "quick": 0}

    def slow():
        calls["slow"] += 1
        time.sleep(0.03)

    def quick():
        calls["quick"] += 1
    assert len(split.sample_ms({"slow": slow}, window_s=0.02)["slow"]) == 3
    assert calls["slow"] == 4
    assert len(split.sample_ms({"quick": quick}, window_s=0.02)["quick"]) == 5
    assert calls["quick"] == 7
