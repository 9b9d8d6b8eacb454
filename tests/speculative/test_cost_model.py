"""The pipeline's cost model (speculative.cost_model): its arithmetic on cases checked by hand, its choices against a
brute-force search over it, and the prediction a run prints at start-up and logs beside every measured round."""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace

import pytest

from types import SimpleNamespace

from speculative.cost_model import (ENGINE_LAST_MS, ENGINE_LATER_ROW_MS, ENGINE_MIDDLE_MS, ENGINE_RANK0_MS,
                                    ENGINE_RANK0_ROW_MS, ENGINE_STEP_MS, Acceptance, DraftCost, LinkCost,
                                    Pace, Pipeline, Predictor, RankCost, Workload, paced, aggregate_tokens_per_s, best_batches,
                                    best_depth, best_for_workload, workload_s,
                                    at_context, batches_run, best_k, best_settings, chain_step_ms, deepening_ms,
                                    depths_sent, drain_ms, drained, first_tokens_s, from_rank_costs, parts_ms, round_parts,
                                    round_ms, stream_tokens_per_s, tokens_per_round, ttft_s)


def ring(ranks=(10.0, 10.0), one_way=(0.0, 0.0), mbps=(float("inf"), float("inf")), step=0.0, rate=0.5, overlap=False,
         hidden=0, token_ms=0.0):
    return Pipeline(tuple(RankCost(ms, token_ms) for ms in ranks), tuple(LinkCost(o, m) for o, m in zip(one_way, mbps)),
                    DraftCost(step), Acceptance(prior=rate), hidden, overlap)


def test_a_round_adds_every_rank_and_link_and_one_slow_rank_sets_the_pace():
    p = ring((10.0, 30.0, 20.0), (5.0, 5.0, 5.0), (float("inf"),) * 3, step=2.0)
    parts = round_parts(p, 4)
    assert parts.prep_ms == 4 * 2.0 + 10.0  # K steps + rank 0's slice
    assert parts.trip_ms == 30.0 + 20.0 + 3 * 5.0
    assert round_ms(p, 4) == 18.0 + 65.0
    assert parts.busiest_ms == 30.0  # the slow middle rank
    # four streams in four batches: the slow rank's 4 x 30 ms outlasts one batch's 83 ms cycle
    assert aggregate_tokens_per_s(p, 4, 4, 4) == pytest.approx(1000 * 4 * tokens_per_round(p.acceptance, 4) / 120.0)


def test_tokens_per_round_is_the_chain_of_kept_drafts():
    acc = Acceptance((0.5, 0.5, 0.5))
    assert tokens_per_round(acc, 0) == 1.0
    assert tokens_per_round(acc, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert acc.bet_holds(2) == pytest.approx(0.125)  # both drafts and the guess


def test_one_slow_link_its_bytes_cross_at_its_rate():
    # 1000 bytes a token on the forward link at 8 Mbit/s: 1 ms per 1000 bytes, besides the frame's header
    p = ring(one_way=(40.0, 40.0), mbps=(8.0, float("inf")), hidden=1000)
    parts = round_parts(p, 4)  # a block of 5 tokens: 5000 + 256 bytes
    assert parts.trip_ms == pytest.approx(10.0 + 40.0 + 5.256 + 40.0)
    fast = ring(one_way=(40.0, 40.0), hidden=1000)
    assert round_parts(fast, 4).trip_ms == pytest.approx(90.0)


def test_prefill_bound_by_bandwidth_pipelines_its_chunks():
    """2000 tokens in chunks of 500 over a 8 Mbit/s link at 1000 bytes a token: each chunk holds the link 500 ms,
    while either rank computes it in 50 ms; so the link sets the pace, the compute hides behind it."""
    p = ring((0.0, 0.0), (10.0, 10.0), (8.0, float("inf")), hidden=1000, token_ms=0.1)
    wire = (500 * 1000 + 256) / 1000  # ms per chunk on the link
    expected = 50 + 4 * wire + 10 + 50 + 10  # chunk 1's compute, four transfers in a row, the last one's way on
    assert ttft_s(p, 2000, 500) == pytest.approx(expected / 1000)
    # without chunks the transfer cannot overlap rank 0's compute: slower, by the chunks' compute hidden behind it
    assert ttft_s(p, 2000, 2000) > ttft_s(p, 2000, 500)


def test_prefill_bound_by_compute_is_the_slowest_rank_per_chunk():
    p = ring((0.0, 0.0), (0.0, 0.0), token_ms=0.1)  # both ranks 0.1 ms a token, free links
    assert ttft_s(p, 2000, 500) == pytest.approx((4 * 50 + 50) / 1000)  # rank 0's four chunks, then rank 1's last


def test_a_long_prompt_attends_over_its_context_and_the_drafter_takes_it_in():
    """1000 tokens in chunks of 500 on rank 0 (0.1 ms a token, 0.001 ms per token per earlier token), its drafter
    catching up (a forward's 7 ms step, then 0.05 and 0.0005), a free rank 1 and free links. Chunk 1: the slice
    50 + 0.001 x 500 x 250 = 175 ms, sent, then the drafter 7 + 25 + 62.5. Chunk 2 (the first round): the slice
    50 + 0.001 x 500 x 750 = 425, sent at 269.5 + 425 = 694.5 ms; it drafts nothing at any K, and rank 0 takes its
    reply once the drafter has taken chunk 2 in, in the wait: 7 + 25 + 0.0005 x 500 x 750 = 219.5 ms, the first
    token at 914."""
    p = Pipeline((RankCost(0.0, 0.1, attend_ms=0.001), RankCost(0.0)), (LinkCost(), LinkCost()),
                 DraftCost(step_ms=7.0, token_ms=0.05, attend_ms=0.0005))
    assert ttft_s(p, 1000, 500) == pytest.approx(0.914)
    # admitted at K=0 under spec.k_from_costs the drafter takes none of it in: chunk 2 sent at 175 + 425 = 600 ms,
    # its token then
    assert ttft_s(p, 1000, 500, intake=False) == pytest.approx(0.6)


def test_a_lone_streams_first_token_waits_for_the_chain_drafted_in_its_wait():
    """Both ranks 10 ms a block, a drafter step 2 ms (K=4: a block prepared in 4 x 2 + 10 = 18 ms), spec.overlap:
    rank 0 sends the first round at 10 ms, then takes its prompt into the drafter (one forward: a step's 2 ms) and
    drafts its first `depth` blocks on the bet before it takes the reply. Over free links the reply is back at 20
    but taken at 10 + 2 + 3 x 18 = 66 ms at depth 3 (30 at depth 1); over 40 ms each way it comes at 100, after
    the drafting."""
    near = ring((10.0, 10.0), (0.0, 0.0), step=2.0, overlap=True)
    assert ttft_s(near, 40, 512) == pytest.approx(0.020)  # K=0: nothing drafted in the wait
    assert ttft_s(near, 40, 512, k=4, depth=3) == pytest.approx(0.066)
    assert ttft_s(near, 40, 512, k=4, depth=1) == pytest.approx(0.030)
    # not alone: no chain; the two first rounds go as one batch, 10 ms a rank for both
    assert ttft_s(near, 40, 512, (40,), k=4, depth=0) == pytest.approx(0.020)
    assert ttft_s(ring((10.0, 10.0), (40.0, 40.0), step=2.0, overlap=True), 40, 512, k=4, depth=3) == pytest.approx(0.1)


def test_prompts_admitted_together_queue_on_rank_0():
    """Two 1000-token prompts at once, chunks of 500, both ranks 0.1 ms a token: rank 0 prefills A's first chunk
    (0-50 ms) at A's admission, then, B admitted at 50 (its queue), B's (50-100), then sends A's first round (100-150)
    and B's (150-200); rank 1 answers A at 200 and B at 250: 200 after B's admission (A's prefill, in B's queue
    time, is not counted again). Alone, B would have its token at 150; A's own estimate, 150, grows by B's admission
    (50)."""
    p = ring((0.0, 0.0), (0.0, 0.0), token_ms=0.1)
    assert ttft_s(p, 1000, 500) == pytest.approx(0.15)
    assert ttft_s(p, 1000, 500, ahead=(1000,)) == pytest.approx(0.2)
    # from B's admission, A's chunk on rank 1 since: A's token at 150 ms (200 from A's own admission), B's at 200
    assert first_tokens_s(p, 1000, 500, ahead=(1000,), ago_ms=(50.0,)) == pytest.approx((0.15, 0.2))
    # rank 1 ten times slower (0.1 ms a token against 0.01): A's chunk, sent before B came, still holds it for 50 ms
    # after B's admission; B's chunk follows (50-100), A's first round (100-150), B's (150-200)
    slow = Pipeline((RankCost(0.0, 0.01), RankCost(0.0, 0.1)), (LinkCost(), LinkCost()))
    assert ttft_s(slow, 1000, 500, ahead=(1000,)) == pytest.approx(0.2)
    # a link of 40 Mbit/s, 1000 bytes a token (a chunk crosses in 100 ms), both ranks 5 ms a chunk: A's chunk still
    # holds the wire for 100 ms after B's admission, then B's chunk, A's first round and B's: B's token at ~405 ms
    wire = Pipeline((RankCost(0.0, 0.01), RankCost(0.0, 0.01)), (LinkCost(0.0, 40.0), LinkCost()), hidden_bytes=1000)
    assert ttft_s(wire, 1000, 500, ahead=(1000,)) == pytest.approx(0.405, rel=1e-3)


def test_a_workload_ends_at_its_last_first_token_then_its_answer():
    """Two ranks of 10 ms + 0.1 ms a token, free links, K=0. One 1,000-token prompt in chunks of 500: rank 0's
    chunks 0-60 and 60-120 ms, rank 1's 60-120 and 120-180, so its first token at 180 ms; then 10 tokens a round of
    10.1 + 10.1 ms each. Two such prompts at once: rank 0 takes both in, then each first round alone (two of 500
    tokens exceed a 500-token batch), so rank 1's last block ends at 300 ms; then their 10 tokens each in two
    batches taking turns, a cycle of 20.2 ms (one batch of two rows: 20.4)."""
    p = ring((10.0, 10.0), token_ms=0.1)
    assert workload_s(p, Workload(1, 1000, 10), 0, 500) == pytest.approx(0.180 + 10 * 0.0202)
    assert workload_s(p, Workload(2, 1000, 10), 0, 500) == pytest.approx(0.300 + 10 * 0.0202)


def test_a_workloads_k_weighs_the_drafters_intake_against_its_rounds():
    """A drafter of 1 ms a step that takes a prompt in at 0.5 ms a token, drafts kept 0.9 of the time: one stream of
    a 40-token prompt ends soonest at K=4 (20 ms of intake, 4.1 tokens a round); four 2,000-token prompts at K=0,
    where K>0 would take 4 s to take them in for 64 tokens each."""
    p = replace(ring((10.0, 10.0), token_ms=0.1, step=1.0, rate=0.9), draft=DraftCost(1.0, 0.5, 0.5))
    assert best_for_workload(p, Workload(1, 40, 64), range(5), 500)[1] == 4
    seconds, k = best_for_workload(p, Workload(4, 2000, 64), range(5), 500)
    assert k == 0 and seconds == pytest.approx(workload_s(p, Workload(4, 2000, 64), 0, 500))
    assert workload_s(p, Workload(4, 2000, 64), 4, 500) > seconds + 3.0  # 4 s of intake, less what K=4 saves


def test_the_measured_acceptance_counts_a_draft_only_when_it_was_verified():
    """Half the rounds keep all 4 drafts, half none: a_1 = 0.5, and a draft after a kept one is always kept, so a
    round commits 1 + 4 x 0.5 = 3 tokens. Counting every drafted position as tried would give a_i = 0.5 at each, and
    1 + 0.5 + 0.25 + ... = 1.94."""
    predictor = Predictor(ring(rate=0.5))
    for _ in range(50):
        predictor.observe(4, 4)
        predictor.observe(4, 0)
    assert tokens_per_round(predictor.pipeline().acceptance, 4) == pytest.approx(3.0, rel=0.02)


def test_a_placements_timing_becomes_the_pipeline():
    """Rank 0: 2 layers of 1 ms over a block of 5, 20 ms besides of which 4 drafter steps of 4 ms; the drafter 0.5 ms
    a token more (a row more in a step, or a prompt token), rank 1: 3 layers, 0.1 ms a token more, attention 0.01.
    The engine's own work per round goes to rank 0, the last rank and every step, and per row more to every rank;
    with a third rank between them, to it too."""
    costs = [SimpleNamespace(layer_ms=1.0, fixed_ms=20.0, layer_token_ms=0.0, draft_step_ms=4.0, draft_token_ms=0.5),
             SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, layer_token_ms=0.1, attend_ms=0.01)]
    p = from_rank_costs(costs, [2, 3], [LinkCost(), LinkCost()], block_tokens=5, draft_steps=4, overlap=False)
    assert p.draft.step_ms == 4.0 + ENGINE_STEP_MS and p.draft.row_ms == p.draft.token_ms == 0.5
    assert p.ranks[0].ms(1, 5) == pytest.approx(2 * 1.0 + 20.0 - 16.0 + ENGINE_RANK0_MS)
    assert p.ranks[1].ms(1, 5) == pytest.approx(3.0 + ENGINE_LAST_MS)
    # a row more: 5 tokens more and the engine's work for a row
    assert p.ranks[1].ms(2, 5) == pytest.approx(3.0 + ENGINE_LAST_MS + 3 * 0.1 * 5 + ENGINE_LATER_ROW_MS)
    assert p.ranks[0].ms(2, 5) - p.ranks[0].ms(1, 5) == pytest.approx(ENGINE_RANK0_ROW_MS)
    assert p.ranks[1].chunk_ms(100, 200) == pytest.approx(p.ranks[1].ms(1, 100) + 3 * 0.01 * 100 * 250)
    step_over_four = 4.0 + ENGINE_STEP_MS + 3 * 0.5
    assert round_parts(p, 3, rows=4).prep_ms == pytest.approx(3 * step_over_four + p.ranks[0].ms(4, 4))
    middle = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0)
    three = from_rank_costs([costs[0], middle, costs[1]], [2, 2, 3], [LinkCost()] * 3, block_tokens=5, draft_steps=4)
    assert three.ranks[1].ms(1, 5) == pytest.approx(2.0 + ENGINE_MIDDLE_MS)
    assert three.ranks[2].ms(1, 5) == pytest.approx(3.0 + ENGINE_LAST_MS)


