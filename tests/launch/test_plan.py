"""launch.plan and launch.handshake: one handshake on one ring exchange, the config read only once parsed,
config.json parsed and the meta-device model built once per model per rank, one range table for the
sampling fields of the config and the API."""
import copy
import re

import pytest

from launch.config import ConfigError, load_config
from launch.handshake import gather
from launch.plan import open_models
from launch.ranks import last_rank, middle_rank
from netbridge.protocol import Hello
from tests.support.ring_threads import in_threads
from tests.support.tiny_models import ids_arg, reference_greedy
from train_free_infer import rank_zero

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_rank_gathers_every_hello_in_order(ranks):
    seen = {}

    def body(r, prev, next):
        def mine(before):
            seen[r] = [h.num_layers for h in before]
            return Hello(num_layers=10 + r, dtype="float32", quant="none")
        return [h.num_layers for h in gather(prev, next, r, ranks, mine)]
    out = in_threads(ranks, body)
    assert out == {r: [10 + i for i in range(ranks)] for r in range(ranks)}, out
    assert seen == {r: [10 + i for i in range(r)] for r in range(ranks)}  # each adds its own after those before it


def test_the_hellos_wait_out_a_slow_ranks_timing_not_a_silent_one():
    """A rank timing its layers for longer than transport.timeout_s (a host without fast kernels for the dtype:
    minutes) is waited for up to transport.start_timeout_s; past that the rank waiting stops with one line naming it."""
    import time
    from netbridge.channel import PeerError
    per_message_s = 0.2

    def ring(timing_s: float, wait_s: float) -> dict:
        def body(r, prev, next):
            prev.timeout_s = next.timeout_s = per_message_s

            def mine(before):
                time.sleep(timing_s if r == 0 else 0)  # rank 0 times its layers; rank 1 waits for its Hellos
                return Hello(num_layers=10 + r, dtype="float32", quant="none")
            got = [h.num_layers for h in gather(prev, next, r, 2, mine, wait_s)]
            return got, prev.timeout_s
        return in_threads(2, body, timeout_s=5)
    assert ring(timing_s=3 * per_message_s, wait_s=5) == {r: ([10, 11], per_message_s) for r in (0, 1)}
    stopped = ring(timing_s=1.0, wait_s=0.5)[1]
    assert isinstance(stopped, PeerError) and "rank 0 sent nothing for 0.5 s at start-up (transport.start_timeout_s)" in str(
        stopped), stopped


def test_a_hello_carries_every_figure_its_ranks_timing_gives():
    """Every field of a rank's timing (model_parallel.split.Speed) and of its timing alone reaches the other ranks
    as it left: RankCosts -> Hello -> its frame's JSON -> Hello -> RankCosts (a field left out of the Hello would
    reach the cost model as 0: not timed)."""
    import dataclasses
    import json
    from dataclasses import replace
    from types import SimpleNamespace
    from launch.handshake import costs_of, hello
    from model_parallel.split import RankCosts, Speed
    from netbridge.link_probe import LinkProbe
    from netbridge.protocol import as_message
    timed = [f.name for f in dataclasses.fields(Speed)] + ["alone_layer_ms", "alone_draft_step_ms",
                                                            "alone_layer_token_ms", "alone_attend_ms", "core_share"]
    costs = RankCosts(1 << 30, 1000, 200, slot_fixed_bytes=10, slot_layer_bytes=2, host_rank=1,
                      **{name: 0.5 + i for i, name in enumerate(timed)})
    cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32", quant="none"), serve=SimpleNamespace(port=None))
    models = SimpleNamespace(target=SimpleNamespace(num_layers=8))

    def through(costs: RankCosts) -> RankCosts:
        sent = hello(cfg, models, costs, None, LinkProbe("local", 0.1, 1, 1))
        return costs_of(Hello(**json.loads(json.dumps(as_message(sent).meta))))
    got = through(costs)
    assert {name: getattr(got, name) for name in timed} == {name: getattr(costs, name) for name in timed}
    assert (got.host_rank, got.slot_fixed_bytes, got.slot_layer_bytes) == (1, 10, 2)
    chunks = [[5, 1.0], [33, 1.8], [512, 7.5]]  # timed alone: each chunk size's [tokens, ms]
    assert through(replace(costs, alone_prefill_ms=chunks)).alone_prefill_ms == chunks
    assert through(replace(costs, alone_draft_prefill_ms=chunks)).alone_draft_prefill_ms == chunks


