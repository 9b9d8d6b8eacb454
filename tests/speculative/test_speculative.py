"""speculative/: the lossless round (greedy output == transformers generate for every K and drafter;
sampled output: tests/speculative/test_sampling.py), adaptive K, the drafters, verification, the stats, the
serving Session (per-request sampling, prefix reuse) and rank 0's Output.

End to end here means both ranks of train_free_infer as two threads over an in-process channel
(tests.support.tiny_models.run_pair): the whole entry path but torchrun, whose own behaviour tests/e2e/test_e2e.py
checks."""
import math
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from netbridge.protocol import SamplingParams
from speculative.drafters import NgramDrafter
from speculative.output import Output
from speculative.k_choice import next_k
from speculative.rounds import Generation, NonFiniteLogits, RoundRecord
from speculative.scheduler import common_prefix
from speculative.stats import broken_drafter_warning, summarize
from speculative.verify import verify_greedy
from tests.support.session_harness import MAX_NEW, PROMPT, serve, session_args
from tests.support.tiny_models import ids_arg, reference_greedy, run_pair, save_tiny_tokenizer, with_eos



def spec_args(target, drafter: str, k: int, draft_folder=None, max_new=MAX_NEW, prompt=PROMPT):
    args = [f"model.target={target}", "model.dtype=float32", f"spec.k={k}", f"prompt_ids={ids_arg(prompt)}",
            f"gen.max_new_tokens={max_new}", "spec.adaptive=false",  # a fixed K: every K really exercised
            "spec.overlap=false"]  # the plain round; test_overlap_is_exact_for_every_k turns it on
    if drafter == "ngram":
        return args + ["draft.kind=ngram"]
    return args + ["draft.kind=model", f"draft.model={draft_folder}", "draft.dtype=float32"]


# --- greedy: token-identical to transformers generate, whatever the drafter proposes -------------

@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_target_as_its_own_drafter_accepts_everything(k, tiny_qwen):
    out = run_pair(*spec_args(tiny_qwen, "model", k, tiny_qwen))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    stats = out["stats"]
    # round 0 (prefill) gives one token; every decode round K+1, the last one what remains
    assert stats["decode_rounds"] == math.ceil((MAX_NEW - 1) / (k + 1))
    assert stats["acceptance_rate"] == 1.0 and stats["full_hit_rate"] == 1.0


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_unrelated_drafter_is_mostly_rejected_yet_exact(k, tiny_qwen, tiny_qwen_draft):
    out = run_pair(*spec_args(tiny_qwen, "model", k, tiny_qwen_draft))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert out["stats"]["acceptance_rate"] < 0.5


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_ngram_drafter_is_exact(k, tiny_llama):
    out = run_pair(*spec_args(tiny_llama, "ngram", k))
    assert out["token_ids"] == reference_greedy(tiny_llama, PROMPT, MAX_NEW)
    assert len(out["token_ids"]) == MAX_NEW


def test_adaptive_k_drafts_less_for_a_bad_drafter_and_stays_exact(tiny_qwen, tiny_qwen_draft):
    fixed = run_pair(*spec_args(tiny_qwen, "model", 8, tiny_qwen_draft))
    adaptive = run_pair(*spec_args(tiny_qwen, "model", 8, tiny_qwen_draft), "spec.adaptive=true")
    expected = reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert fixed["token_ids"] == expected and adaptive["token_ids"] == expected
    assert adaptive["stats"]["drafted_tokens"] < fixed["stats"]["drafted_tokens"] / 2
    own = run_pair(*spec_args(tiny_qwen, "model", 8, tiny_qwen), "spec.adaptive=true")
    assert own["token_ids"] == expected and own["stats"]["acceptance_rate"] == 1.0  # full hits keep K at 8
    assert own["stats"]["decode_rounds"] == math.ceil((MAX_NEW - 1) / 9)


@pytest.mark.parametrize("k", [4, 8])
def test_eos_inside_an_accepted_draft_ends_there(k, tiny_qwen, tmp_path):
    free_run = reference_greedy(tiny_qwen, PROMPT, 40)
    # a token first produced mid-round: output index e with e % (k+1) != 0 is a draft, not a bonus token
    e = next(i for i in range(3, 40) if free_run[i] not in free_run[:i] and i % (k + 1) != 0)
    folder = with_eos(tiny_qwen, tmp_path / "with-eos", free_run[e])
    expected = reference_greedy(folder, PROMPT, 40, eos=free_run[e])
    assert len(expected) == e + 1
    out = run_pair(*spec_args(folder, "model", k, folder, max_new=40))
    assert out["token_ids"] == expected
    assert out["stats"]["stop_reason"] == "eos"


def test_seeded_speculative_sampling_is_reproducible(tiny_qwen, tiny_qwen_draft):
    args = spec_args(tiny_qwen, "model", 4, tiny_qwen_draft) + ["gen.temperature=1.0", "gen.top_p=0.9"]
    first = run_pair(*args, "gen.seed=5")
    again = run_pair(*args, "gen.seed=5")
    other = run_pair(*args, "gen.seed=6")
    assert first["token_ids"] == again["token_ids"] and len(first["token_ids"]) == MAX_NEW
    assert other["token_ids"] != first["token_ids"]  # the seed is really used (23 draws at T=1)