def test_a_rounds_parts_are_what_the_model_charges_each_rank():
    """The same placement over three ranks, a round of K=3 for two streams after 1,128 cached tokens (1,000 beyond
    the 128 the blocks were timed after; rank 2 0.001 ms a token per cached token for the first row, 0.002 for the
    second): the drafter's 3 steps and the guess, each 4 + 0.3 ms and 0.5 for the row more; rank 0's 2 layers and
    20 - 16 ms besides; rank 1's 2 layers; rank 2's 3 layers, 0.1 ms a token for its second row's 4 tokens, and
    (0.001 + 0.002) x 4 x 1,000 attending; each rank's engine work besides, for the round and its row more."""
    costs = [SimpleNamespace(layer_ms=1.0, fixed_ms=20.0, layer_token_ms=0.0, draft_step_ms=4.0, draft_token_ms=0.5),
             SimpleNamespace(layer_ms=1.0, fixed_ms=0.0),
             SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, layer_token_ms=0.1 / 3, context_ms=0.001 / 3,
                             context_row_ms=0.002 / 3)]
    p = from_rank_costs(costs, [2, 2, 3], [LinkCost()] * 3, block_tokens=4, draft_steps=4, timed_context=128)
    parts = Predictor(p).parts_ms(3, rows=2, context=1128)
    assert parts.draft_ms == pytest.approx(4 * (4.0 + ENGINE_STEP_MS + 0.5))
    assert parts.stage0_ms == pytest.approx(2 * 1.0 + 20.0 - 16.0 + ENGINE_RANK0_MS + ENGINE_RANK0_ROW_MS)
    assert parts.middle_ms == pytest.approx((2.0 + ENGINE_MIDDLE_MS + ENGINE_LATER_ROW_MS,))
    last = 3.0 + 0.1 * 4 + ENGINE_LAST_MS + ENGINE_LATER_ROW_MS
    assert parts.last_ms == pytest.approx(last + (0.001 + 0.002) * 4 * 1000)
    assert parts_ms(p, 3, 2).last_ms == pytest.approx(last)  # as timed: no cached tokens beyond


def test_depth_is_bounded_by_rank_0s_drafting():
    """A 200 ms trip, bets always held: with rank 0 preparing a block in 10 ms, four rounds on the way go four
    times as fast as one; with 100 ms of drafting a block, no depth goes faster than a block per 100 ms."""
    quick = ring((5.0, 0.0), (100.0, 100.0), step=1.25, rate=1.0, overlap=True)  # prep 5 + 4 x 1.25 = 10 ms
    assert stream_tokens_per_s(quick, 4, 1) == pytest.approx(5 * 1000 / 200)  # a bet that holds hides the prep
    assert stream_tokens_per_s(quick, 4, 4) == pytest.approx(5 * 1000 / 50)  # trip / 4
    slow = ring((20.0, 0.0), (100.0, 100.0), step=20.0, rate=1.0, overlap=True)  # prep 100 ms
    assert stream_tokens_per_s(slow, 4, 4) == pytest.approx(5 * 1000 / 100)  # rank 0's pace
    assert best_depth(slow, 4) == 2 and best_depth(quick, 4) == 4  # (trip / 2 = prep: deeper gains nothing)
    never = ring((20.0, 0.0), (100.0, 100.0), step=2.0, rate=0.0, overlap=True)
    assert best_depth(never, 4) == 1  # no bet holds: every block sent ahead is thrown away


def test_a_lost_bet_costs_the_chain_s_refill_before_its_reply_is_read():
    """Rank 0 preps a block in 84 ms, the last rank takes 150, half the bets hold. After a lost bet the fresh block
    goes, and rank 0 prepares the chain's next blocks on bets before it reads the reply (blocks.use_the_wait): at
    depth 3 under overlap three of them, 252 ms, outlasting the 150 ms trip; at depth 1 one, within it. A round
    then takes 0.5 x 150 + 0.5 x (84 + 252) = 243 ms at depth 3 (not 210, rank 0's pace), 192 at depth 1."""
    p = replace(ring((20.0, 150.0), step=16.0, overlap=True), acceptance=Acceptance(prior=1.0, hold=0.5))
    assert round_parts(p, 4).prep_ms == 84.0
    assert stream_tokens_per_s(p, 4, 3) == pytest.approx(5 * 1000 / 243)
    assert stream_tokens_per_s(p, 4, 1) == pytest.approx(5 * 1000 / 192)


def test_without_overlap_one_round_at_a_time_and_k0_never_bets():
    p = ring((10.0, 10.0), (20.0, 20.0), step=5.0, rate=1.0, overlap=False)
    assert stream_tokens_per_s(p, 2, 1) == pytest.approx(3 * 1000 / (10 + 10 + 10 + 40))
    assert stream_tokens_per_s(p, 0, 4) == pytest.approx(1000 / 60)  # K=0: nothing sent ahead, whatever the depth


GRID = dict(rank0=(2.0, 30.0), rank1=(5.0, 60.0), one_way=(0.0, 40.0, 150.0), mbps=(float("inf"), 20.0),
            step=(0.5, 20.0), rate=(0.3, 0.8, 1.0), overlap=(False, True))


def grid():
    for values in itertools.product(*GRID.values()):
        c = dict(zip(GRID, values))
        yield ring((c["rank0"], c["rank1"]), (c["one_way"], c["one_way"]), (c["mbps"], c["mbps"]), c["step"], c["rate"],
                   c["overlap"], hidden=1792)


def test_the_choices_are_the_best_of_a_brute_force_search_over_the_model():
    for p in grid():
        every = {(k, d): stream_tokens_per_s(p, k, d) for k in range(9) for d in range(1, 5)}
        top = max(every.values())
        s = best_settings(p, 8, 4, streams=4, batches_max=8)
        assert max(every[s.k, d] for d in range(1, 5)) == pytest.approx(top)  # the best K
        assert every[s.k, s.depth] >= 0.95 * top  # a depth within 5% of the best, and no deeper than needed
        assert s.depth == 1 or every[s.k, s.depth - 1] < 0.95 * max(every[s.k, d] for d in range(1, 5))
        together = [aggregate_tokens_per_s(p, s.k, 4, g) for g in range(1, 5)]
        assert together[s.batches - 1] == pytest.approx(max(together))
        assert best_k(p, 8, (1,)) == max(range(9), key=lambda k: every[k, 1])


def test_the_predictor_takes_in_the_measured_acceptance():
    p = ring((10.0, 10.0), (20.0, 20.0), step=5.0, rate=0.5)
    predictor = Predictor(p)
    before = predictor.tokens_per_s(4)
    for _ in range(50):
        predictor.observe(4, 4)  # every draft kept
    assert predictor.tokens_per_s(4) > 1.8 * before
    assert predictor.tokens_per_s(4) == pytest.approx(stream_tokens_per_s(predictor.pipeline(), 4))


def test_a_requests_prediction_is_at_its_own_acceptance_whatever_came_before():
    """A request whose drafts were all kept, served after requests whose drafts never were (or always were): its
    prediction is the model at its own rounds' acceptance, the same after either history, and far above what the
    pooled history says."""
    rounds = [SimpleNamespace(drafted=4, accepted=4, committed=5, bet=None, in_flight=1, from_ahead=False,
                              prepared=0) for _ in range(10)]
    after_bad, after_good = (Predictor(ring((10.0, 10.0), (20.0, 20.0), step=5.0)) for _ in range(2))
    for _ in range(50):
        after_bad.observe(4, 0)
        after_good.observe(4, 4)
    mine = after_bad.for_rounds(rounds)
    assert mine == pytest.approx(after_good.for_rounds(rounds))
    assert mine > 2.5 * after_bad.tokens_per_s(4)
    # 10 rounds of 4 kept: each rate (10 + 4 x 41/42) / 14 = 0.993; 1 + its chain = 4.93 tokens per 80 ms round
    assert mine == pytest.approx(1000 * 4.93 / 80, rel=0.01)