def test_the_start_up_line_says_what_a_whole_prompt_chunk_costs_alone(tiny_qwen, monkeypatch):
    """A rank timed alone over chunks of 5 and 512 tokens (1 and 7.25 ms a layer): its start-up line gives the
    whole chunk's beside the layer's alone."""
    from dataclasses import replace
    import model_parallel.split as split
    from launch.plan import describe, plan_here
    monkeypatch.setattr(split, "WINDOW_S", 0.05)
    cfg = load_config([f"model.target={tiny_qwen}", "prompt_ids=[1]", "draft.kind=none", "model.split=auto"])
    plan = plan_here(cfg, 0)
    costs = [replace(c, alone_layer_ms=1.0, alone_prefill_ms=[[5, 1.0], [512, 7.25]]) for c in plan.costs]
    assert "; 1.0 ms a layer alone (7.2 over a 512-token prompt chunk)" in describe(replace(plan, costs=costs))
    costs[0] = replace(costs[0], alone_draft_step_ms=2.0, alone_draft_prefill_ms=[[1, 2.0], [512, 61.5]])
    assert "taking in a 512-token prompt chunk 62 ms" in describe(replace(plan, costs=costs))


def test_rank_0_times_its_drafter_taking_in_each_chunk_size_alone(tiny_qwen, tiny_qwen_draft, monkeypatch):
    """The handshake's timing alone on rank 0 (rank_alone_ms) takes the drafter's intake of a prompt chunk at each
    size a prompt's chunks come in (split.time_intake), the one-token size its step; a rank without a drafter none."""
    import model_parallel.split as split
    from launch.plan import rank_alone_ms, with_draft_format
    monkeypatch.setattr(split, "WINDOW_S", 0.05)
    cfg = load_config([f"model.target={tiny_qwen}", f"draft.model={tiny_qwen_draft}", "prompt_ids=[1]",
                       "draft.quant=none", "model.prefill_chunk=64"])
    alone = rank_alone_ms(cfg, with_draft_format(cfg, open_models(cfg, 0)), 0, 2)
    intake = dict(alone["alone_draft_prefill_ms"])
    assert sorted(intake) == [1, 32, 33, 48, 64] and intake[1] == alone["alone_draft_step_ms"] > 0
    assert "alone_draft_prefill_ms" not in rank_alone_ms(cfg, open_models(cfg, 1), 1, 2)


def run_ring(cfgs: list, ranks: int) -> dict:
    def body(r, prev, next):
        if r == 0:
            return rank_zero(cfgs[r], next, replies=prev, ranks=ranks)
        if r == ranks - 1:
            return last_rank(cfgs[r], prev, reply_to=next, ranks=ranks)
        return middle_rank(cfgs[r], prev, next, r, ranks)
    return in_threads(ranks, body)


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_config_is_read_only_and_each_model_is_parsed_and_built_once_per_rank(tiny_qwen, tiny_qwen_draft,
                                                                                  monkeypatch, ranks):
    """model.split=auto with a model drafter (the path that once rewrote cfg.model.split and parsed config.json
    at a dozen sites): every config is as parsed afterwards, and each rank parsed each of its models' config.json
    and built it on the meta device once (rank 0: target and drafter; every other rank: the target)."""
    import model_parallel.loader as loader
    parsed, built = [], []
    real_parse, real_shell = loader.load_config, loader.model_shell
    monkeypatch.setattr(loader, "load_config", lambda folder: parsed.append(str(folder)) or real_parse(folder))
    monkeypatch.setattr(loader, "model_shell", lambda *a: built.append(str(a[0])) or real_shell(*a))
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=auto", "draft.kind=model",
            f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", f"prompt_ids={ids_arg(PROMPT)}",
            "gen.max_new_tokens=6", "output.stream=false", "chat=false"]
    cfgs = [load_config(args) for _ in range(ranks)]
    before = copy.deepcopy(cfgs)
    out = run_ring(cfgs, ranks)
    assert out[0]["token_ids"] == reference_greedy(tiny_qwen, PROMPT, 6), out
    assert cfgs == before
    expected = sorted([str(tiny_qwen)] * ranks + [str(tiny_qwen_draft)])
    assert sorted(parsed) == expected and sorted(built) == expected, (parsed, built)


