"""Several requests at once through one Session (serve.max_concurrent), in process: each in its own KV slot on
every rank, their rounds batched through the pipe. Lossless like every other path: every request's greedy tokens
are transformers generate's for its own prompt, whoever else is being served; a seeded sampled request draws the
same tokens alone and among others; a request that goes away frees its slot without touching the others."""
from __future__ import annotations

import pytest

from netbridge.protocol import SamplingParams
from speculative.k_choice import AdaptiveK, FixedK
from speculative.rounds import RoundRecord
from speculative.cost_model import DraftCost, LinkCost, Pipeline, RankCost
from speculative.scheduler import TRIP_WINDOW, BatchCount, Scheduler
from speculative.output import Output
from tests.support.session_harness import serve, serve_together, session_args, with_ranks
from tests.support.tiny_models import reference_greedy

BASE = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7, 61, 19]
# 8 prompts of different lengths and contents, and different answer lengths
PROMPTS = [BASE[:3 + i] + [100 + i] for i in range(8)]
LENGTHS = [23, 9, 31, 14, 5, 27, 18, 11]


def requests(request=SamplingParams()):
    return [(p, request, n) for p, n in zip(PROMPTS, LENGTHS)]


@pytest.mark.parametrize("ranks,batches", [(2, None), (3, None), (2, 2), (3, 3)])
def test_eight_requests_at_once_each_give_generate_s_tokens(ranks, batches, tiny_qwen, tiny_qwen_draft):
    """`batches`: several batches taking turns through the pipe, or as many as the costs say (here: one)."""
    gens, session = serve_together(session_args(tiny_qwen, tiny_qwen_draft, max_new=40), requests(), ranks=ranks,
                                   batches=batches)
    for prompt, n, gen in zip(PROMPTS, LENGTHS, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n), (prompt, n)
    shared = [r.batch for g in gens for r in g.rounds]
    assert max(shared) >= 3 and max(r.live for g in gens for r in g.rounds) == 8  # they really shared the pipe
    assert len({s for g in gens for s in {r.slot for r in g.rounds}}) == 8  # each in a slot of its own
    assert session.free() == 8


def test_more_requests_than_slots_wait_for_one(tiny_qwen, tiny_qwen_draft):
    gens, _ = serve_together(session_args(tiny_qwen, tiny_qwen_draft, max_new=40), requests(), slots=3)
    for prompt, n, gen in zip(PROMPTS, LENGTHS, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n)
    assert max(r.live for g in gens for r in g.rounds) == 3


def test_a_cancelled_request_leaves_the_others_identical(tiny_qwen, tiny_qwen_draft):
    """Request 2 goes away mid-stream, with its next round on the way: its slot is freed at once (request 8,
    waiting, takes it) and that round's reply is thrown away; every other request is generate's."""
    reqs = requests() + [([9, 8, 7, 6, 5], SamplingParams(), 12)]
    gens, session = serve_together(session_args(tiny_qwen, tiny_qwen_draft, max_new=40), reqs, slots=8,
                                   cancel_after={2: 30}, batches=2)  # two batches: one on the way at each tick
    assert 0 < len(gens[2].output.tokens) < LENGTHS[2]
    assert sum(r.wasted_ms for g in gens for r in g.rounds) > 0  # a reply to its round came after it ended
    for i, ((prompt, _, n), gen) in enumerate(zip(reqs, gens)):
        if i != 2:
            assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n), i
    assert gens[8].rounds[0].slot == gens[2].rounds[0].slot  # the freed slot went to the one waiting


def test_a_seeded_sampled_request_draws_the_same_tokens_alone_and_among_others(tiny_qwen, tiny_qwen_draft):
    """Every request keeps its own generators (the drafter's noise and the verifier's draws, seeded by its seed
    and the position decided), so what the others do never shifts its draws."""
    args = session_args(tiny_qwen, tiny_qwen_draft, max_new=40)
    sampled = [(p, SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i)) for i, p in enumerate(PROMPTS[:3])]
    alone = serve(args, sampled)  # one after another, each alone in the pipe
    mixed = [sampled[0], (PROMPTS[5], SamplingParams(), 20), sampled[1], (PROMPTS[6], SamplingParams(temperature=1.3, seed=9), 20),
             sampled[2]]
    together, _ = serve_together(args, mixed)
    for a, b in zip(alone, [together[0], together[2], together[4]]):
        assert b.output.tokens == a.output.tokens and len(a.output.tokens) == 40
    assert max(r.batch for r in together[0].rounds) > 1
    assert together[1].output.tokens == reference_greedy(tiny_qwen, PROMPTS[5], 20)


