"""spec.in_flight: several rounds of one stream on the way at once, each sent on the bet that the rounds
before it are fully accepted. Lossless like every other path: greedy output equals transformers generate
whether the bets hold (the target drafting for itself), fail often (an unrelated drafter) or there is
nothing to bet on (K=0); EOS and max_new_tokens may fall inside a block with later blocks on the way."""
from __future__ import annotations

import pytest

from netbridge.protocol import SamplingParams
from speculative.in_flight import DepthFromCosts, in_flight_policy
from speculative.rounds import RoundRecord
from tests.support.session_harness import serve, session_args
from tests.support.tiny_models import ids_arg, reference_greedy, run_pair, run_ranks, with_eos

PROMPT = [5, 17, 250, 3, 99, 42, 7, 8]
MAX_NEW = 23


def overrides(target, drafter: str, k: int, depth, draft=None, max_new=MAX_NEW) -> list[str]:
    args = [f"model.target={target}", "model.dtype=float32", f"spec.k={k}", f"prompt_ids={ids_arg(PROMPT)}",
            f"gen.max_new_tokens={max_new}", "spec.adaptive=false", "spec.overlap=true", f"spec.in_flight={depth}"]
    if drafter == "ngram":
        return args + ["draft.kind=ngram"]
    if drafter == "none":
        return args + ["draft.kind=none"]
    return args + ["draft.kind=model", f"draft.model={draft}", "draft.dtype=float32"]


@pytest.mark.parametrize("drafter,depth", [("self", 2), ("self", 4), ("unrelated", 3), ("unrelated", 4), ("ngram", 2),
                                           ("ngram", 3), ("none", 4)])
def test_rounds_in_flight_give_generate_s_tokens(depth, drafter, tiny_qwen, tiny_qwen_draft):
    draft = {"self": tiny_qwen, "unrelated": tiny_qwen_draft}.get(drafter)
    out = run_pair(*overrides(tiny_qwen, drafter, 0 if drafter == "none" else 3, depth, draft))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    stats = out["stats"]
    if drafter == "self":  # every bet holds: the pipe really held several rounds, none dropped
        assert stats["in_flight_mean"] > 1.5 and stats["rounds_dropped"] == 0 and stats["bets_lost"] == 0
    if drafter == "unrelated":  # bets failed and rounds sent on them were dropped: the lossy path ran
        assert stats["bets_lost"] > 0 and stats["rounds_dropped"] > 0
        # and cost the last rank nothing: it knew each bet had failed before the block came, and skipped it
        assert stats["dropped_later_ms"] == 0.0


@pytest.mark.parametrize("drafter", ["self", "unrelated"])
def test_three_ranks_with_rounds_in_flight(drafter, tiny_qwen, tiny_qwen_draft):
    draft = tiny_qwen if drafter == "self" else tiny_qwen_draft
    out = run_ranks(3, *overrides(tiny_qwen, "model", 3, 3, draft), "model.split=[1,3]", "model.prefill_chunk=3")
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)


@pytest.mark.parametrize("max_new", [2, 11])
def test_max_new_tokens_inside_a_block_in_flight(max_new, tiny_qwen):
    """The target drafting for itself: every bet holds, and blocks are never sent past what max_new_tokens leaves
    (no round is wasted at the end)."""
    out = run_pair(*overrides(tiny_qwen, "model", 4, 3, tiny_qwen, max_new=max_new))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, max_new)
    assert out["stats"]["stop_reason"] == "max_new_tokens" and out["stats"]["rounds_dropped"] == 0


def test_eos_inside_a_block_with_later_blocks_in_flight(tiny_qwen, tmp_path):
    free_run = reference_greedy(tiny_qwen, PROMPT, 40)
    e = next(i for i in range(6, 40) if free_run[i] not in free_run[:i] and i % 5 != 0)  # a draft, not a bonus token
    folder = with_eos(tiny_qwen, tmp_path / "with-eos", free_run[e])
    out = run_pair(*overrides(folder, "model", 4, 3, folder, max_new=40))
    assert out["token_ids"] == reference_greedy(folder, PROMPT, 40, eos=free_run[e])
    assert out["stats"]["stop_reason"] == "eos" and out["stats"]["rounds_dropped"] > 0  # blocks after it were on the way


