"""Sampling keeps the target's distribution: checked against a reference written here (softmax of logits / T
and a nucleus cut by hand, never speculative.verify.target_probs), at T != 1 and top_p < 1, on every token
path, with enough samples that a plausible bug fails.

- target_probs equals the reference exactly (temperature and top-p both applied);
- verify_sampled on a Markov-chain target, whose next token depends on the last one, so a token drawn from
  the wrong position looks different:
  * the target drafting for itself (q = p): every draft is accepted and the bonus token after them is the
    whole test; its distribution given the last draft must be the chain's row of that draft;
  * a drafter that disagrees (sampled q, and a fixed one-hot proposal): the first two emitted tokens;
- the model drafter's sampled tokens follow the q it reports (what rejection sampling relies on), pooled
  over contexts with a randomized probability integral transform;
- the whole loop (both ranks, overlap on): the first two tokens' joint distribution is the reference's.
Each distribution test also shows its power on a wrong distribution (see test_*_rejects_*).
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from launch.build import model_drafter
from launch.plan import plan_here
from launch.config import load_config
from netbridge.protocol import SamplingParams
from speculative.verify import target_probs, verify_sampled
from tests.support.session_harness import PROMPT, serve, session_args
from tests.support.tiny_models import load_reference, save_tiny

TEMPERATURE, TOP_P = 0.7, 0.8
STATES = 6  # vocabulary of the Markov-chain target
K = 3


# ---- the reference: written from the definition, in numpy float64 -----------------------------
def reference_probs(logits, temperature: float, top_p: float) -> np.ndarray:
    """softmax(logits / T) over the last axis, then the nucleus: the most likely tokens, in order, while the mass
    before a token is below top_p (so the top token always stays), renormalized."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(p)
    for row, probs in zip(out.reshape(-1, p.shape[-1]), p.reshape(-1, p.shape[-1])):
        mass = 0.0
        for token in np.argsort(-probs, kind="stable"):
            if mass >= top_p:
                break
            row[token] = probs[token]
            mass += probs[token]
        row /= row.sum()
    return out


def chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square of counts against probabilities; cells expected below 5 are pooled into one."""
    observed, expected = np.asarray(observed, float).ravel(), np.asarray(probs, float).ravel() * np.sum(observed)
    if np.any(observed[expected == 0] > 0):
        return 0.0  # a token the distribution cannot produce
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.8), (1.6, 0.5), (0.3, 1.0), (1.0, 0.9), (0.7, 1e-300)])
def test_target_probs_is_softmax_over_temperature_within_the_nucleus(temperature, top_p):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1)) * 3
    got = target_probs(logits, temperature, top_p).double().numpy()
    np.testing.assert_allclose(got, reference_probs(logits.numpy(), temperature, top_p), atol=1e-6)


# ---- verify_sampled on a Markov-chain target -----------------------------------------------------
def chain_logits() -> torch.Tensor:
    """Logits of the next token given the last one [STATES, STATES]: every row its own shape, so the bonus token
    drawn one position early (after the wrong token) has another distribution."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(STATES, STATES, generator=g) * 1.5


def drafter_q() -> torch.Tensor:
    """A drafter that roughly knows the chain: its logits plus noise, at T = 1."""
    noise = torch.randn(STATES, STATES, generator=torch.Generator().manual_seed(4))
    return torch.softmax(chain_logits() + noise, -1)