def test_the_next_turn_lands_in_the_slot_holding_its_prefix(tiny_qwen, tiny_qwen_draft):
    """Two conversations, then each one's next turn (its prompt + answer + more): each goes to the free slot whose
    caches hold its prefix, which is reused, not prefilled again; the answers are still generate's."""
    args = session_args(tiny_qwen, tiny_qwen_draft, max_new=10)
    first, _ = serve_together(args, [(PROMPTS[7], SamplingParams()), (PROMPTS[3], SamplingParams())], slots=4)

    def next_turn(gen):
        return gen.prompt_ids + gen.output.tokens + [77, 78]
    turns = [(PROMPTS[7], SamplingParams()), (PROMPTS[3], SamplingParams()), (PROMPTS[0], SamplingParams()),
             (next_turn(first[1]), SamplingParams()), (next_turn(first[0]), SamplingParams())]

    def in_two_waves(session, cfg, eos):  # turns 3 and 4 come once the first three have ended: every slot is free
        gens = []
        for wave in (turns[:3], turns[3:]):
            streams = [session.admit(ids, Output(None, eos, 10, [], stream=False), params) for ids, params in wave]
            while session.live:
                session.tick()
            gens += [s.gen for s in streams]
        return gens
    both = with_ranks(["serve.port=0", "serve.max_concurrent=3", *args], 2, in_two_waves)
    for (prompt, _), gen in zip(turns, both):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, 10)
    slot_of = {i: g.rounds[0].slot for i, g in enumerate(both)}
    assert slot_of[3] == slot_of[1] and slot_of[4] == slot_of[0]
    assert both[3].reused == len(turns[3][0]) - 3 and both[4].reused == len(turns[4][0]) - 3  # all but the new turn


@pytest.mark.parametrize("ranks", [2, 3])
def test_prompts_sharing_a_prefix_a_live_slot_holds_copy_it_instead_of_prefilling_it(ranks, tiny_qwen,
                                                                                       tiny_qwen_draft):
    """A request leaves its slot holding a long shared prefix (a system prompt); three prompts beginning with it
    arrive together: the first takes that slot, and the other two free slots hold none of it, so every rank (and
    the drafter) copies it from the first one's slot. Only the rest is prefilled, and the answers are generate's."""
    prefix = BASE + BASE[::-1]
    first = prefix + [120]
    wave = [prefix + [121], prefix + [122, 123], prefix + [124]]
    args = session_args(tiny_qwen, tiny_qwen_draft, max_new=12)

    def two_waves(session, cfg, eos):
        gens = []
        for prompts in ([first], wave):
            streams = [session.admit(ids, Output(None, eos, 12, [], stream=False)) for ids in prompts]
            while session.live:
                session.tick()
            gens += [s.gen for s in streams]
        return gens
    gens = with_ranks(["serve.port=0", "serve.max_concurrent=3", *args], ranks, two_waves)
    for prompt, gen in zip([first, *wave], gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, 12), prompt
    assert [g.reused for g in gens] == [0, len(prefix), len(prefix), len(prefix)]
    assert len({g.rounds[0].slot for g in gens[1:]}) == 3


@pytest.mark.parametrize("ranks", [2, 3])
def test_eight_requests_at_once_through_the_relay(ranks, tiny_qwen, tiny_qwen_draft, tmp_path):
    """The same over a real relay (loopback), end-to-end sealed, every ring link its own session."""
    from tests.support.relay_harness import relay_process, relay_ring
    with relay_process(tmp_path, "--no-store") as relay:
        gens, _ = serve_together(session_args(tiny_qwen, tiny_qwen_draft, max_new=40), requests(), ranks=ranks,
                                 links=relay_ring(relay, ranks))
    for prompt, n, gen in zip(PROMPTS, LENGTHS, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n), (prompt, n)
    assert max(r.batch for g in gens for r in g.rounds) >= 4


