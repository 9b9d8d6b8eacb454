"""Issue #28: the drafter drafts for several requests (cache slots) in one batched step.

Every row of `ModelDrafter.propose_rows` must draft exactly what its request drafts alone through a one-slot
drafter (fp32; greedy and seeded sampled rows, mixed in one batch, each row at its own length and K), and no
row may write another slot's keys and values. Issue 39: the same slots in a new order move their rows with
them (a batched drafter compared with another batched one would share that bug)."""
import random

import pytest
import torch

from model_parallel.loader import load_stage
from speculative.drafters import ModelDrafter, NgramDrafter
from tests.support.tiny_models import VOCAB

CAPACITY = 160
MAX_K = 8


def drafter(folder, slots: int) -> ModelDrafter:
    stage = load_stage(folder, 0, 2, embed=True, head=True)  # tiny_qwen_draft: 2 layers
    stage.allocate_cache(CAPACITY, torch.float32, setting="draft.max_len", slots=slots)
    return ModelDrafter(stage, max_k=MAX_K, top_k=16)


def same_drafts(batched, alone) -> None:
    assert batched.tokens.tolist() == alone.tokens.tolist()
    assert (batched.q_ids is None) == (alone.q_ids is None)
    if alone.q_ids is not None:
        assert torch.equal(batched.q_ids, alone.q_ids)
        torch.testing.assert_close(batched.q_probs, alone.q_probs, rtol=1e-4, atol=1e-6)


def next_context(rng, context: list[int], drafts, k: int) -> list[int]:
    """What the target would commit after this round: some of the drafts (often all, so the slot lacks dK too),
    then its own token; sometimes a rewind deep into the context."""
    accepted = rng.choice([k, rng.randint(0, k)])
    context = context + drafts.tokens.tolist()[:accepted] + [rng.randrange(VOCAB)]
    if len(context) > CAPACITY - 2 * MAX_K or rng.random() < 0.1:
        context = context[:rng.randint(1, len(context))]
    return context


@pytest.mark.parametrize("temperatures", [(0.0, 0.0, 0.0, 0.0), (0.8, 0.0, 1.3, 0.0)], ids=["greedy", "mixed"])
def test_rows_draft_what_each_request_drafts_alone(temperatures, tiny_qwen_draft):
    """4 requests with different prompts, lengths, temperatures and K per round (0 too), 25 rounds: each row of
    every batch == its request's proposal through a one-slot drafter of its own. Along the way a row may lack one
    token, two (all accepted), most of a context (a deep rewind), or start a fresh prompt (reset mid-way)."""
    rng = random.Random(3)
    batched = drafter(tiny_qwen_draft, slots=4)
    alone = [drafter(tiny_qwen_draft, slots=1) for _ in temperatures]
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 23, 1, 11)]
    slots = [2, 0, 3, 1]  # row b is not slot b
    for b, temperature in enumerate(temperatures):
        batched.reset(0, temperature, seed=10 + b, slot=slots[b])
        alone[b].reset(0, temperature, seed=10 + b)
    for round_ in range(25):
        ks = [rng.choice([0, 1, 3, MAX_K, MAX_K + 1]) for _ in contexts]
        got = batched.propose_rows(contexts, ks, slots)
        for b, context in enumerate(contexts):
            expected = alone[b].propose(context, ks[b])
            same_drafts(got[b], expected)
            assert len(got[b]) == ks[b]
            assert batched.cached[slots[b]] == alone[b].cached[0]
            contexts[b] = next_context(rng, context, got[b], ks[b])
            batched.commit(len(contexts[b]), slot=slots[b])
            alone[b].commit(len(contexts[b]))
        if round_ == 12:  # a new request in row 1's slot: a fresh prompt, nothing reused
            contexts[1] = [rng.randrange(VOCAB) for _ in range(17)]
            batched.reset(0, temperatures[1], seed=99, slot=slots[1])
            alone[1].reset(0, temperatures[1], seed=99)


def test_a_slot_outside_the_batch_is_never_written(tiny_qwen_draft):
    """Slot 3 holds a prompt; 10 rounds of drafting over slots 0-2 leave its keys, values and length as they were,
    and it then drafts what it drafts alone."""
    rng = random.Random(4)
    batched, alone = drafter(tiny_qwen_draft, slots=4), drafter(tiny_qwen_draft, slots=1)
    held = [rng.randrange(VOCAB) for _ in range(30)]
    batched.catch_up(held, slot=3)
    cache = batched.stage.cache
    before = [t[3].clone() for t in (*cache.keys.values(), *cache.values.values())]
    length = int(cache.length[3])
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (40, 2, 9)]
    for _ in range(10):
        ks = [rng.randint(1, MAX_K) for _ in contexts]
        got = batched.propose_rows(contexts, ks, [0, 1, 2])
        for b in range(3):
            contexts[b] = next_context(rng, contexts[b], got[b], ks[b])
            batched.commit(len(contexts[b]), slot=b)
    after = [t[3] for t in (*cache.keys.values(), *cache.values.values())]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert int(cache.length[3]) == length
    context = held + [7]
    same_drafts(batched.propose_rows([context], [4], [3])[0], alone.propose(context, 4))