def run_chain(trials: int, drafter: str, seed: int = 0):
    """`trials` rounds of K drafts after token 0, verified by verify_sampled against the chain at (TEMPERATURE,
    TOP_P) as the product computes it (target_probs). Returns the emitted tokens of each round [trials, <= K+1]
    and how many drafts each kept."""
    logits = chain_logits()
    p = target_probs(logits, TEMPERATURE, TOP_P)  # row s: the target's distribution after token s
    draft_q = drafter_q()
    g = torch.Generator().manual_seed(seed)
    all_ids = torch.arange(STATES).expand(K, STATES)
    emitted, accepted = [], []
    for _ in range(trials):
        last, drafts, qs = 0, [], []
        for _ in range(K):
            q = {"self": p, "other": draft_q}.get(drafter)
            if q is None:  # a fixed proposal (e.g. n-gram): one-hot q
                token, q_row = int(logits[last].argmax()), None  # the greedy guess
            else:
                token, q_row = int(torch.multinomial(q[last], 1, generator=g)), q[last]
            drafts.append(token)
            qs.append(q_row)
            last = token
        context = [0] + drafts  # the target's rows at positions [last, d1..dK]
        probs = p[context]
        if drafter == "fixed":
            q_ids, q_probs = torch.tensor(drafts)[:, None], torch.ones(K, 1)
        else:
            q_ids, q_probs = all_ids, torch.stack(qs)
        n, token = verify_sampled(probs, torch.tensor(drafts), q_ids, q_probs, g)
        emitted.append(drafts[:n] + [token])
        accepted.append(n)
    return emitted, accepted


def transitions_pvalue(pairs) -> float:
    """Chi-square of each (previous token, next token) pair's next token against the reference row of the previous
    one, pooled over rows. Speculative sampling promises exactly this: every emitted token is distributed, given
    what came before it (for a chain: the token before it), as the target's."""
    ref = reference_probs(chain_logits().numpy(), TEMPERATURE, TOP_P)
    observed, expected = np.zeros((STATES, STATES)), np.zeros((STATES, STATES))
    for prev, nxt in pairs:
        observed[prev, nxt] += 1
        expected[prev] += ref[prev]
    return chi2_pvalue(observed, expected / len(pairs))


SELF_TRIALS = 3000


def test_self_drafting_accepts_every_draft_and_draws_the_bonus_after_the_last():
    emitted, accepted = run_chain(SELF_TRIALS, "self")
    assert accepted == [K] * SELF_TRIALS  # q = p: rejection sampling keeps every draft
    pvalue = transitions_pvalue([(tokens[K - 1], tokens[K]) for tokens in emitted])
    wrong = transitions_pvalue([(tokens[K - 2], tokens[K]) for tokens in emitted])  # power: one position early
    print(f"bonus token given the last draft: p={pvalue:.3g}; given the draft before it: p={wrong:.3g}")
    assert pvalue > 1e-3
    assert wrong < 1e-6


OTHER_TRIALS = 4000


def all_transitions(emitted) -> list[tuple[int, int]]:
    pairs = []
    for tokens in emitted:
        seq = [0] + tokens  # each round starts after token 0
        pairs += list(zip(seq, seq[1:]))
    return pairs


@pytest.mark.parametrize("drafter", ["other", "fixed"])
def test_a_disagreeing_drafter_keeps_the_targets_distribution(drafter):
    """Drafts are often rejected, so every path shows: the residual at a rejection, a kept draft, the bonus."""
    emitted, accepted = run_chain(OTHER_TRIALS, drafter, seed=1)
    rates = np.bincount(accepted, minlength=K + 1) / OTHER_TRIALS
    pvalue = transitions_pvalue(all_transitions(emitted))
    print(f"{drafter}: rounds keeping 0..{K} drafts {np.round(rates, 3)}; every emitted token given the one before: p={pvalue:.3g}")
    assert rates[0] > 0.01 and rates[K] > 0.01  # a rejection (the residual) and the bonus after K kept drafts both occur
    assert pvalue > 1e-3