def test_a_batch_crosses_every_link_as_one_frame(tiny_qwen, tiny_qwen_draft):
    """Three ranks, eight requests in one batch: every frame that carries Rounds (rank 0 -> 1, 1 -> 2) or Replies
    (2 -> 0) carries a whole batch, each Round saying the batch it is part of; outputs stay generate's."""
    from netbridge.channel import BUNDLE, local_ring, unbundle
    from netbridge.frames import decode
    links = local_ring(3, 30.0)
    frames = {r: [] for r in range(3)}
    for r, (_, to_next) in enumerate(links):
        to_next.send_frame = (lambda frame, r=r, send=to_next.send_frame: (frames[r].append(decode(frame)), send(frame)))
    gens, _ = serve_together(session_args(tiny_qwen, tiny_qwen_draft, max_new=40), requests(), ranks=3,
                             links=links, batches=1)
    for prompt, n, gen in zip(PROMPTS, LENGTHS, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n), (prompt, n)
    for r, kind in ((0, "round"), (1, "round"), (2, "reply")):
        batches = [unbundle(f) for f in frames[r] if f.kind in (kind, BUNDLE)]
        assert max(len(b) for b in batches) >= 4, r
        assert all(m.kind == kind for b in batches for m in b), r
        if kind == "round":
            assert all(m.meta.get("batch", 1) == len(b) for b in batches for m in b), r


def test_the_warm_up_runs_a_chunk_through_every_rank_and_the_drafter_and_is_forgotten(tiny_qwen, tiny_qwen_draft):
    """Session.warm_up (a server's engine runs it first): one prefill chunk of placeholder tokens crosses every link
    as a Prefill into slot 0 and through the drafter, which then holds nothing there; requests after it, the first
    in slot 0, are generate's."""
    from netbridge.channel import local_ring
    from netbridge.frames import decode
    links = local_ring(3, 30.0)
    frames = {r: [] for r in range(3)}
    for r, (_, to_next) in enumerate(links):
        to_next.send_frame = (lambda frame, r=r, send=to_next.send_frame: (frames[r].append(decode(frame)), send(frame)))
    prompts = [PROMPTS[0], PROMPTS[1]]

    def warmed(session, cfg, eos):
        session.warm_up()
        lacks = session.drafter.lacks(cfg.model.prefill_chunk, 0)
        streams = [session.admit(ids, Output(None, eos, 12, [], stream=False)) for ids in prompts]
        while session.live:
            session.tick()
        return lacks, [s.gen for s in streams]
    lacks, gens = with_ranks(["serve.port=0", "serve.max_concurrent=2", "model.prefill_chunk=48",
                              *session_args(tiny_qwen, tiny_qwen_draft, max_new=12)], 3, warmed, links)
    assert lacks == 48  # the drafter forgot the chunk
    assert gens[0].rounds[0].slot == 0
    for prompt, gen in zip(prompts, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, 12), prompt
    for r in (0, 1):  # rank 0 -> 1, and 1 -> 2: the warm-up's chunk before any request, and no other
        serving = [f for f in frames[r] if f.kind not in ("hellos", "bye") and not f.kind.startswith("probe")]
        first = serving[0]
        assert first.kind == "prefill" and first.meta["start"] == 0 and first.meta["slot"] == 0, (r, first.kind)
        assert first.tensors["hidden"].shape[1] == 48 and [f.kind for f in serving].count("prefill") == 1, r


def test_streams_take_turns(tiny_qwen, tiny_qwen_draft):
    """Round-robin: while two streams are live, neither gets a second round before the other has had its next,
    so a long answer cannot starve a short one (four streams, answers from 4 to 40 tokens)."""
    order = []
    reqs = [(PROMPTS[i], SamplingParams(), n) for i, n in enumerate([40, 4, 25, 9])]
    gens, _ = serve_together(session_args(tiny_qwen, tiny_qwen_draft, max_new=40), reqs, batches=2,
                             on_round=lambda record, reply: order.append(record.slot))
    ends = {g.rounds[0].slot: len(g.rounds) for g in gens}
    counts = dict.fromkeys(ends, 0)
    for slot in order:
        counts[slot] += 1
        live = [s for s in counts if counts[s] < ends[s] or s == slot]
        assert all(abs(counts[slot] - counts[s]) <= 1 for s in live), (order, counts)
    assert [len(g.output.tokens) for g in gens] == [40, 4, 25, 9]