def test_a_decode_round_attends_over_its_context():
    """Timed after 128 cached tokens: rank 0 10 ms, rank 1 10 ms, each 0.001 ms per block token per cached token
    beyond; the drafter's step 2 ms, 0.0005 ms per row per cached token beyond. K=0 at a 2,128-token context:
    each rank 10 + 1 x 2,000 x 0.001 = 12 ms, a round 24 ms; K=3 over 2 rows: a stage 10 + 2 x 4 x 2 = 26 ms,
    three steps of 2 + 2 x 0.0005 x 2,000 = 4 ms; 40 cached tokens: 88 fewer, cheaper."""
    p = Pipeline((RankCost(10.0, context_ms=0.001, timed_context=128),) * 2, (LinkCost(), LinkCost()),
                 DraftCost(2.0, context_ms=0.0005, timed_context=128), Acceptance(prior=1.0))
    assert round_ms(p, 0) == pytest.approx(20.0)  # as timed
    long = at_context(p, 2128)
    assert round_ms(long, 0) == pytest.approx(24.0)
    assert stream_tokens_per_s(long, 0) == pytest.approx(1000 / 24.0)
    assert round_parts(long, 3, rows=2).prep_ms == pytest.approx(3 * 4.0 + 26.0)
    assert round_ms(at_context(p, 40), 0) == pytest.approx(20.0 - 2 * 88 * 0.001)
    assert aggregate_tokens_per_s(long, 0, 2, 1) == pytest.approx(2 * 1000 / (2 * (10.0 + 2 * 2000 * 0.001)))
    # a request's rounds of one token each from 2,128 cached on: the first 24 ms, the next 24.002, ...
    rounds = [SimpleNamespace(drafted=0, accepted=0, committed=1, bet=None, in_flight=1, from_ahead=False,
                              prepared=0) for _ in range(3)]
    assert Predictor(p).for_rounds(rounds, start=2128) == pytest.approx(3000 / (24.0 + 24.002 + 24.004))
    assert Predictor(p).tokens_per_s(0, context=2128) == pytest.approx(1000 / 24.0)
    assert Predictor(p).for_rounds(rounds) == pytest.approx(1000 / 20.0)  # no start: as timed


def test_a_row_more_attends_over_its_context_at_its_own_rate():
    """Timed after 128 cached tokens: a stage 10 ms, 0.001 ms per block token per cached token for its first row
    and 0.0006 for each row more (its rows share each read of the weights); the drafter's step 2 ms, 0.0005 ms per
    cached token for its first row and 0.0008 for each more. Four rows of 5 tokens after 2,128: the stage
    10 + 5 x (0.001 + 3 x 0.0006) x 2,000 = 38 ms (not 10 + 4 x 5 x 0.001 x 2,000 = 50); three steps over the four
    rows 3 x (2 + (0.0005 + 3 x 0.0008) x 2,000) = 23.4 ms (not 3 x 6 = 18). Untimed, a row more is the first's."""
    stage = RankCost(10.0, context_ms=0.001, context_row_ms=0.0006, timed_context=128)
    draft = DraftCost(2.0, context_ms=0.0005, context_row_ms=0.0008, timed_context=128)
    assert stage.ms(4, 5, 2128) == pytest.approx(38.0)
    assert stage.ms(1, 5, 2128) == pytest.approx(20.0)
    assert draft.round_ms(3, 4, 2128) == pytest.approx(23.4)
    assert RankCost(10.0, context_ms=0.001, timed_context=128).ms(4, 5, 2128) == pytest.approx(50.0)
    assert DraftCost(2.0, context_ms=0.0005, timed_context=128).round_ms(3, 4, 2128) == pytest.approx(18.0)


def test_a_session_prices_each_round_at_its_streams_context():
    """Session.predict: a stream of a 1,990-token prompt and 10 tokens out, each rank 10 ms and 0.001 ms per cached
    token: its round after 2,000 cached costs 12 ms a rank."""
    import time
    from speculative.session import Session
    p = Pipeline((RankCost(10.0, context_ms=0.001),) * 2, (LinkCost(), LinkCost()))
    session = SimpleNamespace(predictor=Predictor(p), scheduler=SimpleNamespace(depth=lambda: 1))
    s = SimpleNamespace(gen=SimpleNamespace(prompt_ids=[1] * 1990, ttft_s=0.0), output=SimpleNamespace(tokens=[1] * 10),
                        t_start=time.perf_counter())
    record = SimpleNamespace(drafted=0, accepted=0, bet=None, live=1, batch=1, from_ahead=False, looked_up=False,
                             prepared=0, draft_ms=0.0, stage0_ms=12.0, middle_ms=[], last_ms=12.0, on_the_way=1,
                             alone=True, ahead_ms=0.0, network_ms=0.0, busy_ms=None)
    Session.predict(session, s, record, decode=True)
    assert record.predicted_tokens_per_s == pytest.approx(1000 / 24.0)


def test_a_placements_decode_context_slopes_become_the_pipeline():
    """A layer's 0.001 ms per block token per cached token (3 layers on rank 1), the drafter's 0.01 per step per
    cached token, both timed after 128 cached tokens; rank 0 timed with every rank at once 2x slower than alone:
    its costs alone (one stream's ranks take turns), its slowdown applied in a full pipe. A row more: the layer's
    0.0004 (rank 1), the drafter's 0.006 a step (rank 0: 0.003 alone); rank 0's layers' not timed (as the first)."""
    costs = [SimpleNamespace(layer_ms=1.0, fixed_ms=20.0, draft_step_ms=4.0, draft_context_ms=0.02, alone_layer_ms=0.5,
                             draft_context_row_ms=0.006),
             SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, context_ms=0.001, context_row_ms=0.0004)]
    p = from_rank_costs(costs, [2, 3], [LinkCost(), LinkCost()], block_tokens=5, draft_steps=4, overlap=False,
                        timed_context=128)
    assert p.ranks[1].ms(2, 5, 1128) - p.ranks[1].ms(2, 5) == pytest.approx(3 * (0.001 + 0.0004) * 5 * 1000)
    assert p.ranks[0].ms(1, 5, 1128) == p.ranks[0].ms(1, 5)  # not timed there
    assert p.draft.round_ms(2, 1, 1128) - p.draft.round_ms(2, 1) == pytest.approx(2 * 0.01 * 1000)
    assert p.draft.round_ms(2, 3, 1128) - p.draft.round_ms(2, 3) == pytest.approx(2 * (0.01 + 2 * 0.003) * 1000)


def test_a_requests_last_rounds_count_at_the_depth_they_were_sent_at():
    """A depth-3 chain drains at a request's end (in_flight at the replies 3, ..., 3, 2, 1), but those replies were
    sent one chain step apart like the rest: each round counts at the most rounds on the way while it was."""
    assert depths_sent([SimpleNamespace(in_flight=n) for n in (3, 3, 3, 2, 1)]) == [3, 3, 3, 3, 3]
    assert depths_sent([SimpleNamespace(in_flight=n) for n in (1, 2, 3, 3)]) == [1, 2, 3, 3]  # a pipe filling up
    assert depths_sent([SimpleNamespace(in_flight=n) for n in (1, 1, 1)]) == [1, 1, 1]
    p = ring((10.0, 10.0), (40.0, 40.0), overlap=True)  # no drafter cost: a chain step is the trip / 3 = 30 ms
    rounds = [SimpleNamespace(drafted=4, accepted=4, committed=5, bet=True, in_flight=n, from_ahead=True,
                              prepared=int(i < 10)) for i, n in enumerate([3] * 11 + [2, 1])]  # the last 3 drain
    predictor = Predictor(p)
    mine = Predictor(p)
    for r in rounds:
        mine.observe(r.drafted, r.accepted, r.bet)
    at_three = mine.tokens_per_s(4, 3)
    assert at_three == pytest.approx(stream_tokens_per_s(mine.pipeline(), 4, 3))
    # every round at depth 3 (the three that drain: a trip, three steps less the chance of a lost bet in them)
    assert predictor.for_rounds(rounds) == pytest.approx(at_three, rel=0.01)
    # counted at the drained in_flight, the last two rounds would cost a trip / 2 and a whole trip: > 10% less
    assert at_three > 1.1 * 1000 * 65 / (11 * 5 / at_three * 1000 + 5 / mine.tokens_per_s(4, 2) * 1000
                                        + 5 / mine.tokens_per_s(4, 1) * 1000)


def test_a_requests_drained_rounds_leave_the_bets_the_rest_are_priced_at():
    """A depth-3 chain that lost its bet in 4 of its first 13 rounds, then drained: its last rounds came of bets that
    held (that is what drains) and are priced apart (drain_ms). Three drained or six, the rounds before them cost
    the same: the request's time differs by what draining three more costs, not by a hold rate the drained raised."""
    p = ring((20.0, 20.0), (40.0, 40.0), step=10.0, overlap=True, rate=0.8)
    lost = SimpleNamespace(drafted=4, accepted=0, committed=1, bet=False, in_flight=3, from_ahead=False, prepared=3)
    held = SimpleNamespace(drafted=4, accepted=4, committed=5, bet=True, in_flight=3, from_ahead=True, prepared=1)
    tail = SimpleNamespace(**{**vars(held), "prepared": 0})
    body = [lost, held, lost, held, held, lost, held, held, lost, held, held, held, held]

    def seconds(drains: int) -> float:
        rounds = [*body, *[tail] * drains]
        assert drained(rounds) == drains
        return sum(r.committed for r in rounds) / Predictor(p).for_rounds(rounds)
    assert seconds(6) - seconds(3) == pytest.approx((drain_ms(p, 4, 6) - drain_ms(p, 4, 3)) / 1000)