# --- the distribution: tests/speculative/test_sampling.py (against a reference written there) -----------------


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("drafter", ["self", "unrelated"])
def test_overlap_is_exact_for_every_k(k, drafter, tiny_qwen, tiny_qwen_draft):
    """spec.overlap on: greedy output == generate, whether the drafts ahead are used (the target drafting
    for itself) or dropped (an unrelated drafter); a short prefill_chunk sends the prompt in pieces."""
    draft = tiny_qwen if drafter == "self" else tiny_qwen_draft
    out = run_pair(*spec_args(tiny_qwen, "model", k, draft), "spec.overlap=true", "model.prefill_chunk=3")
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    if drafter == "self":
        assert out["stats"]["rounds_from_ahead"] >= out["stats"]["decode_rounds"] - 1


def test_non_finite_logits_stop_with_one_line(tiny_qwen, tmp_path):
    """Finite weights that overflow in float16 give Inf/NaN logits: rank 1 stops rather than answer."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "overflows"
    shutil.copytree(tiny_qwen, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 100  # each finite in float16, their
    weights["lm_head.weight"] = weights["lm_head.weight"] * 100  # products past its range: Inf logits
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteLogits, match="model.dtype") as e:
        run_pair(f"model.target={folder}", "draft.kind=none", f"prompt_ids={ids_arg(PROMPT)}", "gen.max_new_tokens=4",
                 "model.dtype=float16")
    assert "\n" not in str(e.value)


# --- units: verify_greedy, next_k, NgramDrafter, summarize, common_prefix ------------------------

def logits_with_argmax(best: list[int], vocab: int = 10) -> torch.Tensor:
    """[len(best), vocab] logits whose row i has its maximum at best[i] (and a runner-up elsewhere)."""
    g = torch.Generator().manual_seed(len(best))
    logits = torch.rand(len(best), vocab, generator=g)
    for i, b in enumerate(best):
        logits[i, b] = 2.0
    return logits


def test_verify_greedy_keeps_the_longest_agreeing_prefix():
    logits = logits_with_argmax([5, 3, 7, 2])  # the target's choice at [last, d1, d2, d3]
    assert verify_greedy(logits, torch.tensor([5, 3, 7])) == (3, 2)  # all kept, the bonus token after them
    assert verify_greedy(logits, torch.tensor([5, 3, 1])) == (2, 7)  # d3 wrong: the target's own token there
    assert verify_greedy(logits, torch.tensor([9, 3, 7])) == (0, 5)  # agreeing later does not count
    assert verify_greedy(logits, torch.tensor([5, 8, 7])) == (1, 3)
    assert verify_greedy(logits[:1], torch.zeros(0, dtype=torch.long)) == (0, 5)  # K = 0: plain decoding
    accepted, token = verify_greedy(logits, torch.tensor([5, 3, 7]))
    assert type(accepted) is int and type(token) is int  # they travel in the JSON meta of a Reply


def test_next_k_grows_after_a_full_hit_and_shrinks_after_a_miss():
    assert next_k(4, 4, 4, 8) == 6  # full hit: +2
    assert next_k(7, 7, 7, 8) == 8 and next_k(8, 8, 8, 8) == 8  # never past k_max
    assert next_k(4, 4, 3, 8) == 3  # any rejection is a miss: -1
    assert next_k(4, 4, 0, 8) == 3
    assert next_k(1, 1, 0, 8) == 1  # never below 1
    assert next_k(5, 0, 0, 8) == 5  # a round that drafted nothing (the prefill) says nothing
    k = 8
    for _ in range(10):  # a drafter that is always wrong ends at one draft per round
        k = next_k(k, k, 0, 8)
    assert k == 1
    for _ in range(3):  # and one that is always right climbs back to the most
        k = next_k(k, k, k, 8)
    assert k == 7 and next_k(k, k, k, 8) == 8


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(max_n=3, min_n=1)
    context = [4, 1, 7, 5, 1, 8, 6, 1]  # only the last token [1] recurs, at 1 and at 4
    drafts = drafter.propose(context, 3)
    assert drafts.tokens.tolist() == [8, 6, 1]  # what followed the LATEST earlier 1, not [7, 5, 1]
    assert drafts.tokens.dtype == torch.long
    # a deterministic proposal travels as a one-hot q
    assert drafts.q_ids[:, 0].tolist() == [8, 6, 1] and drafts.q_ids.shape == (3, 1)
    assert torch.equal(drafts.q_probs, torch.ones(3, 1))
    assert drafter.propose(context, 2).tokens.tolist() == [8, 6]  # at most k
    assert len(drafter.propose(context, 0)) == 0


def test_ngram_drafter_prefers_the_longest_suffix_match():
    context = [2, 3, 7, 0, 3, 8, 0, 2, 3]  # [2, 3] recurs at 0 (then 7); [3] alone recurs later, at 4 (then 8)
    assert NgramDrafter(max_n=3).propose(context, 2).tokens.tolist() == [7, 0]
    assert NgramDrafter(max_n=1).propose(context, 2).tokens.tolist() == [8, 0]


def test_ngram_drafter_without_a_match_proposes_nothing():
    assert len(NgramDrafter().propose([1, 2, 3, 4], 4)) == 0  # nothing recurs
    assert len(NgramDrafter().propose([9], 4)) == 0  # a single token has no earlier occurrence
    assert len(NgramDrafter(max_n=3, min_n=2).propose([5, 1, 6, 1], 4)) == 0  # only a 1-gram recurs
    assert NgramDrafter(max_n=3, min_n=2).propose([5, 1, 6, 5, 1], 4).tokens.tolist() == [6, 5, 1]
    # a match near the end has fewer than k followers: fewer drafts, never padding
    assert NgramDrafter().propose([1, 2, 1, 2], 5).tokens.tolist() == [1, 2]


def record(drafted, accepted, committed, draft_ms=0.0, stage0_ms=0.0, round_ms=0.0, stage1_ms=0.0):
    return RoundRecord(drafted, accepted, committed, draft_ms, stage0_ms, round_ms, stage1_ms)


def generation(tokens: int, rounds: list[RoundRecord], prompt_len=5, ttft_s=0.5, total_s=2.5, stop=None):
    output = Output(None, set(), max_new_tokens=100, stop=[])
    output.tokens = list(range(tokens))
    output.stop_reason = stop
    return Generation(list(range(prompt_len)), output, rounds, ttft_s=ttft_s, total_s=total_s)


def test_summarize_counts_decode_rounds_only():
    rounds = [record(0, 0, 1, draft_ms=100, stage0_ms=100, round_ms=100, stage1_ms=100),  # the prefill: not averaged
              record(4, 4, 5, draft_ms=1, stage0_ms=2, round_ms=10, stage1_ms=4),
              record(4, 1, 2, draft_ms=3, stage0_ms=2, round_ms=12, stage1_ms=5),
              record(2, 0, 1, draft_ms=2, stage0_ms=5, round_ms=11, stage1_ms=3)]
    stats = summarize(generation(9, rounds, prompt_len=7, stop="eos"), 4, "model")
    assert stats["tokens"] == 9 and stats["prompt_tokens"] == 7 and stats["stop_reason"] == "eos"
    assert stats["k"] == 4 and stats["drafter"] == "model"
    assert stats["rounds"] == 4 and stats["decode_rounds"] == 3
    assert stats["drafted_tokens"] == 10 and stats["accepted_tokens"] == 5
    assert stats["acceptance_rate"] == pytest.approx(0.5)
    # position i: of the rounds that drafted more than i tokens, the share that kept more than i
    assert stats["acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])
    assert stats["full_hit_rate"] == pytest.approx(1 / 3)
    assert stats["tokens_per_round"] == pytest.approx(8 / 3)
    assert stats["ttft_s"] == 0.5 and stats["total_s"] == 2.5
    assert stats["tokens_per_s"] == pytest.approx(8 / 2.0)  # tokens after the first, over the decode time
    mean_ms = stats["mean_ms"]
    assert mean_ms["draft"] == pytest.approx(2.0) and mean_ms["stage0"] == pytest.approx(3.0)
    assert mean_ms["stage1"] == pytest.approx(4.0)
    assert mean_ms["network"] == pytest.approx(7.0)  # send->reply less rank 1's own time
    assert mean_ms["round"] == pytest.approx(16.0)  # draft + stage0 + send->reply


def test_summarize_without_drafts_or_decode_rounds():
    no_drafts = summarize(generation(4, [record(0, 0, 1)] + [record(0, 0, 1)] * 3), 0, "none")
    assert no_drafts["acceptance_rate"] == 0.0 and no_drafts["acceptance_per_position"] == []
    assert no_drafts["full_hit_rate"] == 0.0  # rounds without drafts are neither hits nor misses
    assert no_drafts["tokens_per_round"] == 1.0 and no_drafts["drafted_tokens"] == 0
    prefill_only = summarize(generation(1, [record(0, 0, 1)], ttft_s=0.5, total_s=0.5), 4, "model")
    assert prefill_only["decode_rounds"] == 0 and prefill_only["tokens_per_s"] == 0.0
    assert prefill_only["tokens_per_round"] == 0.0 and prefill_only["mean_ms"]["round"] == 0.0


def test_broken_drafter_warning_only_for_a_model_drafter_that_never_agrees():
    never = summarize(generation(17, [record(0, 0, 1)] + [record(4, 0, 1)] * 16), 4, "model")
    assert "never agreed" in broken_drafter_warning(never)
    assert broken_drafter_warning({**never, "drafter": "ngram"}) is None  # an n-gram miss is ordinary
    assert broken_drafter_warning(summarize(generation(16, [record(0, 0, 1)] + [record(4, 0, 1)] * 15), 4, "model")) is None
    once = summarize(generation(18, [record(0, 0, 1)] + [record(4, 0, 1)] * 15 + [record(4, 1, 2)]), 4, "model")
    assert broken_drafter_warning(once) is None


def test_common_prefix():
    assert common_prefix([], []) == 0 and common_prefix([], [1, 2]) == 0 and common_prefix([1, 2], []) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3 and common_prefix([1, 2, 3, 4], [1, 2]) == 2
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1  # stops at the first difference
    assert common_prefix([7, 2], [1, 2]) == 0


# --- the Session: several generations over the same caches = fresh runs --------------------------

def fresh(overrides, ids, request: SamplingParams) -> list[int]:
    return run_pair(*overrides, f"prompt_ids={ids_arg(ids)}", f"gen.temperature={request.temperature}",
                    f"gen.top_p={request.top_p}", f"gen.seed={request.seed}")["token_ids"]


PROMPT_B = [200, 3, 3, 17, 64, 128, 9]  # shares no first token with PROMPT


def test_session_applies_each_requests_sampling_settings(tiny_qwen, tiny_qwen_draft):
    overrides = session_args(tiny_qwen, tiny_qwen_draft)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=6)
    plan = [(PROMPT, greedy), (PROMPT, sampled), (PROMPT_B, other_seed), (PROMPT_B, other_seed), (PROMPT, greedy)]
    gens = serve(overrides, plan)
    for (ids, request), gen in zip(plan, gens):
        assert gen.output.tokens == fresh(overrides, ids, request), request
        assert len(gen.output.tokens) == MAX_NEW
    assert gens[0].output.tokens == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert gens[1].output.tokens != gens[0].output.tokens  # the sampled request really sampled
    assert gens[2].output.tokens == gens[3].output.tokens  # the same seed again: the same draws
    # the prompt's first tokens were still in every cache: only the rest was prefilled
    assert [g.reused for g in gens] == [0, len(PROMPT) - 1, 0, len(PROMPT_B) - 1, 0]


@pytest.mark.parametrize("request_", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=11)], ids=["greedy", "sampled"])
def test_session_reuses_the_conversation_so_far(request_, tiny_qwen, tiny_qwen_draft):
    """The next turn (the first prompt + its answer + more) prefills only what is new and gives what
    a fresh run of the whole second prompt gives."""
    overrides = session_args(tiny_qwen, tiny_qwen_draft, max_new=15)
    first = fresh(overrides, PROMPT, request_)
    second_prompt = PROMPT + first + [17, 250, 4]
    gens = serve(overrides, [(PROMPT, request_), (second_prompt, request_)])
    assert gens[0].output.tokens == first
    assert gens[1].output.tokens == fresh(overrides, second_prompt, request_)
    assert gens[1].reused == len(PROMPT) + len(first) - 1  # everything but the newest token of the first turn
    assert gens[1].rounds[0].committed == 1  # the (short) prefill still gave the first token


def test_a_middle_rank_rewinds_for_a_chunked_prefill_after_an_earlier_request(tiny_qwen, tiny_qwen_draft):
    """Three ranks, prompts crossing in chunks of 3: each later request starts inside what the one before left in
    every cache (a shared prefix, or none), so the middle rank must rewind to each Prefill's start as the last rank
    does; each answer is what generate gives for its prompt alone."""
    overrides = session_args(tiny_qwen, tiny_qwen_draft) + ["model.split=[1,3]", "model.prefill_chunk=3"]
    plan = [PROMPT + PROMPT_B, PROMPT[:4] + [17, 250, 4, 9, 31], PROMPT_B]
    gens = serve(overrides, [(ids, SamplingParams()) for ids in plan], ranks=3)
    for ids, gen in zip(plan, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, ids, MAX_NEW), ids
    assert [g.reused for g in gens] == [0, 4, 0]


# --- Output: stop strings, EOS and max cuts, streaming ------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_stop_string_across_tokens_keeps_the_completing_token(tokenizer):
    text = "print('ok')\n\ndef reverse(s): return s"
    ids = tokenizer(text)["input_ids"]
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=100, stop=["\n\n"], stream=False)
    out.commit(ids[:3])
    kept = out.commit(ids[3:])
    assert out.done and out.stop_reason == "stop_string"
    assert out.text().endswith("\n\n") and out.text().count("\n\n") == 1
    assert 3 + kept < len(ids)  # the rest of the round was dropped
    assert "\n\n" not in tokenizer.decode(out.tokens[:-1])  # the last kept token completed it


def test_eos_and_max_new_tokens_cut_a_round(tokenizer):
    ids = tokenizer("héllo wörld, naïve café")["input_ids"]
    out = Output(tokenizer, eos_ids={ids[4]}, max_new_tokens=100, stop=[], stream=False)
    assert out.commit(ids) == 5 and out.stop_reason == "eos"
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=3, stop=[], stream=False)
    assert out.commit(ids) == 3 and out.stop_reason == "max_new_tokens" and len(out.tokens) == 3


def test_streaming_never_prints_half_a_character(tokenizer, capsys):
    text = "日本語のテキスト héllo"
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(text)]
    # split multi-byte characters across tokens: re-tokenize byte by byte with the byte-level alphabet
    byte_ids = [i for piece in (tokenizer.tokenize(ch) for ch in text) for i in tokenizer.convert_tokens_to_ids(piece)]
    assert tokenizer.decode(byte_ids) == text and tokenizer.decode(ids) == text
    # some character really spans tokens: a naive streamer would print a replacement character
    assert any(tokenizer.decode(byte_ids[:n]).endswith("\ufffd") for n in range(1, len(byte_ids)))
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=1000, stop=[], stream=True)
    chunks = []
    for token in byte_ids:
        out.commit([token])
        chunks.append(capsys.readouterr().out)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text


# --- spec.k_from_costs ---------------------------------------------------------------------------

def costed_rounds(model, n, k, accept, draft_ms=10.0, block=lambda n: 50.0, wire_ms=0.0):
    """Feed `n` decode rounds of K=k with `accept(k)` drafts kept and the given costs."""
    for _ in range(n):
        b = block(k + 1)
        model.observe(RoundRecord(k, accept(k), accept(k) + 1, draft_ms * k, b / 2, b / 2 + wire_ms, b / 2))


def test_k_from_costs_follows_acceptance_and_costs():
    from speculative.k_choice import KFromCosts
    always = KFromCosts(8)
    costed_rounds(always, 8, 4, accept=lambda k: k)
    costed_rounds(always, 8, 2, accept=lambda k: k)
    assert always.choose() >= 6  # every draft kept, blocks cost the same at any size: draft (nearly) all

    steep = KFromCosts(8)  # every draft kept, but a block costs as much per token as a one-token round
    for k in (1, 3, 5):
        costed_rounds(steep, 4, k, accept=lambda k: k, block=lambda n: 200.0 * n)
    far = KFromCosts(8)  # the same across a 400 ms round trip: drafting more now pays
    for k in (1, 3, 5):
        costed_rounds(far, 4, k, accept=lambda k: k, block=lambda n: 200.0 * n, wire_ms=400.0)
    assert steep.choose() < far.choose()


def test_k_from_costs_stops_drafting_when_it_cannot_pay_but_keeps_measuring():
    from speculative.k_choice import KFromCosts
    never = KFromCosts(8, explore_every=4)  # no draft is ever kept: drafting only costs
    for k in (4, 2, 6):
        costed_rounds(never, 4, k, accept=lambda k: 0)
    picks = [never.choose() for _ in range(8)]
    assert picks.count(0) == 6 and picks[3] > 0 and picks[7] > 0  # K=0, but every 4th round explores

    better = KFromCosts(8, explore_every=4)  # ... and once drafts start being kept, K rises again
    for k in (4, 2, 6):
        costed_rounds(better, 4, k, accept=lambda k: 0)
    assert better.choose() == 0
    for k in (1, 2, 3, 4):
        costed_rounds(better, 8, k, accept=lambda k: k)
    assert better.choose() > 0


def test_k_from_costs_warms_up_cheaply_then_explores_upwards():
    from speculative.k_choice import KFromCosts
    fresh = KFromCosts(8, explore_every=3)
    assert fresh.choose() == 1  # first the cheap sizes: a block of 2, then of 1
    costed_rounds(fresh, 1, 1, accept=lambda k: k)
    assert fresh.choose() == 0
    costed_rounds(fresh, 1, 0, accept=lambda k: 0)
    picks = []
    for _ in range(12):  # every draft kept, a block costs the same at any size: K climbs to the top
        picks.append(fresh.choose())
        costed_rounds(fresh, 1, picks[-1], accept=lambda k: k)
    assert picks[0] >= 1 and picks[-3:].count(8) >= 2, picks  # (an explored neighbour now and then)


def test_k_from_costs_spreads_its_explorations_over_streams_taking_turns():
    """Four streams' rounds in turn: each explores every explore_every-th of its own rounds, so no stream pays
    for them all (one count for all put every exploration on one stream, which then ended rounds after the rest)."""
    from speculative.k_choice import KFromCosts
    model = KFromCosts(8, explore_every=4)
    costed_rounds(model, 8, 8, accept=lambda k: k)  # every draft kept: K=8 is the best
    assert model.first() == 8
    picks = {slot: [] for slot in range(4)}
    for _ in range(8):
        for slot in picks:
            record = RoundRecord(8, 8, 9, 80.0, 25.0, 25.0, 25.0, slot=slot)
            picks[slot].append(model.after(8, record, decode=True))
    assert all(ks.count(7) == 2 and ks.count(8) == 6 for ks in picks.values()), picks


def test_k_from_costs_with_overlap_counts_the_drafting_hidden_in_the_wait():
    """Rank 0's drafting is hidden behind rank 1's work when the bet holds: with overlap the same
    measurements promise more tokens per ms."""
    from speculative.k_choice import KFromCosts
    models = {overlap: KFromCosts(8, overlap=overlap) for overlap in (False, True)}
    for model in models.values():
        for k in (0, 1, 2, 4, 8):  # rank 0: 60 ms a draft + 100 ms its slice; rank 1 and the wire: 300 ms
            costed_rounds(model, 10, k, accept=lambda k: k if k < 2 else k - 1, draft_ms=60.0,
                          block=lambda n: 200.0 + 0 * n, wire_ms=200.0)
    seq, ovl = models[False].rates(), models[True].rates()
    assert seq[0] == pytest.approx(ovl[0])  # K=0 has nothing to overlap
    assert max(ovl) > max(seq)


def test_k_from_costs_under_overlap_counts_the_guess_a_block_on_a_bet_drafts():
    """Rank 0 bound (no wire): a draft step 2.6 ms, stage 0 1.5 ms, every draft kept. A block on a bet drafts the
    guess of the next token too, K+1 steps: K=1 gives 2 tokens in 6.7 ms, K=8 9 in 24.9, so the most drafts win.
    Counted as K steps, K=1 read 2 tokens in 4.1 ms and won."""
    from speculative.k_choice import KFromCosts
    model = KFromCosts(8, overlap=True)
    for k in (1, 0, 8, 4):
        costed_rounds(model, 6, k, accept=lambda k: k, draft_ms=2.6, block=lambda n: 3.0)
    assert model.choose() >= 6, model.rates()


def test_k_from_costs_takes_the_models_best_k_alone_at_its_best_depth_and_for_streams_together():
    """Two ranks of 1 ms, 0.5 ms each way, every draft kept; a drafter step 1 ms, and 1 ms more per row. Alone K=4
    pays (5 tokens in 5 + 1 + 2 = 8 ms against 1 in 3); four streams in a batch take 5 x 4 + 1 + 2 = 23 ms for 20
    tokens at K=4, 3 ms for 4 at K=0: there K=0. With a model, a round takes the model's K for the streams live,
    whatever the rounds' own costs say (here K=0 for one stream: drafting measured at 50 ms a step over no wire)."""
    from speculative.cost_model import Acceptance, DraftCost, LinkCost, Pipeline, Predictor, RankCost
    from speculative.k_choice import KFromCosts
    p = Pipeline((RankCost(1.0), RankCost(1.0)), (LinkCost(0.5), LinkCost(0.5)), DraftCost(1.0, row_ms=1.0),
                 Acceptance(prior=1.0), overlap=False)
    predictor = Predictor(p)
    alone, together = predictor.rates(4, 1), predictor.rates(4, 4)
    assert max(range(5), key=alone.__getitem__) == 4 and max(range(5), key=together.__getitem__) == 0
    model, own = KFromCosts(4, model=predictor.rates), KFromCosts(4)
    assert model.first() == 1  # no draft measured yet: one (the model at the prior could keep K=0 unmeasured)
    for policy in (model, own):
        costed_rounds(policy, 8, 1, accept=lambda k: k, draft_ms=100.0, block=lambda n: 1.0)  # its warm-up
        costed_rounds(policy, 8, 0, accept=lambda k: k, draft_ms=100.0, block=lambda n: 1.0)  # and more
    one = RoundRecord(1, 1, 2, 100.0, 1.0, 2.0, 0.5, live=1)
    assert own.after(1, one, decode=True) == 0  # the rounds' own costs: drafting does not pay
    assert model.after(1, one, decode=True) == 4 == model.first()  # the model's
    four = RoundRecord(4, 4, 5, 5.0, 1.0, 3.0, 1.0, live=4)
    assert model.after(4, four, decode=True, context=100) == 0
    asked = []  # worked out again only when the streams or the context's thousand change, or every 8 rounds
    model.model = lambda *args: asked.append(args) or predictor.rates(*args)
    for context in range(101, 108):
        assert model.after(0, four, decode=True, context=context) == 0
    assert asked == []
    model.after(0, four, decode=True, context=108)
    model.after(0, RoundRecord(0, 0, 1, 0.0, 1.0, 3.0, 1.0, live=3), decode=True, context=109)
    model.after(0, four, decode=True, context=1100)
    assert [(streams, context) for _, streams, context in asked] == [(4, 108), (3, 109), (4, 1100)]
    assert model.first(4, 100) == 0 and model.first(1, 100) == 4  # a newcomer's K: the streams live with it