def record(rank0_ms: float, later_ms: float, trip_ms: float, middle=(), batch: int = 1) -> RoundRecord:
    """A fresh block's round as rank 0 records it: its drafting + stage 0, the later ranks' work, and round_ms."""
    return RoundRecord(4, 3, 4, draft_ms=rank0_ms * 0.9, stage0_ms=rank0_ms * 0.1,
                       round_ms=later_ms + sum(middle) + trip_ms, last_ms=later_ms, middle_ms=list(middle), batch=batch)


@pytest.mark.parametrize("rank0,later,trip,middle,expected", [
    (630, 190, 80, (), 1),  # this CPU: the drafter on rank 0 dominates, a second batch would double its work
    (30, 20, 90, (), 4),  # fast GPUs over a WAN: four batches fill the round trip
    (30, 20, 90, (25, 25), 6),  # three ranks: the slowest stage sets the pace, the longer cycle holds more
    (10, 40, 90, (), 3),  # the last rank slowest: its work per batch sets the pace, not rank 0's
    (30, 20, 1000, (), 8),  # at most 8
])
def test_the_batch_count_from_costs(rank0, later, trip, middle, expected):
    count = BatchCount()
    assert count.now() == 1  # nothing measured yet: one batch
    for _ in range(20):
        count.observe(record(rank0, later, trip, middle), waited_ms=5.0)
    assert count.now() == expected


def test_the_batch_count_weighs_a_batch_s_cost_by_its_rows():
    """Rank 0 630 ms and rank 1 500 ms over 8 rows, 330 and 300 over 4 (a quantized drafter on a CPU: the rows
    cost compute), 80 ms of wire: two batches of 4 cycle in max(2 x 330, 330 + 300 + 80) = 710 ms against one
    batch's 630 + 500 + 80 = 1210. With only 8-row batches seen, a batch costs the same at any size: one."""
    count = BatchCount()
    for _ in range(20):
        count.observe(record(630, 500, 80, batch=8), waited_ms=5.0)
    assert count.now(8) == 1
    for _ in range(20):
        count.observe(record(330, 300, 80, batch=4), waited_ms=5.0)
    assert count.now(8) == 2


def test_the_batch_count_takes_a_rows_cost_from_the_start_up_model_while_one_size_is_measured():
    """Only 8-row batches seen, rank 0 630 ms and rank 1 500, 80 ms of wire: flat, one batch (1210 ms). The start-up
    model says a row more costs rank 0 40 ms (4 draft steps, 10 ms a row each) and rank 1 25 (5 ms a row-token over
    a block of 5): a 4-row batch 630 - 4 x 40 = 470 and 500 - 4 x 25 = 400, two cycle in max(2 x 470, 470 + 400 + 80)
    = 950 ms: two. Once two sizes are measured, they decide."""
    prior = Pipeline((RankCost(0.0), RankCost(100.0, token_ms=5.0)), (LinkCost(40.0), LinkCost(40.0)),
                     DraftCost(20.0, row_ms=10.0))
    count = BatchCount(prior=prior)
    for _ in range(20):
        count.observe(record(630, 500, 80, batch=8), waited_ms=5.0)
    assert count.now(8) == 2
    for _ in range(20):
        count.observe(record(625, 495, 80, batch=4), waited_ms=5.0)  # measured: a row costs ~nothing
    assert count.now(8) == 1
    other_ring = Pipeline((RankCost(0.0),) * 3, (LinkCost(),) * 3, DraftCost(20.0, row_ms=10.0))
    flat = BatchCount(prior=other_ring)  # a prior of another ring says nothing
    for _ in range(20):
        flat.observe(record(630, 500, 80, batch=8), waited_ms=5.0)
    assert flat.now(8) == 1