def test_bad_rows_are_refused_and_stateless_drafters_loop(tiny_qwen_draft):
    with pytest.raises(ValueError, match="slot of its own"):
        drafter(tiny_qwen_draft, slots=2).propose_rows([[1, 2], [3, 4]], [2, 2], [1, 1])
    contexts = [[1, 2, 3, 1, 2], [5, 6, 5]]
    ngram = NgramDrafter()
    got = ngram.propose_rows(contexts, [2, 1], [0, 1])
    assert [d.tokens.tolist() for d in got] == [[3, 1], [6]]


def test_batched_step_has_no_python_position_state(tiny_qwen_draft):
    """What a CUDA graph per batch size needs, checked on CPU: the batched step over static shapes (every position,
    masked, as a captured step runs) compiles as ONE graph that is never recompiled across rounds at other lengths
    and slots (no Python int position or slot baked in), and drafts what the eager drafter does."""
    rng = random.Random(5)
    static, eager = drafter(tiny_qwen_draft, slots=4), drafter(tiny_qwen_draft, slots=4)
    static.step.static_shapes = True
    static.step._step = torch.compile(static.step._step, fullgraph=True, backend="eager")
    temperatures = [0.8, 0.0, 1.1, 0.5]  # any three slots include a sampled one: one variant throughout
    for d in (static, eager):
        for slot, temperature in enumerate(temperatures):
            d.reset(0, temperature, seed=slot, slot=slot)
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 30, 12, 7)]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(12):
            slots = rng.sample(range(4), 3)
            ks = [rng.randint(1, MAX_K) for _ in slots]
            batch = [contexts[s] for s in slots]
            expected = eager.propose_rows(batch, ks, slots)
            for got, want in zip(static.propose_rows(batch, ks, slots), expected):
                same_drafts(got, want)
            for slot, k, drafts in zip(slots, ks, expected):
                contexts[slot] = next_context(rng, contexts[slot], drafts, k)
                static.commit(len(contexts[slot]), slot=slot)
                eager.commit(len(contexts[slot]), slot=slot)


def test_the_same_slots_in_a_new_order_draft_from_their_own_rows(tiny_qwen_draft):
    """Issue 39 (10): a batch of the same size over the same slots in another order ([0, 1], then [1, 0], then
    [0, 1] again) must move its rows with them. Each slot holds its own prompt, so its drafts differ from the
    other's; every row == what its request drafts through a one-slot drafter of its own (nothing batched).
    One sampled slot and one greedy: the greedy variant reads the same rows buffer."""
    temperatures = (0.9, 0.0)
    rng = random.Random(6)
    batched = drafter(tiny_qwen_draft, slots=2)
    alone = [drafter(tiny_qwen_draft, slots=1) for _ in range(2)]
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 4)]
    for slot, temperature in enumerate(temperatures):
        batched.reset(0, temperature, seed=20 + slot, slot=slot)
        alone[slot].reset(0, temperature, seed=20 + slot)
    for order in ([0, 1], [1, 0], [0, 1]):
        got = batched.propose_rows([contexts[s] for s in order], [4, 4], order)
        expected = [alone[s].propose(contexts[s], 4) for s in order]
        assert expected[0].tokens.tolist() != expected[1].tokens.tolist()  # else rows swapped would pass
        for row, want in zip(got, expected):
            same_drafts(row, want)
        for slot, drafts in zip(order, expected):  # all but the last draft kept: each slot moves on its own
            contexts[slot] = contexts[slot] + drafts.tokens.tolist()[:-1] + [rng.randrange(VOCAB)]
            batched.commit(len(contexts[slot]), slot=slot)
            alone[slot].commit(len(contexts[slot]))


def test_an_eager_batch_over_consecutive_slots_reads_the_cache_as_a_view(tiny_qwen_draft):
    """Every drafting step of a batch over slots 0-3 in order attends over a view of the cache (StaticKVCache.span),
    not a copy of each row's live part in every layer (what made a step over four rows after 2,000 cached tokens
    cost half as much again); over the same slots out of order, gathered. Both draft what each slot drafts alone."""
    rng = random.Random(8)
    batched = drafter(tiny_qwen_draft, slots=4)
    alone = [drafter(tiny_qwen_draft, slots=1) for _ in range(4)]
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (12, 7, 20, 3)]
    for slot in range(4):
        batched.reset(0, 0.0, seed=slot, slot=slot)
        alone[slot].reset(0, 0.0, seed=slot)
    cache = batched.stage.cache
    update, reads = cache.update, []  # (each layer's keys as attended, that layer's whole store)
    cache.update = lambda key, value, layer, *a, **k: reads.append(
        (update(key, value, layer, *a, **k), cache.keys[layer])) or reads[-1][0]
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        reads.clear()
        got = batched.propose_rows([contexts[s] for s in order], [3] * 4, order)
        for row, slot in zip(got, order):
            want = alone[slot].propose(contexts[slot], 3)
            same_drafts(row, want)
            batched.commit(len(contexts[slot]), slot=slot)
            alone[slot].commit(len(contexts[slot]))
        steps = [(keys, store) for (keys, _), store in reads if keys.shape[0] == 4]  # (catch-ups: a row at a time)
        assert len(steps) >= 3 * 2  # 3 steps, each through both layers
        assert all((keys.data_ptr() == store.data_ptr()) == (order == [0, 1, 2, 3]) for keys, store in steps), order
