"""Issue: a graph-safe static KV cache with in-place rewind, and the drafter's static-buffer step.

Tolerance: logits through the cache vs a from-scratch forward differ by at most 5e-5 of the largest
logit, in fp32 (the cache attends over all `capacity` slots with a mask, the reference over the
live ones, so summation order differs; measured up to ~1e-5; these models have logits in the tens)."""
import random

import pytest
import torch
import torch._dynamo

from kvcache.static_cache import CacheOverflowError
from launch.build import model_drafter
from launch.plan import plan_here
from launch.config import load_config
from model_parallel.loader import load_stage
from speculative.draft_step import DraftStep
from speculative.drafters import ModelDrafter
from tests.support.tiny_models import VOCAB, load_reference

RTOL = 5e-5


def rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_cache_rewind_matches_from_scratch(family, tiny_qwen, tiny_llama):
    """Prefill, then 200 rounds of: decode a block, compare, rewind by a random amount."""
    folder = tiny_qwen if family == "qwen2" else tiny_llama
    rng = random.Random(0)
    reference = load_reference(folder)
    stage0 = load_stage(folder, 0, 2, embed=True, head=False)
    stage1 = load_stage(folder, 2, 4, embed=False, head=True)
    for s in (stage0, stage1):
        s.allocate_cache(160, torch.float32)
    tokens = [rng.randrange(VOCAB) for _ in range(12)]
    logits = stage1(stage0(torch.tensor([tokens])), num_logits=len(tokens))[0]
    assert rel_diff(logits, full_logits(reference, tokens)) < RTOL
    worst = 0.0
    for _ in range(200):
        block = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        logits = stage1(stage0(torch.tensor([block])), num_logits=len(block))[0]
        tokens += block
        expected = full_logits(reference, tokens)[-len(block):]
        worst = max(worst, rel_diff(logits, expected))
        keep = rng.randint(max(1, len(tokens) - 8), min(len(tokens), 140))
        tokens = tokens[:keep]
        for s in (stage0, stage1):
            s.cache.rewind(keep)
    print(f"{family}: worst logit diff over 200 rounds = {worst:.1e} of the largest logit")
    assert worst < RTOL


def drafter_for(folder, max_len: int, max_k: int = 8) -> ModelDrafter:
    """A greedy fp32 drafter built the way the entry builds it (launch.build)."""
    cfg = load_config([f"model.target={folder}", f"draft.model={folder}", "draft.dtype=float32",
                       f"draft.max_len={max_len}", f"spec.k={max_k}", "prompt_ids=[1]", "gen.max_new_tokens=16",
                       "model.split=null"])
    drafter = model_drafter(plan_here(cfg, 0))
    drafter.reset(0, temperature=0.0, seed=0)
    return drafter


def reference_greedy_tokens(model, context, k):
    ids = torch.tensor([context])  # explicit mask: generate would otherwise mask tokens equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(context):].tolist()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_drafter_matches_generate_after_every_rewind(family, tiny_qwen, tiny_llama):
    """60 rounds: propose K greedy tokens == generate(do_sample=False) from the same context; then
    commit a random number of them (all of them too: the cache must learn dK), sometimes a deep rewind."""
    folder = tiny_qwen if family == "qwen2" else tiny_llama
    rng = random.Random(1)
    reference = load_reference(folder)
    drafter = drafter_for(folder, max_len=256)
    context = [rng.randrange(VOCAB) for _ in range(10)]
    full_hits = 0
    for _ in range(60):
        k = rng.randint(1, 8)
        drafts = drafter.propose(context, k).tokens.tolist()
        assert drafts == reference_greedy_tokens(reference, context, k)
        accepted = rng.choice([k, k, rng.randint(0, k)])  # often all: the case with the hole elsewhere
        full_hits += accepted == k
        context = context + drafts[:accepted] + [rng.randrange(VOCAB)]
        if len(context) > 150 or rng.random() < 0.1:
            context = context[:rng.randint(1, min(len(context), 60))]
        drafter.commit(len(context))
    assert full_hits > 15


def test_overflow_names_the_setting(tiny_qwen):
    drafter = drafter_for(tiny_qwen, max_len=32)
    with pytest.raises(CacheOverflowError, match="draft.max_len"):
        drafter.propose(list(range(1, 30)), 8)