def test_the_batch_count_compares_batch_sizes_at_one_k():
    """Four-row batches at K=3 (rank 0 400 ms with its drafting, rank 1 420 over blocks of 4 tokens), then two-row
    batches at K=0 (15 and 190): at K=0 a batch costs 190 at any size measured so far, so one batch of four cycles in
    15 + 190 + 20 = 225 ms and more batches only lengthen it. Read beside the K=3 batches, a row would cost rank 1
    115 ms and rank 0 193, and four batches of one row would be taken."""
    count = BatchCount()
    for _ in range(20):
        count.observe(RoundRecord(3, 1, 2, draft_ms=360.0, stage0_ms=40.0, round_ms=425.0, last_ms=420.0, batch=4),
                      waited_ms=5.0)
    for _ in range(20):
        count.observe(RoundRecord(0, 0, 1, draft_ms=0.0, stage0_ms=15.0, round_ms=210.0, last_ms=190.0, batch=2),
                      waited_ms=5.0)
    assert count.now(4) == 1


def test_the_batch_count_files_a_batch_under_its_widest_k():
    """Four-row batches at K=3 (rank 0 400 ms, rank 1 420), then two-row ones whose first row is a newcomer drafting
    nothing beside a row at K=3 (rank 0 335, rank 1 400: every row pays the K=3 row's steps and block), 20 ms of
    wire. Filed at K=3 beside the four-row ones: two batches of two cycle in max(2 x 400, 335 + 400 + 20) = 800 ms,
    one of four in 400 + 420 + 20 = 840: two. Filed under the newcomer's K=0, the two-row costs would stand alone, a
    row costing nothing, and one batch of four (755 ms) would be taken."""
    count = BatchCount()
    for _ in range(20):
        count.observe(RoundRecord(3, 3, 4, draft_ms=360.0, stage0_ms=40.0, round_ms=440.0, last_ms=420.0, batch=4),
                      waited_ms=5.0, k=3)
    for _ in range(20):
        count.observe(RoundRecord(0, 0, 1, draft_ms=300.0, stage0_ms=35.0, round_ms=420.0, last_ms=400.0, batch=2),
                      waited_ms=5.0, k=3)
    assert count.now(4) == 2


def test_the_batch_count_charges_more_batches_what_ranks_sharing_cores_cost_each_other():
    """Rank 0 30 ms a batch, rank 1 20, 40 ms of wire: three batches cycle in max(3 x 30, 30 + 20 + 40) = 90 ms,
    what one takes, so three. Where the start-up timing read each rank twice as slow with the other at work (one
    host's cores), a full pipe slows each by the other's work: rank 0 30 + 20 = 50 ms a batch, and two batches
    already take max(2 x 50, 90) = 100 ms: one."""
    alone, shared = BatchCount(), BatchCount(prior=Pipeline((RankCost(0.0),) * 2, (LinkCost(),) * 2,
                                                            together=(2.0, 2.0)))
    for _ in range(20):
        for count in (alone, shared):
            count.observe(record(30, 20, 40), waited_ms=5.0)
    assert (alone.now(8), shared.now(8)) == (3, 1)


def test_the_batch_count_reads_the_trip_only_from_replies_rank_0_waited_for():
    """A reply read late (rank 0 busy drafting another batch) holds rank 0's work in its round_ms: counted as trip,
    it would make more batches look free, which makes rank 0 busier, which lengthens the trip seen: a runaway."""
    count = BatchCount()
    for _ in range(20):
        count.observe(record(630, 190, 80), waited_ms=5.0)
    for _ in range(50):
        count.observe(record(630, 190, 80 + 630), waited_ms=0.0)  # replies already there when rank 0 came
    assert count.now() == 1
    assert BatchCount(given=3).now() == 3


def test_the_batch_count_reads_the_trip_only_from_rounds_sent_into_an_empty_pipe():
    """A round sent behind another batch waits at rank 1 while it works on that one: read as trip, that wait (here
    800 ms) makes more batches look free (2 instead of 1), which makes the waits longer still."""
    count = BatchCount()
    for _ in range(20):
        count.observe(record(630, 190, 80), waited_ms=5.0)
    for _ in range(50):
        count.observe(record(630, 190, 80 + 800), waited_ms=5.0, alone=False)
    assert count.now() == 1