def test_a_served_session_drops_the_replies_left_on_the_way(tiny_qwen, tmp_path):
    """Replies of rounds still on the way when a generation ends (at EOS, with blocks after it sent) are
    dropped before the next request's: each request through one session gives what a fresh run gives
    (greedy, then seeded sampling, then greedy)."""
    free_run = reference_greedy(tiny_qwen, PROMPT, 40)
    folder = with_eos(tiny_qwen, tmp_path / "with-eos", free_run[9])
    args = session_args(folder, folder, max_new=30) + ["spec.in_flight=4", "spec.adaptive=false"]
    plan = [(PROMPT, SamplingParams()), (PROMPT[:5], SamplingParams(temperature=1.0, top_p=0.9, seed=3)), (PROMPT[::-1], SamplingParams())]
    gens = serve(args, plan)
    assert gens[0].output.stop_reason == "eos" and gens[0].rounds[-1].bets_lost > 0  # it ended with rounds on the way
    for (ids, request), gen in zip(plan, gens):
        alone = run_pair(*args, f"prompt_ids={ids_arg(ids)}", f"gen.temperature={request.temperature}",
                         f"gen.top_p={request.top_p}", f"gen.seed={request.seed}")
        assert gen.output.tokens == alone["token_ids"], request


def test_a_served_session_after_a_generation_that_failed_with_rounds_on_the_way(tiny_qwen):
    """A generation that stops on an error (here its round callback) with rounds still on the way: their replies
    are dropped before the next request's, whose tokens are a fresh run's."""
    rounds = []

    def fails_on_the_second_round(record, reply):
        rounds.append(record)
        if len(rounds) == 2:
            raise RuntimeError("the callback failed")
    args = session_args(tiny_qwen, tiny_qwen, max_new=20) + ["spec.in_flight=4", "spec.adaptive=false"]
    gens = serve(args, [(PROMPT, SamplingParams()), (PROMPT[::-1], SamplingParams())], on_round=fails_on_the_second_round,
                 keep_going=True)
    assert isinstance(gens[0], RuntimeError) and rounds[1].in_flight > 1  # it failed with rounds on the way
    assert gens[1].output.tokens == reference_greedy(tiny_qwen, PROMPT[::-1], 20)


def record(**kw) -> RoundRecord:
    base = dict(drafted=3, accepted=3, committed=4, draft_ms=5.0, stage0_ms=1.0, round_ms=100.0, last_ms=2.0)
    return RoundRecord(**{**base, **kw})


def test_auto_depth_goes_deeper_only_when_bets_hold_and_the_trip_is_long():
    often = DepthFromCosts()
    for _ in range(10):
        often.observe(record(bet=True))
    assert often.now() > 1  # a 100 ms trip, 6 ms to prepare a block, every bet held
    seldom = DepthFromCosts()
    for i in range(10):
        seldom.observe(record(accepted=0, bet=False))
    assert seldom.now() == 1  # no bet holds: a deeper pipe only wastes the later ranks' work
    short = DepthFromCosts()
    for _ in range(10):
        short.observe(record(bet=True, round_ms=4.0))
    assert short.now() == 1  # the trip is shorter than preparing a block: nothing to hide
    busy = DepthFromCosts()  # the embedded pair on this CPU: a block as costly as the trip, one bet in five lost
    for i in range(10):
        busy.observe(record(draft_ms=550.0, stage0_ms=2.0, round_ms=620.0, bet=i % 5 != 0))
    assert busy.now() == 1  # the blocks thrown away at each lost bet would cost rank 0 more than the wire saves


def test_auto_depth_follows_the_start_up_model_where_the_run_has_one():
    """Rounds that measure a trip shorter than preparing a block keep the lumped costs at depth 1; the start-up model
    (a 100 ms trip, 6 ms to prepare a block, every bet held) says deeper, and where the run has one, it decides."""
    from speculative.cost_model import Acceptance, DraftCost, LinkCost, Pipeline, Predictor, RankCost
    predictor = Predictor(Pipeline((RankCost(1.0), RankCost(2.0)), (LinkCost(50.0), LinkCost(50.0)), DraftCost(1.0),
                                   Acceptance(prior=1.0)))
    lumped, modelled = DepthFromCosts(), DepthFromCosts(model=predictor.best_depth)
    for _ in range(10):
        for policy in (lumped, modelled):
            policy.observe(record(bet=True, round_ms=4.0))
    assert lumped.now() == 1 and modelled.now() == predictor.best_depth(3) > 1


def test_auto_depth_starts_at_the_start_up_models_until_rounds_are_measured():
    """A chain deepened after a request's first token fills in the open, so the depth starts at the start-up
    model's (launch.prediction.planned_depth) and follows what the rounds measure after the warm-up."""
    from types import SimpleNamespace
    from launch.prediction import planned_depth
    from speculative.session import Session, SpecSettings
    policy = in_flight_policy("auto", True, start=3)
    assert policy.now() == 3
    for i in range(10):
        policy.observe(record(accepted=0, bet=False))
    assert policy.now() == 1  # measured: no bet holds
    session = Session(None, None, None, SpecSettings(overlap=True, in_flight="auto"), depth_at_start=3)
    assert session.scheduler.in_flight.now() == 3
    assert planned_depth(SimpleNamespace(settings=SimpleNamespace(spec=SimpleNamespace(in_flight=2)))) == 2