def step_buffers(step: DraftStep):
    cache = step.stage.cache
    named = {"length": cache.length, "cells": cache.cells, "token": step.token, "step_idx": step.step_idx,
             "out_tokens": step.out_tokens, "out_q_ids": step.out_q_ids, "out_q_probs": step.out_q_probs,
             "noise": step.noise, "temperature": step.temperature}
    named.update({f"k{i}": t for i, t in cache.keys.items()})
    named.update({f"v{i}": t for i, t in cache.values.items()})
    return {name: t.data_ptr() for name, t in named.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_step_has_no_python_position_state(temperature, tiny_qwen):
    """What a CUDA graph needs, checked on CPU: (1) every buffer the step touches keeps its address
    over 100 steps with rewinds; (2) the step compiles as ONE graph (fullgraph) that is never
    recompiled across rewinds, so no Python int position is baked in; (3) it computes what eager does."""
    stage = load_stage(tiny_qwen, 0, 4, embed=True, head=True)
    stage.allocate_cache(128, torch.float32, setting="draft.max_len")
    # static_shapes: the shapes a captured graph runs with (all slots, masked), here without CUDA
    step = DraftStep(stage, max_k=8, top_k=16, use_graph=False, static_shapes=True)
    step.configure(temperature, seed=0)
    stage(torch.tensor([[3, 1, 4, 1, 5]]), num_logits=1)
    before = step_buffers(step)
    cache = stage.cache
    snapshot = [(t, t.clone()) for t in (*cache.keys.values(), *cache.values.values())]
    eager_runs = []
    rng = random.Random(2)
    plan = [(rng.randint(1, 60), rng.randrange(VOCAB), rng.randint(1, 8)) for _ in range(12)]
    for length, first, k in plan:
        stage.cache.rewind(length)
        stage(torch.tensor([[1, 2]]), num_logits=1)  # eager prefill between rounds, as the drafter does
        stage.cache.rewind(length)
        eager_runs.append(step.run(first, k, start=length))
    assert step_buffers(step) == before

    for buffer, saved in snapshot:  # the compiled phase starts from the same cache contents, in place
        buffer.copy_(saved)
    compiled = torch.compile(step._step, fullgraph=True, backend="eager")
    step._step = compiled  # run() now drives the compiled step
    step.configure(temperature, seed=0)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for (length, first, k), eager in zip(plan, eager_runs):
            stage.cache.rewind(length)
            stage(torch.tensor([[1, 2]]), num_logits=1)  # eager prefill between rounds, as the drafter does
            stage.cache.rewind(length)
            got = step.run(first, k, start=length)
            assert torch.equal(got[0], eager[0])
            if temperature > 0:
                assert torch.equal(got[1], eager[1]) and torch.allclose(got[2], eager[2], rtol=1e-4, atol=1e-7)
    assert step_buffers(step) == before


def test_a_batch_of_consecutive_slots_reads_them_as_a_view_and_agrees_with_each_alone(tiny_qwen):
    """Four slots after prompts of different lengths; a step of one token in each as one batch: its logits equal
    each slot's step alone, whether the batch's slots are consecutive and in order (read as a view of the cache:
    no copy of every row's live part in every layer) or not (gathered)."""
    rng = random.Random(1)
    stage = load_stage(tiny_qwen, 0, 4, embed=True, head=True)
    stage.allocate_cache(64, torch.float32, slots=4)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 5, 11)]
    nxt = [[rng.randrange(VOCAB)] for _ in prompts]
    alone = []
    for slot, (prompt, token) in enumerate(zip(prompts, nxt)):
        stage.run(0, torch.tensor([prompt]), slot=slot)
        alone.append(stage.run(len(prompt), torch.tensor([token]), slot=slot)[0, -1])
    reads = []
    update = stage.cache.update
    stage.cache.update = lambda *a, **k: reads.append(update(*a, **k)) or reads[-1]
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        starts = [len(prompts[s]) for s in order]
        logits = stage.run_rows(starts, torch.tensor([nxt[s] for s in order]), order, [1] * 4, num_logits=1)
        for row, slot in enumerate(order):
            assert rel_diff(logits[row, -1], alone[slot]) < RTOL, (order, slot)
        keys, store = reads[-1][0], stage.cache.keys[max(stage.cache.keys)]
        assert (keys.data_ptr() == store.data_ptr()) == (order == [0, 1, 2, 3])  # a view only where consecutive