def test_a_chains_last_rounds_drain_a_trip_after_the_last_went():
    """Rank 0's prep 10 ms (4 draft steps of 2 ms, its slice 2 ms), rank 1 2 ms, 0.5 ms each way: a depth-3 chain
    replies every 10 ms (rank 0's prep) while it drafts, but its last 3 blocks were prepared in earlier waits (the
    answer's tokens on the way), so they reply within a trip (3 ms) of the last one sent, 2 ms apart (rank 1):
    6 ms for the three, not 30. Over 40 ms each way the same three take a trip, three chain steps: no change."""
    p = ring((2.0, 2.0), (0.5, 0.5), step=2.0, overlap=True, rate=1.0)
    assert drain_ms(p, 4, 3) == pytest.approx(6.0) and drain_ms(p, 4, 1) == pytest.approx(3.0)
    rounds = [SimpleNamespace(drafted=4, accepted=4, committed=5, bet=True, in_flight=3, from_ahead=True,
                              prepared=int(i < 10)) for i in range(13)]
    assert drained(rounds) == 3
    mine = Predictor(p)
    for r in rounds[:10]:  # (the drained rounds are priced apart, at the acceptance the others measured)
        mine.observe(r.drafted, r.accepted, r.bet)
    step_s = 5 / mine.tokens_per_s(4, 3)  # a round's time at the chain's pace, at the acceptance measured
    assert step_s == pytest.approx(0.010, rel=0.03)  # (ten bets measured: the prior still weighs a little)
    before = SimpleNamespace(in_flight=3)
    assert Predictor(p).for_rounds(rounds, before=before) == pytest.approx(65 / (10 * step_s + 0.006))
    # a lost bet: the last round's block was made after the reply before it
    fresh = [*rounds[:-1], SimpleNamespace(**{**vars(rounds[-1]), "from_ahead": False})]
    every = Predictor(p)  # (none drained: every round's acceptance counts)
    for r in fresh:
        every.observe(r.drafted, r.accepted, r.bet)
    fresh_step_s = 5 / every.tokens_per_s(4, 3)
    assert drained(fresh) == 0
    assert Predictor(p).for_rounds(fresh, before=before) == pytest.approx(65 / (13 * fresh_step_s))
    in_turn = [SimpleNamespace(**{**vars(r), "from_ahead": False, "prepared": 0}) for r in rounds]  # K=0 rounds
    assert drained(in_turn) == 0
    far = ring((2.0, 2.0), (40.0, 40.0), step=2.0, overlap=True, rate=1.0)  # a chain step: the trip / 3
    assert drain_ms(far, 4, 3) == pytest.approx(3 * chain_step_ms(far, 4, 3))


def test_deepening_a_chain_after_its_first_reply_costs_its_first_trip_less_a_step():
    """Rank 0 10 ms, rank 1 10 ms, 40 ms each way: the trip 90 ms; at depth 3 a full chain replies every 30 ms.
    Deepened from 1 after the first token (spec.in_flight=auto), its first reply is a trip away: 60 ms more than a
    step; from 2 (a reply every 45 ms until the new rounds' replies come): 90 x (1 - 30/45) = 30 ms. A drafter
    of 10 ms a step at K=4 (prep 50 ms) bounds depth 4's step at 50: deepened from 1, 90 - 50 = 40 ms."""
    p = ring((10.0, 10.0), (40.0, 40.0), overlap=True, rate=1.0)
    assert deepening_ms(p, 4, 1, 3) == pytest.approx(60.0)
    assert deepening_ms(p, 4, 2, 3) == pytest.approx(30.0)
    assert deepening_ms(p, 4, 3, 3) == deepening_ms(p, 4, 3, 1) == deepening_ms(p, 0, 1, 3) == 0.0
    assert deepening_ms(ring((10.0, 10.0), (40.0, 40.0), step=10.0, overlap=True), 4, 1, 4) == pytest.approx(40.0)
    # a request of 13 rounds at depth 3, the chain deepened after the first token (its first round replied with
    # one on the way) or filled in the first round's wait (three on the way at its reply)
    rounds = [SimpleNamespace(drafted=4, accepted=4, committed=5, bet=True, in_flight=3, from_ahead=True,
                              prepared=int(i < 10)) for i in range(13)]
    steady = Predictor(p).for_rounds(rounds, before=SimpleNamespace(in_flight=3))  # ~ 5 tokens a 30 ms step
    assert steady == pytest.approx(1000 * 65 / (13 * 30.0), rel=0.02)
    assert Predictor(p).for_rounds(rounds, before=SimpleNamespace(in_flight=1)) == pytest.approx(
        65 / (65 / steady + 0.060))
    assert Predictor(p).for_rounds(rounds, streams=2, before=SimpleNamespace(in_flight=1)) == pytest.approx(
        Predictor(p).for_rounds(rounds, streams=2))  # several streams: no chain


def test_a_run_prints_its_prediction_and_logs_it_beside_every_round(tiny_qwen, tmp_path, capsys):
    """The whole entry in process (both ranks timed: model.split=auto): the start-up line, then per decode round the
    predicted and measured tokens/s (summary.json's rounds, the TensorBoard scalars), and the output JSON's stats."""
    from tests.support.tiny_models import ids_arg, run_pair
    out = run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=auto", "draft.kind=model",
                   f"draft.model={tiny_qwen}", "draft.dtype=float32", "draft.quant=none", "spec.k=3",
                   f"prompt_ids={ids_arg([11, 42, 7, 250, 3])}", "gen.max_new_tokens=12", f"log.dir={tmp_path}")
    err = capsys.readouterr().err
    assert "[predicted: " in err and "tokens/s for one stream (K=3" in err and "TTFT of a 2048-token prompt" in err
    assert re.search(r"128 tokens cached; [\d.]+ after 2048;", err)  # and after a long prompt's
    stats = out["stats"]
    assert stats["predicted_tokens_per_s"] > 0 and stats["predicted_ttft_s"] > 0
    (summary,) = tmp_path.glob("*/summary.json")
    rounds = json.loads(summary.read_text())["rounds"]
    assert all(r["predicted_tokens_per_s"] > 0 and r["measured_tokens_per_s"] > 0 for r in rounds[1:]), rounds
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(summary.parent))
    events.Reload()
    assert len(events.Scalars("round/predicted_tokens_per_s")) == len(rounds) - 1
    for part in ("draft_ms", "stage0_ms", "last_ms"):  # the model's parts of each decode round beside the measured
        predicted = [e.value for e in events.Scalars(f"round/predicted_{part}")]
        assert len(predicted) == len(rounds) - 1 and all(ms > 0 for ms in predicted), (part, predicted)
        assert predicted == pytest.approx([r["predicted_parts"][part] for r in rounds[1:]])
    assert events.Scalars("run/predicted_tokens_per_s")[0].value == pytest.approx(stats["predicted_tokens_per_s"])


def test_a_drafter_step_over_more_rows_costs_what_draft_quant_auto_timed():
    """auto timed a step at 50 ms for one row, 80 ms for four: each row more 10 ms, so a round of 2 drafts for four
    streams prepares in 2 x 80 + rank 0's slice (10 ms); without auto's timings the model keeps its own."""
    from launch.prediction import with_draft_rows
    p = ring((10.0, 10.0), step=50.0)
    four = with_draft_rows(p, SimpleNamespace(step_ms={1: 50.0, 4: 80.0}))
    assert four.draft.row_ms == pytest.approx(10.0)
    assert round_parts(four, 2, rows=4).prep_ms == pytest.approx(2 * 80.0 + 10.0)
    assert with_draft_rows(p, None) is p and with_draft_rows(p, SimpleNamespace(step_ms={1: 50.0})) is p


def test_a_session_predicts_the_ttft_of_prompts_admitted_together():
    """Session.predict_ttft on the case above: A admitted alone predicts 0.15 s; B, admitted before A's first round
    went out, predicts 0.2 s from its admission (0.25 from its arrival: the engine adds the queue it measured) and
    holds A's back by its own prefill (0.05 s): 0.2 s, as the queue runs."""
    from speculative.session import Session

    def stream(tokens, t_start=0.0):
        return SimpleNamespace(gen=SimpleNamespace(rounds=[], prompt_ids=[1] * tokens, reused=0, predicted_ttft_s=0.0),
                               chain=[], k_now=0, pending=[1] * min(tokens, 500), t_start=t_start, newcomers=[])
    session = SimpleNamespace(live=[], predictor=Predictor(ring((0.0, 0.0), (0.0, 0.0), token_ms=0.1), chunk=500),
                              scheduler=SimpleNamespace(in_flight=SimpleNamespace(now=lambda: 1)),
                              spec=SimpleNamespace(prefill_chunk=500))
    a, b = stream(1000), stream(1000, t_start=0.05)  # B's admission begins as A's ends
    Session.predict_ttft(session, a, 1000)
    session.live.append(a)
    Session.predict_ttft(session, b, 1000)
    assert (a.gen.predicted_ttft_s, b.gen.predicted_ttft_s) == pytest.approx((0.2, 0.2))
    a.gen.rounds.append("answered")  # once A's first round is in, a newcomer neither waits for it nor holds it back
    c = stream(1000)
    Session.predict_ttft(session, c, 1000)
    assert (a.gen.predicted_ttft_s, c.gen.predicted_ttft_s) == pytest.approx((0.2, 0.15))
    # two 40-token prompts, the second admitted 2 ms after the first: their first rounds go as one batch of two rows
    # (8 ms a rank), so both tokens come at 16 ms after the second's admission: the first's prediction grows to 18
    session.live = []
    d, e = stream(40), stream(40, t_start=0.002)
    Session.predict_ttft(session, d, 40)
    assert d.gen.predicted_ttft_s == pytest.approx(0.008)
    session.live.append(d)
    Session.predict_ttft(session, e, 40)
    assert (d.gen.predicted_ttft_s, e.gen.predicted_ttft_s) == pytest.approx((0.018, 0.016))


def test_prompts_admitted_together_reply_behind_every_first_round_and_the_drafters_intake():
    """Three 1,000-token prompts admitted 50 ms apart (each admission rank 0's 50 ms over its first 500-token chunk;
    every chunk 50 ms on each of two ranks, nothing on the wire). From their admissions, A's chunk was on rank 1
    over -50..0 ms and B's over 0..50, so C's over 50..100; the first rounds (500 tokens each, one batch each) on
    rank 0 over 50..200 and on rank 1 over 100..250: C's first token at 250 ms. A's and B's replies come at 150 and
    200, but rank 0 sends every first round before it takes one: both at 200 (300 and 250 ms after their own
    admissions). Counted from C's admission on, the two chunks before would hold rank 1 until 100 and C's token come
    at 300. At K=4 the drafter takes each chunk in too (10 ms: admissions 60 ms apart), and each first round's
    chunk in the wait (30 ms after the last first round leaves rank 0 at 210): all three replies taken at 240, C's
    own at 260 (360 and 300 ms after A's and B's admissions)."""
    from speculative.session import Session
    p = ring((0.0, 0.0), (0.0, 0.0), token_ms=0.1)
    predictor = Predictor(p, chunk=500)
    assert predictor.first_tokens_s(1000, (1000, 1000), ago_ms=(100.0, 50.0)) == pytest.approx((0.2, 0.2, 0.25))
    assert predictor.ttft_s(1000, (1000, 1000)) == pytest.approx(0.30)
    streams = [SimpleNamespace(gen=SimpleNamespace(rounds=[], prompt_ids=[1] * 1000, reused=0, predicted_ttft_s=0.0),
                               chain=[], k_now=0, pending=[1] * 500, t_start=0.05 * i, newcomers=[]) for i in range(3)]
    session = SimpleNamespace(live=[], predictor=predictor, scheduler=SimpleNamespace(
        in_flight=SimpleNamespace(now=lambda: 1)))
    for s in streams:
        Session.predict_ttft(session, s, 1000)
        session.live.append(s)
    assert [s.gen.predicted_ttft_s for s in streams] == pytest.approx([0.30, 0.25, 0.25])
    session.live, session.predictor = [], Predictor(replace(p, draft=DraftCost(0.0, token_ms=0.02)), chunk=500)
    for i, s in enumerate(streams):
        s.k_now, s.t_start = 4, 0.06 * i
        Session.predict_ttft(session, s, 1000)
        session.live.append(s)
    assert [s.gen.predicted_ttft_s for s in streams] == pytest.approx([0.36, 0.30, 0.26])


