"""draft.kind=hybrid: each round looks the context up first and, when its last draft.lookup_min tokens occurred
earlier, proposes what followed them with no model step; otherwise the model drafts. Lossless like every drafter:
greedy output is transformers generate's, one request and several at once, with rounds in flight. The lookup
really proposes where the answer copies its context, the model where it does not, both kinds in one batched tick;
the model's cache takes in the tokens it did not draft, so its drafts after a looked-up stretch are a fresh
drafter's; each round's Drafts carry the q they were drawn from (one-hot for a lookup)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from launch.config import ConfigError, load_config
from model_parallel.loader import load_stage
from netbridge.protocol import SamplingParams
from speculative.drafters import HybridDrafter, ModelDrafter, NgramDrafter, one_hot_drafts
from speculative.stats import summarize
from speculative.output import Output
from tests.support.session_harness import serve, serve_together, with_ranks
from tests.support.tiny_models import VOCAB, load_reference, reference_greedy, save_tiny

NOVEL = [11, 42, 7, 250, 3, 99, 180, 5]  # the copier's answer to it repeats itself only after a lap of its cycle
MAX_NEW = 64


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second thread per forward only adds contention (most of the time on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def copier(tiny_qwen, tmp_path_factory):
    """tiny_qwen with every attention and MLP output zeroed: its next token depends on the last one alone, so its
    greedy answer soon runs round a cycle, and an answer that repeats what came before is what prompt lookup is
    for. (Its caches matter to nothing; the drafter's cache is checked below with a real model.)"""
    return copier_of(tiny_qwen, tmp_path_factory.mktemp("copier") / "model")


def copier_of(folder, dest):
    """The model in `folder` with every attention and MLP output zeroed, saved in `dest`."""
    model = load_reference(folder)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
    model.save_pretrained(dest)
    return dest


def cycle_of(copier) -> list[int]:
    """The tokens of the copier's cycle, from where its answer to NOVEL enters it."""
    answer = reference_greedy(copier, NOVEL, MAX_NEW)
    start = next(i for i, t in enumerate(answer) if t in answer[i + 1:])
    period = answer[start + 1:].index(answer[start]) + 1
    return answer[start:start + period]


def hybrid_args(target, draft, k: int = 3, max_new: int = MAX_NEW, *extra: str) -> list[str]:
    return [f"model.target={target}", "model.dtype=float32", "draft.kind=hybrid", f"draft.model={draft}",
            "draft.dtype=float32", f"spec.k={k}", "spec.adaptive=false", f"gen.max_new_tokens={max_new}", *extra]


def kinds(rounds) -> tuple[int, int]:
    """(decode rounds looked up, decode rounds the model drafted)."""
    return sum(r.looked_up for r in rounds[1:]), sum(r.drafted > 0 and not r.looked_up for r in rounds[1:])


# --- greedy: generate's tokens, whichever proposes -------------------------------------------------------

@pytest.mark.parametrize("in_flight", [1, 3])
def test_greedy_is_generate_the_model_drafts_a_novel_answer_and_the_lookup_a_copied_one(in_flight, copier,
                                                                                      tiny_qwen_draft):
    """The copier's answer to NOVEL starts off novel (the model drafts) and then goes round its cycle (each round a
    lookup of the last lap, no model step). The model is unrelated: its drafts are rejected, the lookup's accepted.
    With rounds in flight, bets are made on both (spec.overlap): the model's fail, the lookups' hold and rounds sent
    on them are kept."""
    args = hybrid_args(copier, tiny_qwen_draft, 3, MAX_NEW, "spec.overlap=true", f"spec.in_flight={in_flight}")
    (gen,) = serve(args, [(NOVEL, SamplingParams())])
    assert gen.output.tokens == reference_greedy(copier, NOVEL, MAX_NEW)
    looked_up, modelled = kinds(gen.rounds)
    assert looked_up > 0 and modelled > 0
    stats = summarize(gen, 3, "hybrid")
    # the copier's next token is a function of its last: a lookup of its own answer is always right
    assert stats["lookup_rounds"] == looked_up and stats["lookup_acceptance_rate"] == 1.0
    if in_flight > 1:  # rounds prepared on a lookup's bet, sent before the round they bet on was answered, kept
        assert any(r.looked_up and r.from_ahead for r in gen.rounds) and stats["in_flight_mean"] > 1.5


def test_a_prompt_the_answer_copies_is_looked_up_from_the_first_round(copier, tiny_qwen_draft):
    """A prompt holding the cycle one and a half times: the answer copies it, so every decode round is a lookup and
    the model never steps (its drafts would all be rejected: the unrelated drafter)."""
    cycle = cycle_of(copier)
    prompt = NOVEL + cycle + cycle[:len(cycle) // 2]
    (gen,) = serve(hybrid_args(copier, tiny_qwen_draft, 4, 24, "draft.lookup_k=4"), [(prompt, SamplingParams())])
    assert gen.output.tokens == reference_greedy(copier, prompt, 24)
    drafted = [r for r in gen.rounds[1:] if r.drafted]
    assert kinds(gen.rounds) == (len(drafted), 0) and len(drafted) >= 4
    assert all(r.accepted == r.drafted for r in drafted)


@pytest.mark.parametrize("in_flight", [1, 3])
def test_a_copied_stretch_is_proposed_past_k_and_never_past_the_answers_end(in_flight, copier, tiny_qwen_draft):
    """draft.lookup_k above spec.k: a lookup proposes the copied stretch beyond K (the latest earlier occurrence of
    the suffix is a lap of the cycle back, so up to a lap at once), greedy still generate's, on fresh blocks and on
    bets (in flight); and no round proposes past max_new_tokens (the caches' room is counted with spec.k only)."""
    cycle = cycle_of(copier)
    assert len(cycle) > 4, cycle  # else no lookup could be longer than K=3
    prompt = NOVEL + cycle + cycle[:len(cycle) // 2]
    max_new = 2 * len(cycle) + 3
    args = hybrid_args(copier, tiny_qwen_draft, 3, max_new, "draft.lookup_k=64", "spec.overlap=true",
                       f"spec.in_flight={in_flight}")
    (gen,) = serve(args, [(prompt, SamplingParams())])
    assert gen.output.tokens == reference_greedy(copier, prompt, max_new)
    decode = gen.rounds[1:]
    assert max(r.drafted for r in decode) > 3 and all(r.accepted == r.drafted for r in decode if r.drafted)
    assert sum(r.committed for r in decode) == max_new - 1  # (round 0, the prefill, commits the first)
    left = max_new - 1
    for r in decode:  # a block of its drafts + the target's token fits what the answer had left
        assert r.drafted + 1 <= left, [(r.drafted, r.committed) for r in decode]
        left -= r.committed


def test_a_lone_streams_lookups_are_taken_in_by_the_model_in_the_wait(copier, tiny_qwen_draft):
    """Every decode round a lookup (the prompt the answer copies), under spec.overlap: the model never drafts, yet
    its slot ends holding the whole answer but its last two tokens (the last round's last draft and the target's
    own token, fed by the next drafting step as after a fully accepted round of the model's), taken in while
    rounds were on the way, so a round after a copy diverges drafts at once; and what it holds is right: its next
    drafts are a freshly prefilled drafter's. (This model is unlike the target: after its first block's first token
    was not kept, the copies are not checked against it, HybridDrafter.model_is_right.)"""
    cycle = cycle_of(copier)
    prompt = NOVEL + cycle + cycle[:len(cycle) // 2]

    def one(session, cfg, eos):
        output = Output(None, eos, cfg.gen.max_new_tokens, [], stream=False)
        return session.generate(prompt, output, SamplingParams()), session.drafter

    gen, drafter = with_ranks(hybrid_args(copier, tiny_qwen_draft, 3, 24, "draft.lookup_k=8", "spec.overlap=true"), 2, one)
    context = prompt + gen.output.tokens
    assert context[len(prompt):] == reference_greedy(copier, prompt, 24)
    assert kinds(gen.rounds)[1] == 0  # the model never drafted
    assert drafter.cached[0] == len(context) - 2
    fresh = ModelDrafter(model_stage(tiny_qwen_draft, 1), max_k=8, top_k=16)
    fresh.reset(0, 0.0, seed=0)
    mine = ModelDrafter.propose_rows(drafter, [context], [4], [0])[0]  # the model, not a lookup
    assert mine.tokens.tolist() == fresh.propose(context, 4).tokens.tolist()


@pytest.mark.parametrize("in_flight", [1, 3])
def test_a_copy_is_cut_where_the_model_parts_from_it_and_the_models_drafts_go_after(in_flight, copier):
    """The prompt holds stretches of the copier's cycle, each followed by a token its answer never puts there: on
    the answer's first lap each stretch is looked up, and the copy would be rejected from that token on. The model
    (the copier again: always the target's likeness) parts from the copy there, so the round carries the copy up to
    there and the model's own drafts after it (`cut`), all kept; greedy is still generate's."""
    cycle = cycle_of(copier)
    assert len(cycle) >= 26, cycle
    planted = []
    for i in (1, 10, 19):  # six tokens: a round ends within every stretch, 3+ tokens into it (4 tokens a round)
        planted += cycle[i:i + 6] + [(cycle[i + 6] + 1) % VOCAB]  # a stretch, then not what the copier gives
    prompt = planted + NOVEL  # the copier's answer depends on the last token alone: NOVEL's
    args = hybrid_args(copier, copier, 3, 40, "draft.lookup_k=8", "spec.overlap=true", f"spec.in_flight={in_flight}")
    (gen,) = serve(args, [(prompt, SamplingParams())])
    assert gen.output.tokens == reference_greedy(copier, prompt, 40)
    cut = [r for r in gen.rounds if r.cut]
    assert len(cut) >= 2 and all(r.looked_up and r.drafted == r.accepted == 3 for r in cut)
    assert summarize(gen, 3, "hybrid")["cut_lookups"] == len(cut)


def test_four_requests_at_once_some_looked_up_and_some_drafted_in_one_tick(copier, tiny_qwen_draft):
    """Two prompts the answer copies, two novel ones, served together: generate's tokens each; ticks batched both
    kinds (a lookup row beside model-drafted rows in one drafting step)."""
    cycle = cycle_of(copier)
    prompts = [NOVEL + cycle + cycle[:12], [9, 8] + cycle[5:] + cycle, NOVEL[::-1], [200, 17, 3, 64, 121]]
    gens, _ = serve_together(hybrid_args(copier, tiny_qwen_draft, 3, 30), [(p, SamplingParams()) for p in prompts])
    for prompt, gen in zip(prompts, gens):
        assert gen.output.tokens == reference_greedy(copier, prompt, 30), prompt
    rounds = [r for g in gens for r in g.rounds[1:] if r.batch > 1]
    assert any(r.looked_up for r in rounds) and any(r.drafted and not r.looked_up for r in rounds)


# --- the drafter itself: lookups take no model step, and the model catches up on them ----------------------

CAPACITY = 512



def model_stage(folder, slots: int):
    stage = load_stage(folder, 0, 2, embed=True, head=True)  # tiny_qwen_draft: 2 layers
    stage.allocate_cache(CAPACITY, torch.float32, setting="draft.max_len", slots=slots)
    return stage


@pytest.mark.parametrize("checked", [False, True])
def test_the_model_drafts_after_looked_up_rounds_what_a_fresh_drafter_drafts(checked, tiny_qwen_draft):
    """Three requests at once, 25 rounds, each context growing by some of its drafts and a token of its own; one
    request copies a stretch of its context now and then (lookups), one never does, one alternates. Every row the
    model drafts == a fresh one-slot drafter's drafts of the same context (prefilled from nothing): the model's
    cache took in every token committed while lookups proposed. A looked-up row carries a one-hot q. Not checked
    (a model unlike the target), it is the lookup's proposal and takes no model step (its slot's cache untouched);
    checked, it is the copy as far as the model agrees with it and then the model's own drafts: what a fresh drafter
    drafts greedily from that context (cut), or the whole copy where the model agrees with all of it."""
    rng = random.Random(3)
    hybrid = HybridDrafter(model_stage(tiny_qwen_draft, 3), lookup_min=3, max_k=8, top_k=16)
    hybrid.own_kept, hybrid.own_missed = (10 ** 6, 0) if checked else (0, 10 ** 6)  # as measured: always, never right
    fresh = ModelDrafter(model_stage(tiny_qwen_draft, 1), max_k=8, top_k=16)
    lookup = NgramDrafter(3, 3)
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (12, 7, 9)]
    copy_rate = [0.6, 0.0, 0.3]
    mixed_ticks = 0

    def freshly(context, k):
        fresh.reset(0, 0.0, seed=0)  # nothing held: the context is prefilled from scratch
        return fresh.propose(context, k).tokens.tolist()

    for round in range(25):
        ks = [rng.choice([3, 4]) for _ in contexts]
        held = [hybrid.cached[slot] for slot in range(3)]
        got = hybrid.propose_rows(contexts, ks, [0, 1, 2])
        mixed_ticks += len({d.looked_up for d in got}) == 2
        for slot, (context, k, drafts) in enumerate(zip(contexts, ks, got)):
            assert torch.equal(drafts.q_ids[:, 0], drafts.tokens) if drafts.looked_up else drafts.q_ids is None
            tokens, copy = drafts.tokens.tolist(), lookup.look_up(context, k)
            if drafts.cut:
                parts = next(j for j, (a, b) in enumerate(zip(tokens, copy)) if a != b)
                assert 0 < parts and tokens == freshly(context, len(tokens)), (round, slot)
            elif drafts.looked_up:
                assert tokens == copy and torch.all(drafts.q_probs == 1)
                assert freshly(context, len(copy)) == copy if checked else hybrid.cached[slot] == held[slot]
            else:
                assert tokens == freshly(context, k), (round, slot)
        for slot, drafts in enumerate(got):
            kept = drafts.tokens.tolist()[:rng.randint(0, len(drafts))]
            source = contexts[slot][:-4]
            copies = len(source) >= 8 and rng.random() < copy_rate[slot]
            copied = source[rng.randrange(len(source) - 4):][:4] if copies else []
            contexts[slot] = contexts[slot] + kept + [rng.randrange(VOCAB)] + copied  # copied: what comes back
            hybrid.commit(len(contexts[slot]) - len(copied), slot=slot)
    assert mixed_ticks >= 3 or checked  # both kinds in one batch, often (checked: this model parts from most copies)


class Planted:
    """A lookup that proposes what the test planted (the copy a context's earlier occurrence would give)."""
    copy: list[int] = []

    def propose(self, context, k, slot=0, room=None):
        return one_hot_drafts(self.copy[:k], looked_up=True)


def test_a_checked_copy_goes_as_far_as_the_model_agrees_then_the_models_drafts(tiny_qwen_draft):
    """A greedy request's copy, checked: it goes as far as the model agrees with it, then the model's own drafts
    follow, K in all (at least one: past K where the model agrees further); one the model parts from at once is not
    proposed (the model drafts K); one it agrees with all along, whole. Each time the slot then holds what drafting
    them would leave: the model's next drafts == a fresh drafter's (this model attends: a wrong cache shows)."""
    rng = random.Random(5)
    hybrid = HybridDrafter(model_stage(tiny_qwen_draft, 1), lookup_min=3, lookup_k=8, max_k=8, top_k=16)
    hybrid.lookup = Planted()
    fresh = ModelDrafter(model_stage(tiny_qwen_draft, 1), max_k=8, top_k=16)

    def freshly(context, k):
        fresh.reset(0, 0.0, seed=0)
        return fresh.propose(context, k).tokens.tolist()

    context = [rng.randrange(VOCAB) for _ in range(20)]
    for copy_of, k, drafted, cut in [(lambda g: g[:2] + [g[2] + 1] + g[3:6], 4, 4, True),  # agrees with 2
                                     (lambda g: g[:5] + [g[5] + 1], 2, 6, True),  # with 5: past K, its own 1
                                     (lambda g: [g[0] + 1] + g[1:4], 4, 4, False),  # with none: the model drafts
                                     (lambda g: g[:4], 4, 4, False)]:  # with all of it: the whole copy
        own = freshly(context, 8)
        Planted.copy = [t % VOCAB for t in copy_of(own)]
        hybrid.reset(len(context), 0.0, seed=0)
        got = hybrid.propose(context, k, room=8)
        assert got.tokens.tolist() == own[:drafted] and got.cut == cut, (k, drafted)
        assert got.looked_up == (cut or Planted.copy == own[:4])
        context = context + own[:drafted] + [rng.randrange(VOCAB)]  # every draft kept, and the target's own token
        hybrid.commit(len(context))
        assert ModelDrafter.propose_rows(hybrid, [context], [3], [0])[0].tokens.tolist() == freshly(context, 3)
        hybrid.commit(len(context))


def test_sampled_rows_carry_the_q_they_were_drawn_from(tiny_qwen_draft):
    """A sampled request: a looked-up round carries a one-hot q of its tokens, a model round the model's sparse q
    (its tokens within it): rank 1's rejection sampling is exact round by round whichever proposed."""
    hybrid = HybridDrafter(model_stage(tiny_qwen_draft, 2), lookup_min=2, max_k=8, top_k=16)
    for slot in range(2):
        hybrid.reset(0, 0.8, seed=5 + slot, slot=slot)
    copied, novel = [5, 6, 7, 8, 9, 5, 6], [20, 21, 22, 23]
    looked, modelled = hybrid.propose_rows([copied, novel], [3, 3], [0, 1])
    assert looked.looked_up and looked.tokens.tolist() == [7, 8, 9]
    assert looked.q_ids.tolist() == [[7], [8], [9]] and looked.q_probs.tolist() == [[1.0]] * 3
    assert not modelled.looked_up and modelled.q_ids.shape == (3, 16)
    assert all(t in ids for t, ids in zip(modelled.tokens.tolist(), modelled.q_ids.tolist()))
    torch.testing.assert_close(modelled.q_probs.sum(-1), torch.ones(3))


# --- sampling through the whole loop --------------------------------------------------------------------

TEMPERATURE, TOP_P = 0.7, 0.8


@pytest.mark.slow
def test_sampled_generation_with_the_hybrid_drafter_keeps_the_targets_joint_distribution(tiny_qwen, tmp_path):
    """Both ranks, sampled: the first two tokens' joint distribution is the target's, computed here from the
    reference model's logits. The target is a copier with spread distributions (its next token depends on the last
    alone) and the prompt its greedy cycle: when the first token is on the cycle the next round is a lookup of the
    cycle (one-hot q on a token the target likes: its q matters), else the model (the target itself, its own q)
    drafts. Per round, either q keeps p. Power: the same check rejects the second token drawn one position early."""
    target = copier_of(save_tiny(tmp_path / "spread", "qwen2", seed=1, head_scale=0.75), tmp_path / "copier")
    answer = reference_greedy(target, NOVEL, 60)
    start = next(i for i, t in enumerate(answer) if t in answer[i + 1:])
    prompt = NOVEL + answer[start:]  # the cycle, over and over
    n = 300
    args = hybrid_args(target, target, 3, 3, "draft.lookup_min=1", "spec.overlap=false")
    gens = serve(args, [(prompt, SamplingParams(TEMPERATURE, TOP_P, seed)) for seed in range(n)])
    reference = load_reference(target)
    (p1,) = nucleus(reference, [prompt])
    firsts = [int(t) for t in np.flatnonzero(p1)]
    p2 = dict(zip(firsts, nucleus(reference, [prompt + [t] for t in firsts])))
    expected = {(a, int(b)): p1[a] * p2[a][b] for a in firsts for b in np.flatnonzero(p2[a])}
    early = {(a, b): p1[a] * p1[b] for a in firsts for b in firsts}
    observed = {}
    for g in gens:
        observed[tuple(g.output.tokens[:2])] = observed.get(tuple(g.output.tokens[:2]), 0) + 1
    rounds = [g.rounds[1] for g in gens]
    looked_up, kept = sum(r.looked_up for r in rounds), sum(r.looked_up and r.accepted > 0 for r in rounds)
    p, wrong = chi2_pvalue(observed, expected), chi2_pvalue(observed, early)
    print(f"{looked_up} of {n} first decode rounds looked up, {kept} of them kept; {len(expected)} pairs, p={p:.3g}; "
          f"one position early p={wrong:.3g}")
    assert n / 10 < looked_up < n * 9 / 10 and kept > looked_up / 5  # both kinds of q, the lookup's often kept
    assert p > 0.001 and wrong < 1e-6


def chi2_pvalue(observed: dict, expected: dict) -> float:
    """Chi-square of counts against probabilities over the same cells; cells expected below 5 pooled into one; 0
    when a cell the distribution cannot produce was observed."""
    from scipy.stats import chisquare
    if set(observed) - set(expected):
        return 0.0
    n = sum(observed.values())
    cells = sorted(expected)
    exp = np.array([expected[c] for c in cells]) * n
    obs = np.array([observed.get(c, 0) for c in cells])
    big = exp >= 5
    exp, obs = np.append(exp[big], exp[~big].sum()), np.append(obs[big], obs[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def nucleus(model, contexts: list[list[int]]) -> list[np.ndarray]:
    """The target's sampling distribution after each context: softmax(logits / T), its top-p nucleus, renormalized
    (written here from the definition, in float64)."""
    with torch.no_grad():
        logits = model(torch.tensor(contexts)).logits[:, -1].double().numpy()
    out = []
    for row in logits:
        p = np.exp((row - row.max()) / TEMPERATURE)
        p /= p.sum()
        keep, mass = np.zeros_like(p), 0.0
        for token in np.argsort(-p, kind="stable"):
            if mass >= TOP_P:
                break
            keep[token], mass = p[token], mass + p[token]
        out.append(keep / keep.sum())
    return out


# --- settings ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,says", [
    (["draft.kind=hybrid", "draft.model=null"], "draft.kind=hybrid needs draft.model="),
    (["draft.kind=hybird"], "draft.kind='hybird' is not one of none, model, ngram, hybrid"),
    (["draft.kind=hybrid", "draft.lookup_min=0"], "draft.lookup_min=0 must be between 1 and"),
])
def test_a_bad_hybrid_setting_is_one_line_naming_its_key(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(["prompt_ids=[1]", *overrides])
    assert says in str(e.value) and "\n" not in str(e.value)