def test_k_from_costs_drafts_again_only_where_it_pays_for_the_prompt_its_drafter_skipped():
    """A stream admitted at K=0 (several streams live, drafting did not pay) leaves its prompt out of the drafter.
    Drafting again first takes in what the drafter lacks: a step and 2,000 tokens at 0.1 ms each, 201 ms. Alone,
    with every draft kept, K=4 gives 5 tokens in 8 ms against 1 in 3: over 5 tokens left it saves ~7 ms, so K stays
    0; over 10,000 it saves ~22 s, so K=4; a drafter in step (no lag) drafts at once."""
    from speculative.cost_model import Acceptance, DraftCost, LinkCost, Pipeline, Predictor, RankCost
    from speculative.k_choice import KFromCosts
    p = Pipeline((RankCost(1.0), RankCost(1.0)), (LinkCost(0.5), LinkCost(0.5)), DraftCost(1.0, token_ms=0.1),
                 Acceptance(prior=1.0), overlap=False)
    predictor = Predictor(p)
    assert predictor.intake_ms(2000) == pytest.approx(201.0)
    model = KFromCosts(4, model=predictor.rates, intake=predictor.intake_ms,
                       admission_intake=predictor.admission_intake_ms)
    one = RoundRecord(0, 0, 1, 0.0, 1.0, 2.0, 0.5, live=1)
    assert model.after(0, one, decode=True, context=2010, lag=2000, remaining=5) == 1  # nothing measured: one draft
    costed_rounds(model, 2, 1, accept=lambda k: k, draft_ms=1.0, block=lambda n: 1.0)  # a draft measured
    assert model.after(0, one, decode=True, context=2010, lag=2000, remaining=5) == 0
    assert model.after(0, one, decode=True, context=2010, lag=2000, remaining=10_000) == 4
    assert model.after(0, one, decode=True, context=2010, lag=0, remaining=5) == 4
    # a newcomer whose drafter lacks its prompt: the same, at what the intake adds to its TTFT (Session.admit)
    assert predictor.admission_intake_ms(2000) > 150
    assert model.first(1, 2010, lag=2000, remaining=5) == 0
    assert model.first(1, 2010, lag=2000, remaining=10_000) == model.first(1, 2010, lag=0, remaining=5) == 4