def test_a_stream_decoding_waits_for_the_prompts_admitted_after_it():
    """The ring above (a 1,000-token prompt alone: its first token 0.15 s after its admission). A is decoding when B
    comes at 1.0 s (its first token at 1.15) and C at 1.05, before B's first round went: B's first token moves to 1.2,
    C's comes at 1.25. A's next replies wait for both prefills, once where they overlap: 1.0 to 1.25; B's for C's
    from its own first token on: 0.05; C's for none. A's 10 tokens decoded at 10 tokens/s then read 8. Over links of
    50 ms each way every first token comes 0.1 s later, which is wire, not a wait: A's hold is the same, and B's round
    sent at its first token (1.3) reaches rank 1 as C's chunks leave it (C's token at 1.35): none."""
    from speculative.session import Session
    from speculative.rounds import Generation, RoundRecord
    from speculative.stats import held_back, summarize

    def stream(t_start):
        return SimpleNamespace(gen=SimpleNamespace(rounds=[], prompt_ids=[1] * 1000, reused=0, predicted_ttft_s=0.0,
                                                   predicted_held_s=0.0, output=SimpleNamespace(tokens=[])),
                               chain=[], k_now=0, pending=[1] * 500, t_start=t_start, newcomers=[], committed=[],
                               output=SimpleNamespace(tokens=[]), slot=0, drop_chain=lambda: 0)
    def admitted(one_way_ms):
        session = SimpleNamespace(live=[], predictor=Predictor(ring((0.0, 0.0), (one_way_ms,) * 2, token_ms=0.1),
                                                               chunk=500),
                                  scheduler=SimpleNamespace(in_flight=SimpleNamespace(now=lambda: 1),
                                                            give_back=lambda slot, holds: None), prefixes=None)
        session.held_s = lambda s: Session.held_s(session, s)
        streams = stream(0.0), stream(1.0), stream(1.05)
        Session.predict_ttft(session, streams[0], 1000)
        session.live.append(streams[0])
        streams[0].gen.rounds.append("answered")  # A decodes from its first token on
        for s in streams[1:]:
            Session.predict_ttft(session, s, 1000)
            session.live.append(s)
        return session, streams
    for one_way_ms, firsts, holds in ((0.0, (0.15, 1.2, 1.25), (0.25, 0.05, 0.0)),
                                      (50.0, (0.25, 1.3, 1.35), (0.25, 0.0, 0.0))):
        session, streams = admitted(one_way_ms)
        assert [s.t_start + s.gen.predicted_ttft_s for s in streams] == pytest.approx(firsts)
        for s, held in zip(streams, holds):
            Session.end(session, s)
            assert s.gen.predicted_held_s == pytest.approx(held)
    assert held_back(10.0, 10, 0.25) == pytest.approx(8.0) and held_back(0.0, 10, 0.25) == 0.0
    gen = Generation([1], SimpleNamespace(tokens=[5] * 11, stop_reason="length"),
                     [RoundRecord(0, 0, 1, 0.0, 1.0, 1.0, 1.0)] * 11, ttft_s=0.1, total_s=1.5,
                     predicted_tokens_per_s=10.0, predicted_held_s=0.25)
    assert summarize(gen, 4, "model")["predicted_tokens_per_s"] == pytest.approx(8.0)  # what the API answers


def test_the_predictor_counts_the_bets_that_held():
    """A first round's bet (on its token: it drafts nothing), then six rounds of K=4, every draft kept and every
    bet held: the five shrunk position rates multiply to 0.925 (each 0.985), which would price one bet in thirteen
    as lost; counted from the bets, with that product as one bet's prior, h = (7 + 0.925) / 8 = 0.991. Bets that
    all failed give (0 + their product) / 8."""
    held, lost = Predictor(ring(rate=0.7, overlap=True)), Predictor(ring(rate=0.7, overlap=True))
    held.observe(0, 0, True)
    lost.observe(0, 0, False)
    for _ in range(6):
        held.observe(4, 4, True)
        lost.observe(4, 4, False)
    product = Acceptance.from_counts(held.tried, held.kept).bet_holds(4)
    assert product == pytest.approx(0.925, abs=0.001)
    assert held.pipeline().acceptance.bet_holds(4) == pytest.approx((7 + product) / 8)
    assert lost.pipeline().acceptance.bet_holds(4) == pytest.approx(product / 8)
    assert Predictor(ring(rate=0.7)).pipeline().acceptance.hold is None  # no bet measured: the rates' product


def test_ranks_that_slow_each_other_pay_it_only_in_a_full_pipe():
    """Two ranks of 10 ms a round over free links, each twice as slow while the other computes (timed at once: 2x
    alone). Four streams in two batches: the two batches keep both ranks at work at once, 2 x 20 ms a cycle instead
    of 2 x 10; in one batch they take turns, 20 ms. A chain of bets (rank 0's prep 10 ms, rank 1 40 ms, trip 240 ms,
    four on the way) leaves rank 0 every 240 / 4 = 60 ms; with rank 0 eight times as slow while rank 1 works, its
    prep takes 10 + 7 x min(10, 40) = 80 ms, and sets the pace. Slowed while rank 1 works 5 ms: 10 + 7 x 5 = 45."""
    alone = ring((10.0, 10.0), rate=1.0)
    shared = replace(alone, together=(2.0, 2.0))
    four_tokens = 1000 * 4 * tokens_per_round(alone.acceptance, 0)
    assert aggregate_tokens_per_s(alone, 0, 4, 2) == pytest.approx(four_tokens / 20)
    assert aggregate_tokens_per_s(shared, 0, 4, 2) == pytest.approx(four_tokens / 40)
    assert aggregate_tokens_per_s(shared, 0, 4, 1) == pytest.approx(four_tokens / 20)  # in turns: nothing shared
    assert best_batches(alone, 0, 4) == 2 and best_batches(shared, 0, 4) == 1
    chain = ring((5.0, 40.0), (100.0, 100.0), step=1.25, rate=1.0, overlap=True)  # prep 10 ms
    slow0 = replace(chain, together=(8.0, 1.0))
    assert stream_tokens_per_s(chain, 4, 4) == pytest.approx(5 * 1000 / 60)
    assert stream_tokens_per_s(slow0, 4, 4) == pytest.approx(5 * 1000 / 80)
    assert stream_tokens_per_s(slow0, 4, 1) == stream_tokens_per_s(chain, 4, 1)  # one on the way: the trip sets it
    assert round_parts(replace(slow0, ranks=(RankCost(5.0), RankCost(5.0))), 4).full_prep_ms == pytest.approx(45.0)


def test_a_rank_timed_alone_and_at_once_gives_its_costs_alone_and_its_slowdown():
    """Rank 0 timed 2 ms a layer with both ranks at once and 1 ms alone; rank 1 not alone (0): its round costs are
    halved (fixed part too), its slowdown 2; rank 1 keeps its figures, slowdown 1."""
    costs = [SimpleNamespace(layer_ms=2.0, fixed_ms=4.0, alone_layer_ms=1.0),
             SimpleNamespace(layer_ms=3.0, fixed_ms=0.0, alone_layer_ms=0.0)]
    p = from_rank_costs(costs, [2, 2], [LinkCost(), LinkCost()], block_tokens=1)
    assert p.together == (2.0, 1.0)
    assert p.ranks[0].ms(1, 1) == pytest.approx(2 * 1.0 + 2.0 + ENGINE_RANK0_MS)
    assert p.ranks[1].ms(1, 1) == pytest.approx(2 * 3.0 + ENGINE_LAST_MS)


def test_a_prefill_chunk_costs_its_slopes_timed_alone_where_they_were():
    """Rank 1, 2 layers: timed at once 0.3 ms a token more and 1e-4 ms a token per earlier token a layer; alone 0.15
    and 5e-5. A 512-token chunk after 1,024 cached tokens costs 2 x (511 x 0.15 + 512 x (1,024 + 256) x 5e-5) more
    than a one-token block: its slopes alone (the host's cores bound the ranks at once: first_tokens_s); untimed
    alone (0), the slopes at once."""
    at_once = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, layer_token_ms=0.3, attend_ms=1e-4)
    alone = SimpleNamespace(**vars(at_once), alone_layer_token_ms=0.15, alone_attend_ms=5e-5)
    first = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0)
    chunk = 2 * (512 * 0.15 + 512 * (1024 + 256) * 5e-5)
    p = from_rank_costs([first, alone], [1, 2], [LinkCost(), LinkCost()], block_tokens=1)
    assert p.ranks[1].chunk_ms(512, 1024) - p.ranks[1].ms(1, 1) == pytest.approx(chunk - 2 * 0.15)
    p = from_rank_costs([first, at_once], [1, 2], [LinkCost(), LinkCost()], block_tokens=1)
    assert p.ranks[1].chunk_ms(512, 1024) - p.ranks[1].ms(1, 1) == pytest.approx(2 * chunk - 2 * 0.3)


def test_a_prefill_chunk_costs_what_chunks_of_its_size_timed_alone_cost():
    """Rank 1, 2 layers, timed alone over chunks of 1, 33 and 512 tokens after 128 cached: 1, 3 and 20 ms a layer
    (no line: its slope 0.01 ms a token says 6.1 at 512), attention 1e-5 ms a token per earlier token a layer. A
    512-token chunk after 1,024 cached costs its two layers' 20 less the attention timed in them (after 128, and
    half the chunk) and more over 1,024 and half the chunk; a 40-token chunk after none, 7 / 479 of the way from
    33's to 512's, each less the attention timed in it, more its own; the line where no chunk was timed."""
    table = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, alone_layer_token_ms=0.01, alone_attend_ms=1e-5,
                            alone_prefill_ms=[[1, 1.0], [33, 3.0], [512, 20.0]])
    first = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0)
    p = from_rank_costs([first, table], [1, 2], [LinkCost(), LinkCost()], block_tokens=1, timed_context=128)
    attend = 2 * 1e-5
    assert p.ranks[1].chunk_ms(512, 1024) == pytest.approx(
        ENGINE_LAST_MS + 2 * 20.0 - attend * 512 * (128 + 256) + attend * 512 * (1024 + 256))
    bare33, bare512 = 2 * 3.0 - attend * 33 * (128 + 16.5), 2 * 20.0 - attend * 512 * (128 + 256)
    assert p.ranks[1].chunk_ms(40, 0) == pytest.approx(
        ENGINE_LAST_MS + bare33 + 7 * (bare512 - bare33) / 479 + attend * 40 * 20)
    line = from_rank_costs([first, SimpleNamespace(**{**vars(table), "alone_prefill_ms": []})], [1, 2],
                           [LinkCost(), LinkCost()], block_tokens=1, timed_context=128)
    assert line.ranks[1].chunk_ms(512, 0) == pytest.approx(ENGINE_LAST_MS + 2 * (1.0 + 511 * 0.01) + attend * 512 * 256)


