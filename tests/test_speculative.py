"""Issue: the lossless speculative round. Greedy output == transformers generate for every K and
drafter; sampled output distributed as the target's (chi-square on the verifier itself)."""
import json
import math
import shutil

import pytest
import torch
from scipy.stats import chisquare

from speculative.verify import target_probs, verify_sampled
from tests.tiny_models import ids_arg, reference_greedy, run_tandem, save_tiny, save_tiny_tokenizer

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
MAX_NEW = 23  # not a multiple of K+1 for any K tested


def spec_args(target, drafter: str, k: int, draft_folder=None, max_new=MAX_NEW):
    args = [f"model.target={target}", "model.dtype=float32", f"spec.k={k}", f"prompt_ids={ids_arg(PROMPT)}",
            f"gen.max_new_tokens={max_new}", "spec.adaptive=false"]  # a fixed K: every K really exercised
    if drafter == "ngram":
        return args + ["draft.kind=ngram"]
    return args + ["draft.kind=model", f"draft.model={draft_folder}", "draft.dtype=float32"]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_target_as_its_own_drafter_accepts_everything(k, tiny_qwen, tmp_path):
    out, _ = run_tandem(tmp_path, *spec_args(tiny_qwen, "model", k, tiny_qwen))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    stats = out["stats"]
    # round 0 (prefill) gives one token; every decode round K+1, the last one what remains
    assert stats["decode_rounds"] == math.ceil((MAX_NEW - 1) / (k + 1))
    assert stats["acceptance_rate"] == 1.0 and stats["full_hit_rate"] == 1.0


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_unrelated_drafter_is_mostly_rejected_yet_exact(k, tiny_qwen, tiny_qwen_draft, tmp_path):
    out, _ = run_tandem(tmp_path, *spec_args(tiny_qwen, "model", k, tiny_qwen_draft))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert out["stats"]["acceptance_rate"] < 0.5


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_ngram_drafter_is_exact(k, tiny_llama, tmp_path):
    out, _ = run_tandem(tmp_path, *spec_args(tiny_llama, "ngram", k))
    assert out["token_ids"] == reference_greedy(tiny_llama, PROMPT, MAX_NEW)
    assert len(out["token_ids"]) == MAX_NEW


def test_adaptive_k_drafts_less_for_a_bad_drafter_and_stays_exact(tiny_qwen, tiny_qwen_draft, tmp_path):
    fixed, _ = run_tandem(tmp_path, *spec_args(tiny_qwen, "model", 8, tiny_qwen_draft))
    adaptive, _ = run_tandem(tmp_path, *spec_args(tiny_qwen, "model", 8, tiny_qwen_draft), "spec.adaptive=true")
    expected = reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert fixed["token_ids"] == expected and adaptive["token_ids"] == expected
    assert adaptive["stats"]["drafted_tokens"] < fixed["stats"]["drafted_tokens"] / 2
    own, _ = run_tandem(tmp_path, *spec_args(tiny_qwen, "model", 8, tiny_qwen), "spec.adaptive=true")
    assert own["token_ids"] == expected and own["stats"]["acceptance_rate"] == 1.0  # full hits keep K at 8
    assert own["stats"]["decode_rounds"] == math.ceil((MAX_NEW - 1) / 9)


@pytest.mark.parametrize("k", [4, 8])
def test_eos_inside_an_accepted_draft_ends_there(k, tiny_qwen, tmp_path):
    free_run = reference_greedy(tiny_qwen, PROMPT, 40)
    # a token first produced mid-round: output index e with e % (k+1) != 0 is a draft, not a bonus token
    e = next(i for i in range(3, 40) if free_run[i] not in free_run[:i] and i % (k + 1) != 0)
    folder = tmp_path / "with-eos"
    shutil.copytree(tiny_qwen, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": free_run[e]}))
    expected = reference_greedy(folder, PROMPT, 40, eos=free_run[e])
    assert len(expected) == e + 1
    out, _ = run_tandem(tmp_path, *spec_args(folder, "model", k, folder, max_new=40))
    assert out["token_ids"] == expected
    assert out["stats"]["stop_reason"] == "eos"


def test_seeded_speculative_sampling_is_reproducible(tiny_qwen, tiny_qwen_draft, tmp_path):
    args = spec_args(tiny_qwen, "model", 4, tiny_qwen_draft) + ["gen.temperature=1.0", "gen.top_p=0.9", "gen.seed=5"]
    first, _ = run_tandem(tmp_path, *args)
    again, _ = run_tandem(tmp_path, *args)
    assert first["token_ids"] == again["token_ids"] and len(first["token_ids"]) == MAX_NEW


def test_drafter_with_another_tokenizer_is_refused(tiny_qwen, tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(tiny_qwen, target)
    shutil.copytree(tiny_qwen, draft)
    save_tiny_tokenizer(target, vocab_size=320)
    save_tiny_tokenizer(draft, vocab_size=300)
    _, proc = run_tandem(tmp_path, f"model.target={target}", "draft.kind=model", f"draft.model={draft}", "prompt=hello",
                         expect_ok=False, timeout=120)
    assert proc.returncode != 0
    assert "the drafter's tokenizer" in proc.stderr and "differs from the target's" in proc.stderr


# --- the distribution: rejection sampling keeps the target's distribution ----------------------

VOCAB = 8
TRIALS = 20_000


def distributions():
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(4, VOCAB, generator=g) * 1.5  # positions 0..3 (K = 3)
    draft_logits = torch.randn(3, VOCAB, generator=g) * 1.5  # a drafter that disagrees
    return target_probs(target_logits, 1.0, 1.0), torch.softmax(draft_logits, -1)


def run_trials(p, q, deterministic=False):
    g = torch.Generator().manual_seed(123)
    first, second_after_accept = [], []
    all_ids = torch.arange(VOCAB).expand(3, VOCAB)
    for _ in range(TRIALS):
        if deterministic:  # e.g. the n-gram drafter: a fixed proposal is a one-hot q
            drafts = torch.tensor([2, 5, 1])
            q_ids, q_probs = drafts[:, None], torch.ones(3, 1)
        else:
            drafts = torch.multinomial(q, 1, generator=g)[:, 0]
            q_ids, q_probs = all_ids, q
        accepted, token = verify_sampled(p, drafts, q_ids, q_probs, g)
        emitted = drafts[:accepted].tolist() + [token]
        first.append(emitted[0])
        if accepted >= 1:
            second_after_accept.append(emitted[1])
    return first, second_after_accept


def counts(tokens):
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()


def chi2_p(tokens, probs):
    observed = counts(tokens)
    probs = probs.double() / probs.double().sum()  # fp32 softmax sums to 1 only up to rounding
    return chisquare(observed, probs * observed.sum()).pvalue


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_sampling_preserves_target_distribution(deterministic):
    p, q = distributions()
    first, second = run_trials(p, q, deterministic)
    p_first, p_second = chi2_p(first, p[0]), chi2_p(second, p[1])
    print(f"chi-square p-values: first token {p_first:.3f}, second token {p_second:.3f} ({len(second)} trials)")
    assert p_first > 0.01 and p_second > 0.01
    assert len(second) > 1000


def test_chi_square_has_the_power_to_see_the_drafter():
    """The same test on the drafter's own samples rejects them: the check above could fail."""
    p, q = distributions()
    g = torch.Generator().manual_seed(9)
    drafts = torch.multinomial(q[0], TRIALS, replacement=True, generator=g).tolist()
    assert chi2_p(drafts, p[0]) < 1e-6