def test_a_burst_of_long_prompts_drafts_only_where_it_pays_for_every_prompt_through_the_drafter():
    """Four 2,000-token prompts admitted together (Engine._burst): rank 0 takes each into the drafter before any
    first round goes, 201 ms apiece, and every first token waits for all four (814 ms, the model's burst), where one
    alone pays 202. Four streams at K=4 give 2,857 tokens/s against 1,333 at K=0: over 300 tokens each, K=4 saves
    0.48 s, enough for one prompt's intake and not for four; over 1,000 it saves 1.6 s."""
    from speculative.cost_model import Acceptance, DraftCost, LinkCost, Pipeline, Predictor, RankCost
    from speculative.k_choice import KFromCosts
    p = Pipeline((RankCost(1.0), RankCost(1.0)), (LinkCost(0.5), LinkCost(0.5)), DraftCost(1.0, token_ms=0.1),
                 Acceptance(prior=1.0), overlap=False)
    predictor = Predictor(p)
    assert predictor.admission_intake_ms(2000, burst=(2000,) * 3) == pytest.approx(814.0)
    model = KFromCosts(4, model=predictor.rates, intake=predictor.intake_ms,
                       admission_intake=predictor.admission_intake_ms)
    costed_rounds(model, 2, 1, accept=lambda k: k, draft_ms=1.0, block=lambda n: 1.0)  # a draft measured
    burst = (2000,) * 3
    assert model.first(4, 2010, lag=2000, remaining=300) == 4  # as if its prompt alone went through the drafter
    assert model.first(4, 2010, lag=2000, remaining=300, burst=burst) == 0
    assert model.first(4, 2010, lag=2000, remaining=1000, burst=burst) == 4
    assert model.first(4, 2010, lag=0, remaining=300, burst=burst) == 4  # its drafter holds the prompt already