def test_the_drafter_takes_a_chunk_in_at_what_chunks_of_its_size_timed_alone_cost():
    """Rank 0's drafter timed alone taking in chunks of 1, 32 and 512 tokens after 128 cached: 2, 10 and 30 ms (its
    line, a step and 0.02 ms a token, says under 3 at 32), attention 1e-4 ms a token per earlier token. Less the
    attention timed in them (over the 128 and half the chunk), 40 tokens after none cost what is 8 / 480 of the way
    from 32's to 512's, and their own attention (over half of them); 512 after 1,024, 30 and attention over 896 more;
    2,000 at once (a lagging drafter), 512's and the slope from 32's on, and attention over 1,024 and 1,000 of
    them; the line where no chunk was timed."""
    timed = SimpleNamespace(layer_ms=1.0, fixed_ms=5 * 2.0, draft_step_ms=2.0, draft_token_ms=0.02,
                            draft_attend_ms=1e-4, alone_draft_prefill_ms=[[1, 2.0], [32, 10.0], [512, 30.0]])
    last = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0)
    p = from_rank_costs([timed, last], [1, 1], [LinkCost(), LinkCost()], 5, draft_steps=5, timed_context=128)
    bare32, bare512 = 10.0 - 1e-4 * 32 * (128 + 16), 30.0 - 1e-4 * 512 * (128 + 256)
    assert p.draft.prefill_ms(40, 0) == pytest.approx(bare32 + 8 * (bare512 - bare32) / 480 + 1e-4 * 40 * 20)
    assert p.draft.prefill_ms(512, 1024) == pytest.approx(30.0 + 1e-4 * 512 * (1024 - 128))
    assert p.draft.prefill_ms(2000, 1024) == pytest.approx(
        bare512 + 1488 * (bare512 - bare32) / 480 + 1e-4 * 2000 * (1024 + 1000))
    line = from_rank_costs([SimpleNamespace(**{**vars(timed), "alone_draft_prefill_ms": []}), last], [1, 1],
                           [LinkCost(), LinkCost()], 5, draft_steps=5, timed_context=128)
    assert line.draft.prefill_ms(40, 0) == pytest.approx(line.draft.step_ms + 40 * 0.02 + 1e-4 * 40 * 20)


def test_rank_0s_drafter_step_timed_alone_gives_its_step_and_its_slowdown():
    """Rank 0's five drafter steps of 2 ms (at once) in its 12 ms besides its layers, the step 1.6 ms alone, its layer
    the same both ways (too coarse to tell): its slowdown is the step's 1.25, a step costs 1.6 alone (and the
    engine's sampling), its layers and the rest 1/1.25 of their timing."""
    costs = [SimpleNamespace(layer_ms=0.5, fixed_ms=12.0, alone_layer_ms=0.5, draft_step_ms=2.0,
                             alone_draft_step_ms=1.6), SimpleNamespace(layer_ms=0.5, fixed_ms=0.0)]
    p = from_rank_costs(costs, [2, 2], [LinkCost(), LinkCost()], block_tokens=5, draft_steps=5)
    assert p.together == (1.25, 1.0)
    assert p.draft.step_ms == pytest.approx(1.6 + ENGINE_STEP_MS)
    assert p.ranks[0].ms(1, 5) == pytest.approx((2 * 0.5 + 2.0) / 1.25 + ENGINE_RANK0_MS)
    unset = from_rank_costs([SimpleNamespace(**{**vars(costs[0]), "alone_draft_step_ms": 0.0}), costs[1]], [2, 2],
                            [LinkCost(), LinkCost()], block_tokens=5, draft_steps=5)
    assert unset.together == (1.0, 1.0) and unset.draft.step_ms == pytest.approx(2.0 + ENGINE_STEP_MS)


def test_a_row_more_in_a_batch_costs_what_the_timing_over_rows_said():
    """Rank 1: 3 layers of 1 ms over a block of 5, a layer 0.4 ms a row more, the head 0.6 ms a row more, 0.02 ms a
    token more per layer (which RankCost adds per row on its own): four rows cost 3 x (3 x 0.4 + 0.6) = 5.4 ms more
    than one; timed at once at twice its cost alone, half that. Untimed (0): a row costs only its tokens. The engine's
    work for a row (ENGINE_LATER_ROW_MS) comes on top in each case."""
    timed = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, layer_token_ms=0.02, layer_row_ms=0.4, head_row_ms=0.6)
    p = from_rank_costs([SimpleNamespace(layer_ms=1.0, fixed_ms=0.0), timed], [1, 3], [LinkCost(), LinkCost()], 5)
    assert p.ranks[1].ms(4, 5) - p.ranks[1].ms(1, 5) == pytest.approx(3 * (3 * 0.4 + 0.6 + ENGINE_LATER_ROW_MS))
    assert p.ranks[1].ms(1, 5) == pytest.approx(3 * 1.0 + ENGINE_LAST_MS)  # one row: the block as timed
    shared = SimpleNamespace(**vars(timed), alone_layer_ms=0.5)
    p = from_rank_costs([SimpleNamespace(layer_ms=1.0, fixed_ms=0.0), shared], [1, 3], [LinkCost(), LinkCost()], 5)
    assert p.ranks[1].ms(4, 5) - p.ranks[1].ms(1, 5) == pytest.approx(3 * ((3 * 0.4 + 0.6) / 2 + ENGINE_LATER_ROW_MS))
    untimed = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, layer_token_ms=0.02)
    p = from_rank_costs([SimpleNamespace(layer_ms=1.0, fixed_ms=0.0), untimed], [1, 3], [LinkCost(), LinkCost()], 5)
    assert p.ranks[1].ms(4, 5) - p.ranks[1].ms(1, 5) == pytest.approx(3 * (3 * 0.02 * 5 + ENGINE_LATER_ROW_MS))


def test_a_row_more_in_a_draft_step_costs_what_the_drafters_timing_over_rows_said():
    """Rank 0 drafts 4 (5 steps with spec.overlap) with a step of 1 ms at one row and 0.4 ms a row more as timed
    over rows: four rows cost 5 x 3 x 0.4 = 6 ms more a round than one. A prompt token costs the drafter 0.02 ms
    more than the step of its catch-up, which is what a row cost before rows were timed, and still is where they
    were not."""
    timed = SimpleNamespace(layer_ms=1.0, fixed_ms=5 * 1.0, draft_step_ms=1.0, draft_token_ms=0.02, draft_row_ms=0.4)
    last = SimpleNamespace(layer_ms=1.0, fixed_ms=0.0)
    p = from_rank_costs([timed, last], [1, 1], [LinkCost(), LinkCost()], 5, draft_steps=5)
    assert p.draft.round_ms(4, 4) - p.draft.round_ms(4, 1) == pytest.approx(5 * 3 * 0.4)
    assert p.draft.prefill_ms(100) == pytest.approx(p.draft.step_ms + 100 * 0.02)
    untimed = SimpleNamespace(**{**vars(timed), "draft_row_ms": 0.0})
    p = from_rank_costs([untimed, last], [1, 1], [LinkCost(), LinkCost()], 5, draft_steps=5)
    assert p.draft.round_ms(4, 4) - p.draft.round_ms(4, 1) == pytest.approx(5 * 3 * 0.02)


def costly(p: Pipeline, *message_ms: float) -> Pipeline:
    """`p` with link i's messages costing its two ends message_ms[i] each."""
    return replace(p, links=tuple(replace(link, message_ms=m) for link, m in zip(p.links, message_ms)))


def test_every_frame_costs_the_ranks_at_its_ends_in_a_full_pipe():
    """Two ranks of 1 ms a round over free links, 0.5 ms a frame: a batch is a frame of Rounds one way and a frame of
    Replies back, so each rank is busy 1 + 2 x 0.5 = 2 ms a batch, and four streams at K=0 in four batches cycle in
    4 x 2 = 8 ms, not 4 x 1. A lone round's frames are inside the links' latency (as probed): nothing more; a batch of
    four rows is still one frame each way: the same 2 ms busy, no row queued behind another."""
    free = ring((1.0, 1.0), rate=1.0)
    p = costly(free, 0.5, 0.5)
    parts = round_parts(p, 0, 1)
    assert parts.busiest_ms == pytest.approx(2.0) and parts.full_prep_ms == pytest.approx(2.0)
    assert parts.later_busiest_ms == pytest.approx(2.0) and parts.prep_ms == 1.0
    assert aggregate_tokens_per_s(free, 0, 4, 4) == pytest.approx(1000 * 4 / 4.0)
    assert aggregate_tokens_per_s(p, 0, 4, 4) == pytest.approx(1000 * 4 / 8.0)
    assert round_ms(p, 0, 1) == round_ms(free, 0, 1) == 2.0  # one stream alone, in turn
    assert round_ms(p, 0, 4) == pytest.approx(round_ms(free, 0, 4))
    assert round_parts(p, 0, 4).busiest_ms == pytest.approx(1.0 + 2 * 0.5)  # the batch's two frames
    assert aggregate_tokens_per_s(p, 0, 4, 1) == pytest.approx(1000 * 4 / 2.0)  # one batch of four, in turn: 1 + 1 ms


def test_a_chain_of_bets_leaves_rank_0_at_its_prep_and_messages():
    """Rank 0 prepares a block in 100 ms (4 steps of 20 + its 20 ms slice), the trip is 200 ms, bets hold: four on
    the way go at rank 0's pace; at 5 ms a message it sends a Round and takes a Reply per block: 110 ms a block.
    One on the way: the trip's pace, the messages inside its latency."""
    slow = ring((20.0, 0.0), (100.0, 100.0), step=20.0, rate=1.0, overlap=True)
    p = costly(slow, 5.0, 5.0)
    assert stream_tokens_per_s(slow, 4, 4) == pytest.approx(5 * 1000 / 100)
    assert stream_tokens_per_s(p, 4, 4) == pytest.approx(5 * 1000 / 110)
    assert stream_tokens_per_s(p, 4, 1) == stream_tokens_per_s(slow, 4, 1) == pytest.approx(5 * 1000 / 200)