def test_chi_square_rejects_the_drafters_distribution():
    """Power: the same check on tokens drawn by the drafter itself (not verified) rejects them."""
    g = torch.Generator().manual_seed(5)
    q = drafter_q()
    emitted = []
    for _ in range(OTHER_TRIALS // 4):
        a = int(torch.multinomial(q[0], 1, generator=g))
        emitted.append([a, int(torch.multinomial(q[a], 1, generator=g))])
    assert transitions_pvalue(all_transitions(emitted)) < 1e-6


# ---- the model drafter: its sampled tokens follow the q it reports --------------------------------
@pytest.fixture(scope="module")
def sampling_qwen(tmp_path_factory):
    """A tiny qwen2 with the head as initialized (not sharpened for greedy parity): its next-token distributions are
    spread enough that several tokens at every position, and their continuations, are drawn often."""
    return save_tiny(tmp_path_factory.mktemp("sampling-qwen") / "model", "qwen2", seed=1, head_scale=0.75)


DRAFT_RUNS, DRAFT_K = 200, 8


def pit(tokens, q_ids, q_probs, rng, sharpen: float = 1.0) -> list[float]:
    """Randomized probability integral transform of each drawn token under its reported q (in q's own order):
    uniform on (0, 1) exactly when the tokens follow q, whatever q is, so draws from many contexts pool into one
    test. `sharpen` raises q to a power first (the power check's wrong q)."""
    out = []
    for token, ids, probs in zip(tokens.tolist(), q_ids.tolist(), q_probs.double().numpy()):
        assert token in ids, f"drafted token {token} is outside the q it reports"
        probs = probs ** sharpen / np.sum(probs ** sharpen)
        j = ids.index(token)
        out.append(float(probs[:j].sum() + rng.random() * probs[j]))
    return out


@pytest.mark.parametrize("quant", ["none", pytest.param("int8", marks=pytest.mark.slow)])  # int8: ~2.5 s
def test_model_drafter_samples_follow_the_q_it_reports(quant, sampling_qwen):
    """Rejection sampling is exact only if the drafts really are drawn from the q sent with them. The target drafts
    for itself here, at TEMPERATURE; each run drafts DRAFT_K tokens after the prompt with fresh noise, so the draws
    pool over many contexts. An int8 drafter's q is its own int8 model's (what its drafts are drawn from)."""
    cfg = load_config(["prompt_ids=[1]", f"model.target={sampling_qwen}", "model.dtype=float32", "draft.kind=model",
                       f"draft.model={sampling_qwen}", "draft.dtype=float32", f"spec.k={DRAFT_K}", "model.split=null",
                       f"draft.quant={quant}"])
    drafter = model_drafter(plan_here(cfg, 0))
    drafter.reset(0, TEMPERATURE, seed=0)
    rng = np.random.default_rng(0)
    u, u_wrong = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # single-token steps of a tiny model: a second thread only adds contention
    runs = []
    try:
        for _ in range(DRAFT_RUNS):
            drafter.commit(len(PROMPT))  # each run drafts after the prompt again, with fresh noise
            runs.append(drafter.propose(PROMPT, DRAFT_K))
    finally:
        torch.set_num_threads(threads)
    for drafts in runs:
        u += pit(drafts.tokens, drafts.q_ids, drafts.q_probs, rng)
        # power: the q these draws would have if the temperature were not applied (q^T, renormalized)
        u_wrong += pit(drafts.tokens, drafts.q_ids, drafts.q_probs, rng, sharpen=TEMPERATURE)
    pvalue, wrong = kstest(u, "uniform").pvalue, kstest(u_wrong, "uniform").pvalue
    print(f"{len(u)} drafts against their reported q: KS p={pvalue:.3g}; against q at T=1: p={wrong:.3g}")
    assert pvalue > 1e-3
    assert wrong < 1e-6


# ---- the whole loop ------------------------------------------------------------------------------
def reference_next(model, contexts: list[tuple[int, ...]]) -> dict[tuple[int, ...], np.ndarray]:
    """{context: the reference distribution of the token after PROMPT + context}, contexts of one length in one batch."""
    contexts = sorted(set(contexts))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + list(c) for c in contexts])).logits[:, -1].numpy()
    return dict(zip(contexts, reference_probs(logits, TEMPERATURE, TOP_P)))


def next_token_pvalue(model, samples: list[tuple[list[int], int]]) -> float:
    """Chi-square of each sample's token against the reference distribution after its context, pooled over the
    contexts (each context's reference computed once)."""
    rows = reference_next(model, [tuple(c) for c, _ in samples])
    cells = {(c, int(t)) for c in rows for t in np.flatnonzero(rows[c])}
    if any((tuple(c), t) not in cells for c, t in samples):
        return 0.0  # a token the target's distribution cannot produce there
    cells = sorted(cells)
    observed, expected = dict.fromkeys(cells, 0), dict.fromkeys(cells, 0.0)
    for c, t in samples:
        observed[(tuple(c), t)] += 1
        for token in np.flatnonzero(rows[tuple(c)]):
            expected[(tuple(c), int(token))] += rows[tuple(c)][token] / len(samples)
    return chi2_pvalue(np.array([observed[c] for c in cells]), np.array([expected[c] for c in cells]))