def test_the_batch_count_lowers_a_trip_read_high_by_rounds_sent_into_a_full_pipe():
    """Rank 0 30 ms a batch, rank 1 20: over a trip read at 1,000 ms (a slow spell) eight batches fill it. Then
    eight batches are on the way and no round goes into an empty pipe: rounds behind other batches read 90 ms of
    trip, which the trip cannot exceed (a wait behind another batch only adds), so it is 90 ms now: four batches."""
    count = BatchCount()
    for _ in range(20):
        count.observe(record(30, 20, 1000), waited_ms=5.0)
    assert count.now() == 8
    for _ in range(TRIP_WINDOW):
        count.observe(record(30, 20, 90), waited_ms=5.0, alone=False)
    assert count.now() == 4


def test_newcomers_first_rounds_go_out_together_and_their_prompts_reach_the_drafter_in_the_wait(tiny_qwen,
                                                                                               tiny_qwen_draft):
    """Requests admitted together: their first rounds run as one batch on every rank (not one after another, each
    newcomer waiting for the others' prefills), and while that batch is on the way the drafter takes in each
    prompt, so their second round drafts at once. The answers stay generate's."""
    reqs = [(p, params, min(n, 12)) for p, params, n in requests()[5:]]  # prompts of 9-11 tokens: one batch

    def body(session, cfg, eos):
        streams = [session.admit(ids, Output(None, eos, n, [], stream=False), params) for ids, params, n in reqs]
        session.tick()  # the first rounds out, and back
        assert [session.drafter.cached[s.slot] for s in streams] == [len(ids) for ids, _, _ in reqs]
        while session.live:
            session.tick()
        return [s.gen for s in streams]
    gens = with_ranks(["serve.port=0", "serve.max_concurrent=8", *session_args(tiny_qwen, tiny_qwen_draft, 40)], 2, body)
    assert [g.rounds[0].batch for g in gens] == [3] * 3
    for (prompt, _, n), gen in zip(reqs, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n), (prompt, n)


def test_a_newcomer_s_first_round_and_the_running_streams_next_round_go_out_together(tiny_qwen, tiny_qwen_draft):
    """Streams decoding in one batch, then a newcomer: its first round goes out and the running streams' next round
    right behind it, not held until its prefill is back (nor held while a first round is on the way), so the later
    ranks prefill while rank 0 drafts. The answers stay generate's."""
    (a, _, _), (b, _, _), (c, _, _), (d, _, _) = requests()[:4]

    def sent(streams):
        return all(s.chain and s.chain[0].sent_at is not None for s in streams)

    def body(session, cfg, eos):
        first = [session.admit(ids, Output(None, eos, 24, [], stream=False)) for ids in (a, b)]
        while not all(len(s.gen.rounds) >= 2 for s in first):
            session.tick()
        newcomer = session.admit(c, Output(None, eos, 8, [], stream=False))
        session.tick()  # the newcomer's first round out, the two streams' round behind it; its reply back
        assert not newcomer.chain and sent(first)
        later = session.admit(d, Output(None, eos, 8, [], stream=False))
        session.tick()  # the later one's first round out; the newcomer waits for the batch on the way, which returns
        assert not any(s.chain for s in (*first, newcomer))
        session.tick()  # the three go out behind the later one's first round still on the way; its reply back
        assert sent([*first, newcomer]) and not later.chain
        while session.live:
            session.tick()
        return [s.gen for s in (*first, newcomer, later)]
    gens = with_ranks(["serve.port=0", "serve.max_concurrent=4", *session_args(tiny_qwen, tiny_qwen_draft, 24)], 2, body,
                      batches=1)
    for prompt, n, gen in zip((a, b, c, d), (24, 24, 8, 8), gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n)