def test_streams_admitted_at_k0_draft_again_only_where_it_pays_for_every_prompt_their_drafters_lack():
    """Four streams admitted at K=0, none of their 2,000-token prompts in the drafter: each that turns to K=4 first
    takes its prompt in (201 ms) while every stream waits, and each chooses alike. Over 300 tokens left each, K=4
    saves the four 0.48 s: enough for one intake, not for four (804 ms); over 1,000 it saves 1.6 s. Session.behind
    gives a stream the others' lags: those whose drafters lack a prompt, where its own does."""
    from types import SimpleNamespace
    from speculative.cost_model import Acceptance, DraftCost, LinkCost, Pipeline, Predictor, RankCost
    from speculative.k_choice import KFromCosts
    from speculative.session import Session, SpecSettings
    p = Pipeline((RankCost(1.0), RankCost(1.0)), (LinkCost(0.5), LinkCost(0.5)), DraftCost(1.0, token_ms=0.1),
                 Acceptance(prior=1.0), overlap=False)
    predictor = Predictor(p)
    model = KFromCosts(4, model=predictor.rates, intake=predictor.intake_ms)
    costed_rounds(model, 2, 1, accept=lambda k: k, draft_ms=1.0, block=lambda n: 1.0)  # a draft measured
    four = RoundRecord(0, 0, 1, 0.0, 1.0, 2.0, 0.5, live=4)
    others = ((2000, 10),) * 3
    assert model.after(0, four, decode=True, context=2010, lag=2000, remaining=300) == 4  # as if alone behind
    assert model.after(0, four, decode=True, context=2010, lag=2000, remaining=300, behind=others) == 0
    assert model.after(0, four, decode=True, context=2010, lag=2000, remaining=1000, behind=others) == 4

    lacking = {0: 2000, 1: 2000, 2: 3, 3: 0}  # slots 2 and 3 in step (a round's tokens behind at most)
    drafter = SimpleNamespace(reset=lambda *a, **k: None, lacks=lambda tokens, slot=0: lacking[slot])
    session = Session(SimpleNamespace(device="cpu"), drafter, SimpleNamespace(send=lambda *a, **k: None),
                      SpecSettings(k=4), slots=4)
    streams = [SimpleNamespace(committed=[0] * 2010, slot=slot) for slot in range(4)]
    session.scheduler.live = dict(enumerate(streams))
    assert session.behind(streams[0], lag=2000) == ((2000, 10),)
    assert session.behind(streams[2], lag=3) == ()  # in step: it weighs no intake