@pytest.mark.parametrize("overlap,ranks,in_flight,quant", [(True, 2, 1, "none"), (True, 3, 1, "none"), (True, 2, 3, "none"),
                                                           pytest.param(True, 2, 1, "int8", marks=pytest.mark.slow)],  # int8: ~3.8 s
                         ids=["overlap-on", "overlap-on-3-ranks", "3-in-flight", "int8-drafter"])  # overlap off: the verifier's tests above
def test_sampled_generation_keeps_the_targets_joint_distribution(overlap, ranks, in_flight, quant, sampling_qwen):
    """Both ranks, sampled at (TEMPERATURE, TOP_P): the first two tokens' joint distribution is the reference's,
    computed from the reference model's logits, and the third token, when it is the bonus after an accepted draft,
    follows the reference given the first two. The target drafts for itself, so drafts are often accepted and,
    with spec.overlap, round 1 often runs from what was drafted ahead while round 0 was in flight. With three
    ranks the block crosses a middle rank (model.split=[1,3]) before the last one verifies it. With rounds in
    flight (spec.in_flight=3) rounds 1 and 2 are sent before round 0's reply, and dropped when its bet fails. With
    an int8 drafter (draft.quant=int8) its q is its own (int8) model's, not the target's: drafts are drawn from it
    and it travels with them."""
    overrides = session_args(sampling_qwen, sampling_qwen, max_new=3) + [f"spec.overlap={str(overlap).lower()}",
                                                                         f"spec.in_flight={in_flight}", f"draft.quant={quant}"]
    overrides += ["model.split=[1,3]"] if ranks == 3 else []
    n = 300
    gens = serve(overrides, [(PROMPT, SamplingParams(TEMPERATURE, TOP_P, seed)) for seed in range(n)], ranks)
    observed: dict[tuple[int, int], int] = {}
    for g in gens:
        pair = tuple(g.output.tokens[:2])
        observed[pair] = observed.get(pair, 0) + 1
    reference = load_reference(sampling_qwen)
    p1 = reference_next(reference, [()])[()]
    expected = {}
    for (t1,), p2 in reference_next(reference, [(int(t1),) for t1 in np.flatnonzero(p1)]).items():
        expected.update({(t1, int(t2)): p1[t1] * p2[t2] for t2 in np.flatnonzero(p2)})
    assert set(observed) <= set(expected), "a pair the target's distribution cannot produce"
    cells = sorted(expected)
    pvalue = chi2_pvalue(np.array([observed.get(c, 0) for c in cells]), np.array([expected[c] for c in cells]))
    big = sum(expected[c] * n >= 5 for c in cells)
    # the bonus token: round 1 drafted one token (one left of max_new after the two before it) and kept it
    bonus = [(g.output.tokens[:2], g.output.tokens[2]) for g in gens
             if len(g.rounds) == 2 and g.rounds[1].drafted == g.rounds[1].accepted == 1]
    bonus_p = next_token_pvalue(reference, bonus)
    early = next_token_pvalue(reference, [(tokens[:1], third) for tokens, third in bonus])  # power: one position early
    print(f"overlap={overlap}: {len(expected)} pairs, {big} cells expected >= 5, p={pvalue:.3f}, "
          f"rounds from ahead {sum(r.from_ahead for g in gens for r in g.rounds)}; {len(bonus)} bonus tokens: "
          f"p={bonus_p:.3g}, against the distribution one position early p={early:.3g}")
    assert big >= 3 and pvalue > 0.001
    assert len(bonus) > n / 2 and bonus_p > 0.001
    assert early < 1e-6
    if overlap:
        assert sum(g.rounds[1].from_ahead for g in gens) > n / 5
    if in_flight > 1:  # round 1 really was on the way before round 0's reply, and really was dropped at times
        assert all(g.rounds[0].in_flight == 2 for g in gens) and sum(g.rounds[0].bets_lost for g in gens) > n / 10