def test_streams_admitted_at_k0_each_weigh_the_prompts_the_others_drafters_lack(tiny_qwen, tiny_qwen_draft):
    """Three streams admitted at K=0 (their prompts left out of the drafter): after each round the K policy hears,
    beside the stream's own lag, the (lacking, held) of every other live stream whose drafter lacks its prompt
    (KFromCosts weighs every such intake: they all choose alike). The answers stay generate's."""
    reqs = [(p, min(n, 12)) for p, _, n in requests()[5:]]  # prompts of 9-11 tokens, more than a round behind
    heard = []

    class NoDrafts(FixedK):
        def first(self, *args, **kwargs):
            return 0

        def after(self, k_now, record, decode, context=None, lag=0, remaining=None, behind=()):
            heard.append((record.slot, record.live, lag, behind))
            return 0

    def body(session, cfg, eos):
        session.k_policy = session.maker.k_policy = NoDrafts(4)
        streams = [session.admit(ids, Output(None, eos, n, [], stream=False)) for ids, n in reqs]
        while session.live:
            session.tick()
        return [s.gen for s in streams]
    args = ["serve.port=0", "serve.max_concurrent=4", *session_args(tiny_qwen, tiny_qwen_draft, 40)]
    gens = with_ranks(args, 2, body)
    for (prompt, n), gen in zip(reqs, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n)
    three = [h for h in heard if h[1] == 3]
    assert three and all(len(behind) == 2 for _, _, _, behind in three)
    for slot, _, lag, behind in three:  # nothing drafted: each drafter lacks all its stream has committed
        assert lag > len(reqs[slot][0]) and all(held == 0 and lacking > 5 for lacking, held in behind)


class Newcomer:
    prefilling = True

    def __init__(self, pending: int):
        self.pending = [0] * pending


def test_first_rounds_batch_within_the_prefill_chunk_padding_included():
    """Shortest first; a batch of first rounds holds at most spec.prefill_chunk tokens, rows x the longest, and
    rows at least 3/4 as long as the longest (no short prompt padded to a long one)."""
    scheduler = Scheduler(8, prefill_chunk=512)
    batches = scheduler.first_rounds([Newcomer(n) for n in (300, 40, 200, 32, 100, 512, 45, 170, 150, 160)])
    assert [[len(s.pending) for s in b] for b in batches] == [[32, 40], [45], [100], [150, 160, 170], [200], [300],
                                                              [512]]


def test_decode_batches_take_their_streams_by_slot():
    """Four streams ready in the order they came (slots 2, 0, 3, 1), two batches on the way: slots 0-1 and 2-3, so
    each batch's slots are consecutive and every cache reads them as a view (StaticKVCache.span)."""
    from types import SimpleNamespace
    scheduler = Scheduler(4, batches_on_the_way=2)
    ready = [SimpleNamespace(slot=slot, prefilling=False) for slot in (2, 0, 3, 1)]
    scheduler.live = {s.slot: s for s in ready}
    assert [[s.slot for s in batch] for batch in scheduler.batches(ready, 0)] == [[0, 1], [2, 3]]


def test_a_batch_s_greedy_rows_draft_as_many_as_its_widest_k_for_free(tiny_qwen, tiny_qwen_draft):
    """The drafting steps run max(K) times over every row and the later ranks pad every block to the longest, so a
    greedy row whose K shrank after a miss drafts the batch's widest K anyway (never past its answer's end); a
    sampled row keeps its own K (its seeded draws depend on where drafts are). The answers stay generate's."""
    reqs = [(p, SamplingParams(), n) for p, n in zip(PROMPTS[:3], (30, 24, 18))]
    sampled = (PROMPTS[4], SamplingParams(temperature=0.9, seed=3), 20)

    def body(session, cfg, eos):
        fresh, seen = session.maker.fresh, []

        def recording(streams):
            for s in streams:  # the sampled stream's K as after misses, the greedy ones' as the policy has it
                s.k_now = 1 if s.params.temperature > 0 else s.k_now
            blocks = fresh(streams)
            seen.append([(b.k, len(b.drafts), s.params.temperature, s.remaining) for s, b in zip(streams, blocks)])
            return blocks
        session.maker.fresh = recording
        streams = [session.admit(ids, Output(None, eos, n, [], stream=False), params) for ids, params, n in
                   [*reqs, sampled]]
        while session.live:
            session.tick()
        return [s.gen for s in streams], seen
    gens, seen = with_ranks(["serve.port=0", "serve.max_concurrent=4", *session_args(tiny_qwen, tiny_qwen_draft, 30)],
                            2, body, batches=1)
    for (prompt, _, n), gen in zip(reqs, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, n), (prompt, n)
    rows = [(k, drafted, t, left, max(r[1] for r in batch)) for batch in seen for k, drafted, t, left in batch]
    assert any(t == 0 and drafted > k for k, drafted, t, _, _ in rows)  # widened: more than its K asked for
    for k, drafted, t, left, widest in rows:
        assert drafted <= (k if t > 0 else min(widest, left - 1)), rows
        if t == 0 and k > 0 and drafted < widest:
            assert drafted == left - 1  # only where its answer ends
    assert any(t > 0 and k < widest for k, _, t, _, widest in rows)  # a sampled row kept its K in a wider batch