def test_a_stream_admitted_at_k0_leaves_its_prompt_out_of_the_drafter():
    """Session.admit: a stream whose first K is 0 sends its prompt's chunks without the drafter taking them in
    (it takes them in when its rounds first draft, if ever: four 2,000-token streams at K=0 spent rank 0's time
    on four prompts through the drafter); at K > 0 the drafter takes in each chunk as before."""
    from types import SimpleNamespace
    from speculative.session import Session, SpecSettings
    taken, asked = [], []
    drafter = SimpleNamespace(reset=lambda *a, **k: None, catch_up=lambda context, slot=0: taken.append(len(context)))
    stage = SimpleNamespace(device="cpu", run=lambda start, ids, slot=0: torch.zeros(1, ids.shape[1], 4))
    channel = SimpleNamespace(send=lambda *a, **k: None)
    predicted = []  # the cost model's TTFT counts the drafter's intake where there is one
    unused = lambda *args, **kwargs: None  # noqa: E731 - (the K policy is replaced below)
    predictor = SimpleNamespace(rates=unused, intake_ms=unused, admission_intake_ms=unused, best_depth=unused,
                                start=None, first_tokens_s=lambda n, ahead, k, depth, intake, ago_ms:
                                predicted.append(intake) or (0.0,))
    for k, intake in ((0, []), (2, [64, 128])):
        taken.clear()
        session = Session(stage, drafter, channel, SpecSettings(k=2, prefill_chunk=64), slots=2, predictor=predictor)
        session.k_policy = SimpleNamespace(first=lambda *args, k=k, **kwargs: asked.append((args, kwargs)) or k)
        s = session.admit(list(range(150)), SimpleNamespace(max_new_tokens=4, tokens=[]))
        assert s.k_now == k and taken == intake and len(s.pending) == 22
        # the K policy asked for this stream alone, its prompt's 150 tokens, none in the drafter, 4 to answer
        assert asked[-1] == ((1, 150, 150, 4), {"burst": ()})
        assert predicted[-1] is bool(k)
        # its first round on the way, several streams live: the drafter takes in the rest in the wait, at K > 0
        taken.clear()
        session.scheduler.live = {0: SimpleNamespace(prefilling=True, chain=[object()], k_now=k, committed=[0] * 150,
                                                     slot=0)}
        session.take_in_prompts()
        assert taken == ([150] if k else [])
    # a burst: admitted beside one whose first round is not sent, one more coming right after it (Engine._burst)
    session = Session(stage, drafter, channel, SpecSettings(k=2, prefill_chunk=64), slots=3, predictor=predictor)
    session.k_policy = SimpleNamespace(first=lambda *args, **kwargs: asked.append((args, kwargs)) or 2)
    session.admit(list(range(150)), SimpleNamespace(max_new_tokens=4, tokens=[]), coming=(100, 300))
    session.admit(list(range(1000, 1100)), SimpleNamespace(max_new_tokens=4, tokens=[]), coming=(300,))
    assert asked[-2:] == [((3, 150, 150, 4), {"burst": (100, 300)}), ((3, 100, 100, 4), {"burst": (150, 300)})]