def test_a_rank_pays_for_the_frames_on_its_own_two_links():
    """Three ranks, links of 0.1 / 0.2 / 0.4 ms a frame (rank 0 -> 1, 1 -> 2, the reply 2 -> 0), a batch of two rows
    (one frame a link): rank 0 pays 0.4 + 0.1 = 0.5, rank 1 0.1 + 0.2 = 0.3 besides its 1 ms, rank 2 0.2 + 0.4 = 0.6."""
    inf = float("inf")
    p = costly(ring((0.0, 1.0, 0.0), (0.0,) * 3, (inf,) * 3), 0.1, 0.2, 0.4)
    parts = round_parts(p, 0, 2)
    assert parts.full_prep_ms == pytest.approx(0.5)
    assert parts.later_busiest_ms == pytest.approx(1.3)  # rank 1, above rank 2's 0.6
    assert round_parts(replace(p, ranks=(RankCost(0.0),) * 3), 0, 2).later_busiest_ms == pytest.approx(0.6)
    assert parts.trip_ms == pytest.approx(1.0)  # a lone batch's frames: inside each link's latency


def test_each_prefill_chunk_keeps_the_ranks_at_its_ends_busy_a_message_more():
    """2000 tokens in chunks of 500, both ranks 0.1 ms a token (50 ms a chunk), 5 ms a message: rank 0 sends a chunk
    every 55 ms, rank 1 takes one every 55; the last chunk's own messages are in the latency: 50 + 3 x 55 + 50 ms."""
    free = ring((0.0, 0.0), (0.0, 0.0), token_ms=0.1)
    p = costly(free, 5.0, 5.0)
    assert ttft_s(free, 2000, 500) == pytest.approx(250 / 1000)
    assert ttft_s(p, 2000, 500) == pytest.approx((50 + 3 * 55 + 50) / 1000)


def test_the_handshakes_probe_gives_each_links_message_cost():
    from launch.prediction import link_costs
    from netbridge.link_probe import LinkProbe
    links = (LinkProbe("gloo", 2.0, 100.0, 90.0, 0.7), LinkProbe("gloo", 1.0, 80.0, 70.0, 1.5))
    plan = SimpleNamespace(ranks=2, links=links)
    assert link_costs(plan) == (LinkCost(1.0, 100.0, 0.7), LinkCost(0.5, 80.0, 1.5))


def test_ranks_that_ask_a_host_for_more_cores_than_it_has_share_them_in_a_full_pipe():
    """Three ranks of 10 ms a round over free links, each one thread of one host's two cores (half of them each):
    four streams at K=0 in four batches keep all three at work at once, which the two cores do in 4 x 30 / 2 = 60 ms
    a cycle, not 4 x 10; in one batch they take turns (30 ms either way). On three hosts, on GPUs (no share of the
    cores) or a quarter of the cores each, 40 ms. A chain of bets, four on the way (K=4 at 2 ms a step: rank 0 18
    ms, the others 10), steps at a quarter of its trip over links of 340 ms (1,040 ms), and over free links at the
    host's (18 + 10 + 10) / 2 = 19 ms, not rank 0's 18."""
    alone = ring((10.0, 10.0, 10.0), (0.0,) * 3, (float("inf"),) * 3, rate=1.0)
    shared = replace(alone, hosts=(0, 0, 0), cores=(0.5, 0.5, 0.5))
    four_tokens = 1000 * 4 * tokens_per_round(alone.acceptance, 0)
    assert aggregate_tokens_per_s(alone, 0, 4, 4) == pytest.approx(four_tokens / 40)
    assert aggregate_tokens_per_s(shared, 0, 4, 4) == pytest.approx(four_tokens / 60)
    assert aggregate_tokens_per_s(shared, 0, 4, 1) == pytest.approx(four_tokens / 30)  # in turns: 10 + 10 + 10
    assert aggregate_tokens_per_s(replace(shared, hosts=(0, 1, 2)), 0, 4, 4) == pytest.approx(four_tokens / 40)
    assert aggregate_tokens_per_s(replace(shared, cores=(0.0,) * 3), 0, 4, 4) == pytest.approx(four_tokens / 40)
    assert aggregate_tokens_per_s(replace(shared, cores=(0.25,) * 3), 0, 4, 4) == pytest.approx(four_tokens / 40)
    chain = replace(ring((10.0, 10.0, 10.0), (340.0,) * 3, (float("inf"),) * 3, step=2.0, rate=1.0, overlap=True),
                    hosts=(0, 0, 0))
    assert chain_step_ms(chain, 4, 4) == pytest.approx(1040 / 4)  # the trip's pace first
    fast = replace(chain, links=(LinkCost(),) * 3)
    assert chain_step_ms(fast, 4, 4) == pytest.approx(18.0)
    assert chain_step_ms(replace(fast, cores=(0.5,) * 3), 4, 4) == pytest.approx(19.0)
    assert stream_tokens_per_s(replace(fast, cores=(0.5,) * 3), 4, 4) == pytest.approx(5 * 1000 / 19.0)


def test_a_placements_hosts_and_core_shares_become_the_pipeline():
    """Four ranks, two a host (torchrun's LOCAL_RANK 0, 1, 0, 1), one thread of each host's two cores: two hosts.
    Ranks that say neither (older costs): each on a host of its own, no share of its cores."""
    costs = [SimpleNamespace(layer_ms=1.0, fixed_ms=0.0, host_rank=place, core_share=0.5) for place in (0, 1, 0, 1)]
    p = from_rank_costs(costs, [1, 1, 1, 1], [LinkCost()] * 4, block_tokens=1)
    assert p.hosts == (0, 0, 1, 1) and p.cores == (0.5,) * 4
    untimed = from_rank_costs([SimpleNamespace(layer_ms=1.0, fixed_ms=0.0)] * 2, [1, 1], [LinkCost()] * 2, 1)
    assert untimed.hosts == (0, 1) and untimed.cores == (0.0, 0.0)  # not said: each a host of its own


def test_a_prefill_pipelined_over_ranks_that_share_a_hosts_cores_waits_for_them():
    """A 4,000-token prompt in chunks of 500 over three ranks of 0.1 ms a token (50 ms a chunk) and free links: the
    chunks pipelined reply after 8 x 50 + 2 x 50 = 500 ms. On one host's two cores, each rank one thread (half of
    them): the pipe fills (rank 0's first chunk alone, then two ranks: each at full speed), six chunks go with all
    three at 2/3 speed (75 ms), and it drains: 50 + 50 + 6 x 75 + 50 + 50 = 650 (the cores' sum alone, 3 x 8 x 50 / 2,
    says 600). A 1,000-token prompt never has three at work: 4 x 50. On three hosts: 500."""
    inf = float("inf")
    free = ring((0.0, 0.0, 0.0), (0.0,) * 3, (inf,) * 3, token_ms=0.1)
    assert ttft_s(free, 4000, 500) == pytest.approx(0.5)
    shared = replace(free, hosts=(0, 0, 0), cores=(0.5,) * 3)
    assert ttft_s(shared, 4000, 500) == pytest.approx(0.65, rel=1e-3)  # SHARING_TOLERANCE's passes
    assert ttft_s(shared, 1000, 500) == pytest.approx(0.2)
    assert ttft_s(replace(shared, hosts=(0, 1, 2)), 4000, 500) == pytest.approx(0.5)


def test_a_newcomers_intake_rides_its_prefills_pipeline():
    """2,000 tokens in chunks of 500; rank 0 5 ms a chunk, the drafter 1 + 25 ms to take one in (101 ms in all in one
    call). Behind a later rank of 100 ms a chunk, rank 0 takes each chunk in while rank 1 works on it: the TTFT (405
    ms) is the same with the intake; behind one of 5 ms a chunk, rank 0 sends every chunk after the last one's
    intake and takes the first round's in the wait: 98 + 26 ms where 25 without."""
    p = Pipeline((RankCost(0.0, 0.01), RankCost(0.0, 0.2)), (LinkCost(), LinkCost()), DraftCost(1.0, token_ms=0.05))
    slow_later = Predictor(p, chunk=500)
    assert slow_later.intake_ms(2000) == pytest.approx(101.0)
    assert slow_later.ttft_s(2000) == pytest.approx(0.405)
    assert slow_later.admission_intake_ms(2000) == pytest.approx(0.0, abs=1e-9)
    fast_later = Predictor(replace(p, ranks=(RankCost(0.0, 0.01), RankCost(0.0, 0.01))), chunk=500)
    assert fast_later.admission_intake_ms(2000) == pytest.approx(124.0 - 25.0)
    # four such prompts admitted together: rank 0 takes in every one before any first round goes; behind the fast
    # later rank each intake delays them all: 12 chunks x (5 + 26) + 4 x 5 + 4 x 26 in the wait = 496 ms, where the
    # 16 chunks without take 80 and the last reply 5 more. Behind the slow one (1,600 ms of chunks) it still hides.
    assert fast_later.admission_intake_ms(2000, burst=(2000,) * 3) == pytest.approx(496.0 - 85.0)
    assert slow_later.admission_intake_ms(2000, burst=(2000,) * 3) == pytest.approx(0.0, abs=1e-9)


def test_a_prediction_beside_a_round_is_at_the_batches_it_ran_in():
    """Two ranks of 10 ms a batch and 2 ms a row, free links, K=0, four streams: in two batches of two rows a cycle
    is 2 x 14 = 28 ms (142.9 tokens/s, the model's best count), in one batch of four the ranks take turns, 2 x 18 =
    36 ms (111.1). A round that went out in one batch of four (BatchCount's choice) is predicted at that, 111.1 / 4
    a stream, not at the best count's rate; so is a request of such rounds; rounds with no batch recorded, or
    alone, at the best count."""
    p = Pipeline((RankCost(10.0, row_ms=2.0),) * 2, (LinkCost(), LinkCost()), acceptance=Acceptance(prior=1.0))
    assert best_batches(p, 0, 4) == 2
    one_batch, two_batches = 1000 * 4 / 36 / 4, 1000 * 4 / 28 / 4
    assert Predictor(p).tokens_per_s(0, streams=4, batches=1) == pytest.approx(one_batch)
    assert Predictor(p).tokens_per_s(0, streams=4) == pytest.approx(two_batches)

    def rounds(**ran):
        return [SimpleNamespace(drafted=0, accepted=0, committed=1, bet=None, in_flight=1, from_ahead=False,
                                prepared=0, **ran) for _ in range(3)]
    assert Predictor(p).for_rounds(rounds(live=4, batch=4), streams=4) == pytest.approx(one_batch)
    assert Predictor(p).for_rounds(rounds(live=4, batch=2), streams=4) == pytest.approx(two_batches)
    assert Predictor(p).for_rounds(rounds(), streams=4) == pytest.approx(two_batches)
    assert batches_run(SimpleNamespace(live=3, batch=2)) == 2 and batches_run(SimpleNamespace(live=1, batch=1)) is None
    import time
    from speculative.session import Session
    session = SimpleNamespace(predictor=Predictor(p), scheduler=SimpleNamespace(depth=lambda: 1))
    s = SimpleNamespace(gen=SimpleNamespace(prompt_ids=[1] * 40, ttft_s=0.0), output=SimpleNamespace(tokens=[1] * 10),
                        t_start=time.perf_counter())
    record = SimpleNamespace(drafted=0, accepted=0, bet=None, live=4, batch=4, from_ahead=False, looked_up=False,
                             prepared=0, draft_ms=0.0, stage0_ms=18.0, middle_ms=[], last_ms=18.0, on_the_way=4,
                             alone=True, ahead_ms=0.0, network_ms=0.0, busy_ms=None)
    Session.predict(session, s, record, decode=True)  # the rate beside the round
    assert record.predicted_tokens_per_s == pytest.approx(one_batch)