def test_adaptive_k_judges_a_round_by_the_k_it_asked_for():
    """A widened round (drafted 4 at K=2, 3 kept) was a hit at K=2: K grows; at K=4 the same round is a miss. A
    lookup's round (draft.kind=hybrid, past K) is judged by all it proposed, as before."""
    policy = AdaptiveK(4)
    widened = RoundRecord(4, 3, 4, draft_ms=0, stage0_ms=0, round_ms=0, last_ms=0)
    assert policy.after(2, widened, decode=True) == 4
    assert policy.after(4, widened, decode=True) == 3
    looked_up = RoundRecord(16, 5, 6, draft_ms=0, stage0_ms=0, round_ms=0, last_ms=0, looked_up=True)
    assert policy.after(4, looked_up, decode=True) == 3


def test_the_batch_count_weighs_all_rank_0_does_for_a_batch():
    """The tiny model at K=0 on this host: rank 0's forward 1.7 ms, rank 1's 1.7, 1 ms of wire, but rank 0 busy 4 ms
    a batch (committing, sampling, answering, a message per row each way). Counting its forward alone, two batches
    cycle in max(2 x 1.7, 4.4) and look free; counting all it does, max(2 x 4, 6.7) = 8 against one batch's 6.7."""
    forwards, everything = BatchCount(), BatchCount()
    for _ in range(20):
        forwards.observe(record(1.7, 1.7, 1.0), waited_ms=2.0)
        everything.observe(record(1.7, 1.7, 1.0), waited_ms=2.0, busy_ms=4.0)
    assert forwards.now(4) == 2
    assert everything.now(4) == 1


def test_each_round_records_rank_0s_work_since_the_reply_before(tiny_qwen, tiny_qwen_draft):
    """A lone stream's rounds each carry rank 0's work since the reply before (busy_ms: the cost model's engine
    part is it less the drafting, forward and send in it), which holds at least those; none for the first round
    (its admission and prompt are no batch's work)."""
    (gen,) = serve(session_args(tiny_qwen, tiny_qwen_draft) + ["spec.in_flight=1"], [(PROMPTS[7], SamplingParams())])
    first, *decode = gen.rounds
    assert first.busy_ms is None and len(decode) >= 3
    for r in decode:
        timed = r.ahead_ms + r.send_ms + (0.0 if r.from_ahead else r.draft_ms + r.stage0_ms)
        assert r.busy_ms is not None and r.busy_ms >= timed


def test_a_first_round_is_not_alone_in_the_ring(tiny_qwen, tiny_qwen_draft):
    """Two requests admitted together, the second's prompt in chunks: a first round carries its prompt's tail (and
    goes behind its chunks), so none is `alone` (its trip holds that prefill on the later ranks, not the wire);
    later rounds into an empty ring are."""
    gens, _ = serve_together(session_args(tiny_qwen, tiny_qwen_draft) + ["spec.in_flight=1", "model.prefill_chunk=4"],
                             [(PROMPTS[7], SamplingParams(), 12), (PROMPTS[6] * 3, SamplingParams(), 12)])
    assert not any(g.rounds[0].alone for g in gens)
    assert any(r.alone for g in gens for r in g.rounds[1:])