def test_a_lone_stream_at_k0_keeps_its_drafter_in_step_in_the_wait_but_takes_no_skipped_prompt_in():
    """BlockMaker.use_the_wait with the next round at K=0: a drafter in step takes in the last round's tokens now
    (not all at once when K rises); one that skipped the prompt (lacking 2,000 tokens) waits for a K that pays for
    it (KFromCosts.pays_intake), not 2,000 tokens in every wait."""
    from types import SimpleNamespace
    from speculative.blocks import BlockMaker
    from speculative.drafters import one_hot_drafts
    from speculative.k_choice import FixedK
    for lacks, intake in ((1, [2001]), (2000, [])):
        taken = []
        drafter = SimpleNamespace(lacks=lambda tokens, slot=0, lacks=lacks: lacks,
                                  catch_up=lambda context, slot=0: taken.append(len(context)))
        tip = SimpleNamespace(sent_at=1.0, k=0, drafts=one_hot_drafts([]), fed=[7])
        s = SimpleNamespace(chain=[tip], k_now=0, remaining=10, promised=1, committed=[0] * 2001, slot=0, sent=1)
        BlockMaker(None, drafter, FixedK(4)).use_the_wait(s, depth=1, send=None)
        assert taken == intake, lacks


def test_a_lone_streams_k_is_the_best_at_its_best_depth_not_at_one():
    """K and the depth chosen together (spec.in_flight=auto): a drafter step of 1 ms against a later rank of 2 and
    1 ms each way, bets held nine times in ten. At one round on the way K=3 has the most tokens/s; with up to
    four rounds on the way, K=1 at depth 2 has more than any K at depth 1 (a short block keeps the chain's
    step short, the wire hidden by the rounds on the way); a fixed depth's K is that depth's best."""
    from speculative.cost_model import Acceptance, DraftCost, LinkCost, Pipeline, Predictor, RankCost, best_k
    p = Pipeline((RankCost(1.0), RankCost(2.0)), (LinkCost(1.0), LinkCost(1.0)), DraftCost(1.0),
                 Acceptance(prior=0.9), overlap=True)
    assert best_k(p, 4, (1,)) == 3
    assert best_k(p, 4, range(1, 5)) == 1
    rates = Predictor(p).rates(4, 1, depths=range(1, 5))
    assert max(range(5), key=rates.__getitem__) == 1
    assert max(rates) > max(Predictor(p).rates(4, 1, depths=(1,)))
    from types import SimpleNamespace
    from launch.prediction import planned_settings
    from speculative.session import Session, SpecSettings
    for in_flight, k in (("auto", 1), (1, 3)):  # the session's K policy and the start-up line's K alike
        spec = SpecSettings(k=4, k_from_costs=True, overlap=True, in_flight=in_flight)
        rates = Session(None, None, None, spec, predictor=Predictor(p)).k_policy.model(4, 1, None)
        assert max(range(5), key=rates.__getitem__) == k, in_flight
        plan = SimpleNamespace(settings=SimpleNamespace(spec=spec), slots=1)
        assert planned_settings(plan, p).k == k, in_flight