def test_a_paced_pipeline_prices_decode_blocks_at_their_pace_and_prompt_chunks_as_timed():
    """Rank 1 at twice its timed cost, the drafter at 1.5x: a round of K=4 prepares in 4 x 2 x 1.5 + 10 ms and
    crosses in 2 x 20 + 2 x 5; a prompt chunk timed alone (prefill_by_tokens) costs what it was timed at."""
    p = ring((10.0, 20.0), (5.0, 5.0), step=2.0)
    fast = paced(p, Pace(1.5, (1.0, 2.0)))
    parts = round_parts(fast, 4)
    assert parts.prep_ms == pytest.approx(4 * 2.0 * 1.5 + 10.0) and parts.trip_ms == pytest.approx(40.0 + 10.0)
    assert paced(p, Pace()) == p
    timed = RankCost(10.0, 0.1, 1.0, context_ms=0.001, prefill_by_tokens={64: 30.0, 128: 50.0})
    (doubled,) = paced(replace(p, ranks=(timed,)), Pace(1.0, (2.0,), engine=2.0)).ranks
    assert doubled.ms(2, 5, 1000) == pytest.approx(2 * timed.ms(2, 5, 1000))
    assert doubled.chunk_ms(128, 0) == pytest.approx(timed.chunk_ms(128, 0))


def paced_records(predictor: Predictor, n: int, last: float, draft: float, stage0: float = 1.0, k: int = 4,
                  rows: int = 1, wire_ms: float = 0.0, **fields) -> list:
    """n decode rounds of K drafts, every draft kept, whose ranks timed the last rank's part at `last` x what the
    predictor charges, the drafter's at `draft` x, rank 0's forward (its charge less its committing) at `stage0` x,
    and whose trip took `wire_ms` more than the links' charge (sent into an empty ring unless `alone` is given)."""
    from speculative.rounds import RoundRecord
    records, fields = [], {"alone": True, **fields}
    for _ in range(n):
        charged = predictor.parts_ms(k, rows)
        forward = charged.stage0_ms - ENGINE_RANK0_MS - (rows - 1) * ENGINE_RANK0_ROW_MS
        trip = last * charged.last_ms + charged.wire_ms + wire_ms + fields.get("ahead_ms", 0.0)
        r = RoundRecord(k, k, k + 1, draft * charged.draft_ms, stage0 * forward, trip, last * charged.last_ms,
                        batch=rows, **fields)
        r.predicted_parts = charged
        predictor.observe(k, k)
        predictor.observe_parts(r)
        records.append(r)
    return records


def test_the_pace_is_each_parts_measured_over_its_charge_leaning_on_the_start_up_timing():
    """20 rounds in which the last rank took twice its charge, the drafter 1.5x, rank 0's forward its charge: each
    pace (20 x measured + 4 rounds as charged) / 24 rounds' charge; the prediction at that pace, and `timed` at the
    start-up costs. Rounds prepared in an earlier wait (from_ahead) and looked-up drafts tell nothing of drafting."""
    p = ring((10.0, 20.0), (5.0, 5.0), step=2.0, rate=1.0)
    predictor = Predictor(p, pace_decay=1.0)
    paced_records(predictor, 20, last=2.0, draft=1.5, rows=2)
    pace = predictor.pace()
    assert pace.ranks == pytest.approx((1.0, (20 * 2.0 + 4) / 24)) and pace.draft == pytest.approx((20 * 1.5 + 4) / 24)
    assert predictor.tokens_per_s(4) == pytest.approx(stream_tokens_per_s(paced(predictor.pipeline(True), pace), 4))
    assert predictor.tokens_per_s(4) < 0.75 * predictor.tokens_per_s(4, timed=True)
    assert predictor.parts_ms(4) == Predictor(p).parts_ms(4)  # the parts logged beside the rounds: as timed
    ahead = Predictor(p, pace_decay=1.0)
    paced_records(ahead, 20, last=1.0, draft=0.1, stage0=0.1, from_ahead=True)
    paced_records(ahead, 20, last=1.0, draft=0.1, stage0=0.5, looked_up=True)  # (its forward still timed)
    assert ahead.pace().draft == 1.0 and ahead.pace().ranks[0] == pytest.approx((20 * 0.5 + 4) / 24)
    # spec.overlap: every round prepared in the wait of the one before, its drafting and stage 0 timed there
    # (ahead_ms) at 1.5x their charge, the round's own draft_ms and stage0_ms empty
    chain = Predictor(p, pace_decay=1.0)
    charged = chain.parts_ms(4)
    both = charged.draft_ms + charged.stage0_ms - ENGINE_RANK0_MS
    paced_records(chain, 20, last=1.0, draft=0.0, stage0=0.0, from_ahead=True, prepared=1, ahead_ms=1.5 * both)
    assert chain.pace().draft == pytest.approx(chain.pace().ranks[0]) == pytest.approx((20 * 1.5 + 4) / 24)


def test_rank_0s_engine_work_is_a_part_of_its_own():
    """Rank 0's work between two replies (busy_ms) less the drafting, the forward and the send in it is its engine
    work (committing, answering): 20 rounds at 3x ENGINE_RANK0_MS read a pace of (20 x 3 + 4) / 24, and so does a
    chain whose every block was prepared in the wait before (ahead_ms, not its own draft_ms and stage0_ms); rounds
    with no busy_ms (after an admission) tell nothing. Priced: rank 0's block costs its engine work at that pace, a
    row more ENGINE_RANK0_ROW_MS at it, its forward at its own."""
    p = ring((10.0, 20.0), (5.0, 5.0), step=2.0, rate=1.0)
    predictor = Predictor(p, pace_decay=1.0)
    charged = predictor.parts_ms(4)
    prepared = charged.draft_ms + charged.stage0_ms - ENGINE_RANK0_MS
    paced_records(predictor, 20, last=1.0, draft=1.0, send_ms=0.5, busy_ms=prepared + 0.5 + 3 * ENGINE_RANK0_MS)
    engine = (20 * 3 + 4) / 24
    assert predictor.pace().engine == pytest.approx(engine) and predictor.pace().ranks[0] == pytest.approx(1.0)
    chain = Predictor(p, pace_decay=1.0)
    paced_records(chain, 20, last=1.0, draft=0.0, stage0=0.0, from_ahead=True, prepared=1, ahead_ms=prepared,
                  busy_ms=prepared + 3 * ENGINE_RANK0_MS)
    assert chain.pace().engine == pytest.approx(engine)
    unknown = Predictor(p, pace_decay=1.0)
    paced_records(unknown, 20, last=1.0, draft=1.0)
    assert unknown.pace().engine == 1.0
    timed = replace(p, ranks=(RankCost(10.0, 0.1, 1.0, by_tokens={5: 12.0}), p.ranks[1]))  # (as from_rank_costs)
    slow = paced(timed, Pace(ranks=(2.0, 1.0), engine=3.0))
    # its charge holds ENGINE_RANK0_MS (and a row more ENGINE_RANK0_ROW_MS): at 2x with the rest, 3x on its own
    assert slow.ranks[0].ms(1, 5) == pytest.approx(2 * 12.0 + ENGINE_RANK0_MS)
    assert slow.ranks[0].ms(3, 5) - slow.ranks[0].ms(1, 5) == pytest.approx(
        2 * 2 * (1.0 + 0.1 * 5) + 2 * ENGINE_RANK0_ROW_MS)
    assert predictor.tokens_per_s(4) < predictor.tokens_per_s(4, timed=True)


def test_a_lone_rounds_wire_beyond_the_links_charge_is_added_to_its_trip():
    """20 lone rounds whose trip took 2 ms more than the links' latency charged (a round's frames cost their ends
    more than the probe's ping): the trip is priced (20 x 2) / (20 + 4) ms longer, spread over the links. Rounds
    with others on the way, with rank 0 preparing a block in their wait, or sent behind a prompt's chunks (or
    beside a first round) tell nothing of the wire."""
    p = ring((10.0, 20.0), (5.0, 5.0), step=2.0, rate=1.0)
    lone = Predictor(p, pace_decay=1.0)
    paced_records(lone, 20, last=1.0, draft=1.0, wire_ms=2.0)
    extra = 20 * 2.0 / 24
    assert lone.pace().wire_ms == pytest.approx(extra)
    assert round_parts(lone.pipeline(), 4).trip_ms == pytest.approx(round_parts(p, 4).trip_ms + extra)
    assert [link.one_way_ms for link in lone.pipeline().links] == pytest.approx([5.0 + extra / 2] * 2)
    crowded = Predictor(p, pace_decay=1.0)
    queued = paced_records(crowded, 20, last=1.0, draft=1.0, wire_ms=2.0, on_the_way=3, rows=2)
    paced_records(crowded, 20, last=1.0, draft=1.0, wire_ms=2.0, ahead_ms=9.0, prepared=1)
    paced_records(crowded, 20, last=1.0, draft=1.0, wire_ms=2.0, alone=False)  # behind a prompt's chunks
    assert crowded.pace().wire_ms == 0.0
    together = Predictor(p, pace_decay=1.0)
    paced_records(together, 20, last=1.0, draft=1.0, wire_ms=2.0, on_the_way=2, rows=2)  # one batch of two alone
    assert together.pace().wire_ms == pytest.approx(extra)
    # a request none of whose rounds went alone: the wire as the server measured it
    assert lone.for_rounds(queued, streams=3) < Predictor(p).for_rounds(queued, streams=3)


def test_a_servers_pace_follows_the_host_and_a_requests_is_its_own_rounds():
    """A server's rounds at twice the last rank's charge for 200 rounds, then at its charge: 100 rounds later its
    pace is back near 1 (each round's weight shrinks 2% a round). A request's prediction is at its own rounds' pace,
    whatever the server's history, and `timed` at the start-up costs."""
    p = ring((10.0, 20.0), (5.0, 5.0), step=2.0, rate=1.0)
    server = Predictor(p)
    paced_records(server, 200, last=2.0, draft=1.0)
    assert server.pace().ranks[1] > 1.9
    paced_records(server, 100, last=1.0, draft=1.0)
    assert server.pace().ranks[1] < 1.2
    slow = paced_records(Predictor(p), 30, last=2.0, draft=1.0)
    assert server.for_rounds(slow) == pytest.approx(Predictor(p).for_rounds(slow))
    assert server.for_rounds(slow) == pytest.approx(1000 * 5 / (18.0 + (30 * 2 + 4) / 34 * 20.0 + 10.0), rel=0.02)
    assert server.for_rounds(slow, timed=True) == pytest.approx(1000 * 5 / (18.0 + 20.0 + 10.0), rel=0.02)