def test_an_int_split_is_one_cut_and_models_are_resolved_into_the_plan_not_the_config(tiny_qwen):
    cfg = load_config([f"model.target={tiny_qwen}", "model.split=2", "draft.kind=none", "prompt_ids=[1]"])
    models = open_models(cfg, 0)
    assert models.drafter is None and models.target.num_layers == 4 and models.name == tiny_qwen.name
    from launch.plan import plan_here
    plans = [plan_here(cfg, r) for r in (0, 1)]
    assert [p.cuts for p in plans] == [[2], [2]] and [p.layers() for p in plans] == [range(0, 2), range(2, 4)]
    with pytest.raises(Exception):
        plans[0].cuts = [1]  # frozen
    assert cfg.model.split == 2


@pytest.mark.parametrize("seed, ok", [(2**63 - 1, True), (-2**63, True), (2**63, False), (-2**63 - 1, False)])
def test_the_config_and_the_api_take_the_same_seeds(seed, ok):
    """One range table (launch.config.REQUEST_RANGES): gen.seed and an API request's seed agree at both ends."""
    from launch.serve.errors import ApiError
    from launch.serve.fields import read_settings
    cfg = load_config(["prompt=x", "draft.kind=none"])
    try:
        load_config(["prompt=x", "draft.kind=none", f"gen.seed={seed}"])
        config_ok = True
    except ConfigError:
        config_ok = False
    try:
        read_settings({"seed": seed}, cfg)
        api_ok = True
    except ApiError:
        api_ok = False
    assert config_ok == api_ok == ok


def planned(tiny_qwen, tiny_qwen_draft, *workload: str):
    """settle's Plan of a server over two ranks of the tiny model, from given costs: rank 0's drafter takes 50 ms a
    round (5 steps of 10), each rank 1 ms a layer over a round's block and 0.2 ms a layer per token of a prompt."""
    from launch.plan import settle, with_draft_format
    from model_parallel.split import RankCosts
    big = 10 ** 12
    costs = [RankCosts(big, 0, 100, layer_ms=1.0, fixed_ms=50.0, layer_token_ms=0.2, draft_step_ms=10.0,
                       draft_token_ms=0.5),
             RankCosts(big, 0, 100, layer_ms=1.0, fixed_ms=0.0, layer_token_ms=0.2)]
    cfg = load_config([f"model.target={tiny_qwen}", f"draft.model={tiny_qwen_draft}", "draft.quant=none", "spec.k=4",
                       "spec.k_from_costs=true", "spec.in_flight=auto", "serve.port=0", "serve.max_concurrent=4",
                       *workload])
    return settle(cfg, with_draft_format(cfg, open_models(cfg, 0)), 0, costs, "given", None, [4, 4])


def test_the_split_is_planned_for_the_workload_given(tiny_qwen, tiny_qwen_draft, monkeypatch):
    """One stream's round puts 1 of the 4 layers on rank 0 (its drafting outweighs the rest); four 2,000-token
    prompts at once end sooner with 2, their chunks pipelined over two even stages at K=0, and the start-up line
    says so; four 40-token prompts gain too little to leave one stream's split. A nearer call than WORKLOAD_MARGIN
    keeps one stream's split."""
    import launch.prediction as prediction
    long = ["workload.streams=4", "workload.prompt_tokens=2000", "workload.answer_tokens=64"]
    assert planned(tiny_qwen, tiny_qwen_draft).cuts == [1]
    plan = planned(tiny_qwen, tiny_qwen_draft, *long)
    assert plan.cuts == [2]
    line = prediction.prediction_line(plan)
    assert re.search(r"planned for workload.streams=4 at once, 2000-token prompts and 64-token answers: "
                     r"model.split=2 ends them in [\d.]+ s \(K=0\); the one-stream split \(1\): [\d.]+ s", line), line
    assert planned(tiny_qwen, tiny_qwen_draft, "workload.streams=4", "workload.prompt_tokens=40").cuts == [1]
    monkeypatch.setattr(prediction, "WORKLOAD_MARGIN", 0.5)  # 2 ends them in 3.6 s, 1 in 5.1
    assert planned(tiny_qwen, tiny_qwen_draft, *long).cuts == [1]


def test_a_workload_with_a_given_split_is_one_line():
    with pytest.raises(ConfigError, match=r"^workload.streams=4 plans model.split=auto's split, but model.split=2 "
                                          r"fixes it: leave one of the two out$"):
        load_config(["prompt_ids=[1]", "workload.streams=4", "model.split=2"])
    with pytest.raises(ConfigError, match=r"^workload.streams=0 must be between 1 and 64$"):
        load_config(["prompt_ids=[1]", "workload.streams=0"])