def test_k_from_costs_ignores_the_draft_cost_of_a_round_that_caught_up():
    """After K=0 rounds the next drafting round first feeds the drafter what it missed: that cost is
    not the per-token draft cost."""
    from speculative.k_choice import KFromCosts
    model = KFromCosts(8)
    costed_rounds(model, 6, 4, accept=lambda k: k, draft_ms=10.0)
    costed_rounds(model, 2, 0, accept=lambda k: 0)
    costed_rounds(model, 1, 4, accept=lambda k: k, draft_ms=500.0)
    assert model.draft_ms == pytest.approx(8.0)  # 4 drafts in 40 ms: 5 steps' worth (KFromCosts.pipeline)
    costed_rounds(model, 1, 4, accept=lambda k: k, draft_ms=500.0)
    assert model.draft_ms > 10.0


@pytest.mark.parametrize("drafter,overlap", [("self", "false"), ("self", "true"), ("unrelated", "false"),
                                             ("unrelated", "true")])
def test_k_from_costs_is_exact(drafter, overlap, tiny_qwen, tiny_qwen_draft, monkeypatch):
    from speculative.k_choice import KFromCosts
    picks = []
    explored = KFromCosts.explored
    monkeypatch.setattr(KFromCosts, "explored", lambda self, best, slot: picks.append(explored(self, best, slot))
                        or picks[-1])
    draft = tiny_qwen if drafter == "self" else tiny_qwen_draft
    # every bet holding: a trip of 2 x 25 ms makes K=8 clearly best (over none, K=1 to 8 read within 2% of each
    # other, and a noisy block time chose K=1 or 2 for 11 rounds in half the runs, 2026-12-05; over 2 x 10 ms a
    # slower machine chose K=3 for 11 rounds in 3 of 4 runs, 2026-12-07)
    trip = ["transport.emulate_delay_ms=25"] if drafter == "self" and overlap == "true" else []
    out = run_pair(*spec_args(tiny_qwen, "model", 8, draft, max_new=40), "spec.k_from_costs=true",
                   f"spec.overlap={overlap}", *trip)
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, 40)
    if drafter == "unrelated":  # a drafter that is never right: K=0 rounds (the drafter catching up in the
        assert 0 in picks and any(k > 0 for k in picks[2:]), picks  # wait) and explored drafting rounds
    if drafter == "self" and overlap == "true":  # every bet holds: the chain's blocks take the K chosen after each
        # reply, not the K it began with (its warm-up's K=1: 20 rounds of 2 tokens for 39)
        assert out["stats"]["decode_rounds"] <= 10, (out["stats"]["decode_rounds"], picks)
