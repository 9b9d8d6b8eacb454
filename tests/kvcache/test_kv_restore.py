"""cache.dir end to end, every rank in this process (launch.ranks over in-process channels): the output is
token-identical with and without the cache (fp32), after a restart, for a prefix two prompts share, with 2 and
3 ranks, into its own slot among several; a split change or a damaged file costs a cold prefill, never a wrong answer."""
from __future__ import annotations

import pytest

from tests.support.tiny_models import ids_arg, reference_greedy, run_pair, run_ranks

B = 8
SYSTEM = [(i * 37 + 11) % 300 for i in range(45)]  # the shared part: 5 whole blocks, and 5 tokens of a sixth
Q1, Q2 = [17, 4, 250, 9, 33, 61, 2], [88, 140, 6, 6, 71]
MAX_NEW = 12


def args(target, draft, cache_dir, prompt, *more):
    return [f"model.target={target}", "model.dtype=float32", "draft.kind=model", f"draft.model={draft}",
            "draft.dtype=float32", "spec.k=3", f"gen.max_new_tokens={MAX_NEW}", f"prompt_ids={ids_arg(prompt)}",
            f"cache.dir={cache_dir}", "cache.min_tokens=16", f"cache.block_tokens={B}", "model.prefill_chunk=16",
            "model.split=2", *more]  # a given split: auto may settle another one at each launch (by timing)


def reused(out) -> tuple[int, int]:
    stats = out["stats"]
    assert stats["prompt_tokens_reused"] == sum(stats["prompt_tokens_reused_from"].values())
    return stats["prompt_tokens_reused"], stats["prompt_tokens_reused_from"]["disk"]


def saved_files(folder) -> list:
    return sorted(folder.glob("*.kv"))


def test_two_ranks_after_a_restart_and_for_a_shared_prefix(tiny_qwen, tiny_qwen_draft, tmp_path):
    first, second = SYSTEM + Q1, SYSTEM + Q2
    cold = run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, first))
    assert cold["token_ids"] == reference_greedy(tiny_qwen, first, MAX_NEW)
    assert reused(cold) == (0, 0) and saved_files(tmp_path)
    again = run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, first))  # a new launch over the same folder
    assert again["token_ids"] == cold["token_ids"]
    assert reused(again) == (6 * B, 6 * B)  # 51 prompt tokens: 6 whole blocks before the last token
    shared = run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, second))
    assert shared["token_ids"] == reference_greedy(tiny_qwen, second, MAX_NEW)
    assert reused(shared) == (5 * B, 5 * B)  # the system prompt's whole blocks


def test_three_ranks_after_a_restart(tiny_qwen, tiny_qwen_draft, tmp_path):
    prompt = SYSTEM + Q1
    three = args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt, "model.split=[1,3]")
    cold = run_ranks(3, *three)
    assert cold["token_ids"] == reference_greedy(tiny_qwen, prompt, MAX_NEW) and reused(cold) == (0, 0)
    again = run_ranks(3, *three)
    assert again["token_ids"] == cold["token_ids"] and reused(again) == (6 * B, 6 * B)


def test_a_split_change_does_not_load_the_old_files(tiny_qwen, tiny_qwen_draft, tmp_path):
    prompt = SYSTEM + Q1
    run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt))
    resplit = run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt, "model.split=1"))
    assert resplit["token_ids"] == reference_greedy(tiny_qwen, prompt, MAX_NEW) and reused(resplit) == (0, 0)
    three = run_ranks(3, *args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt, "model.split=[1,2]"))
    assert reused(three) == (0, 0)


def test_a_rank_without_the_cache_turns_it_off_for_the_ranks_after_it(tiny_qwen, tiny_qwen_draft, tmp_path):
    prompt = SYSTEM + Q1
    run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt))
    out = run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt), rank1=("cache.dir=null",))
    assert out["token_ids"] == reference_greedy(tiny_qwen, prompt, MAX_NEW) and reused(out) == (0, 0)


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_damaged_file_is_refused_and_recomputed(tiny_qwen, tiny_qwen_draft, tmp_path, which, capfd):
    prompt = SYSTEM + Q1
    run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt))
    files = [f for f in saved_files(tmp_path) if f.name.startswith("3-")]  # block 3 of every slice
    victim = files[0] if which == "first" else files[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = run_pair(*args(tiny_qwen, tiny_qwen_draft, tmp_path, prompt))
    assert out["token_ids"] == reference_greedy(tiny_qwen, prompt, MAX_NEW)
    assert reused(out)[1] in (3 * B, 6 * B)  # a drafter's block costs only the drafter's reuse
    warnings = [line for line in capfd.readouterr().err.splitlines() if "refused" in line]
    assert len(warnings) == 1 and str(victim) in warnings[0]


def test_requests_in_a_row_take_a_prefix_from_disk_when_memory_lost_it(tiny_qwen, tiny_qwen_draft, tmp_path):
    """A server's session: request 3 shares the system prompt with request 1, but request 2 took the caches."""
    from netbridge.protocol import SamplingParams
    from tests.support.session_harness import serve
    other = [(i * 53 + 7) % 300 for i in range(30)]
    prompts = [SYSTEM + Q1, other, SYSTEM + Q2, SYSTEM + Q2]
    gens = serve(args(tiny_qwen, tiny_qwen_draft, tmp_path, [1]), [(p, SamplingParams()) for p in prompts])
    for prompt, gen in zip(prompts, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, MAX_NEW)
    assert [(g.reused, g.reused_disk) for g in gens] == [(0, 0), (0, 0), (5 * B, 5 * B), (len(prompts[3]) - 1, 0)]


def test_a_prefix_from_disk_goes_into_its_own_slot_on_every_rank(tiny_qwen, tiny_qwen_draft, tmp_path):
    """Two requests at once (serve.max_concurrent=2), three ranks (a middle and a last one): the second is given
    slot 1 and restores the system prompt from disk while the first is served from slot 0. The later ranks must
    load it into slot 1: into slot 0 they would leave slot 1 without its prefix and overwrite the first's KV."""
    from netbridge.protocol import SamplingParams
    from tests.support.session_harness import serve, serve_together
    ranks, split = 3, "model.split=[1,3]"
    serve(args(tiny_qwen, tiny_qwen_draft, tmp_path, [1], split), [(SYSTEM + Q1, SamplingParams())], ranks=ranks)
    other = [(i * 53 + 7) % 300 for i in range(30)]  # shares nothing with SYSTEM
    prompts = [other, SYSTEM + Q2]
    served = [a for a in args(tiny_qwen, tiny_qwen_draft, tmp_path, [1], split) if not a.startswith("prompt_ids=")]
    gens, session = serve_together(served, [(p, SamplingParams()) for p in prompts], ranks=ranks, slots=2)
    held = session.scheduler.held  # per slot, what its caches hold after the two requests
    assert held[0][:len(other)] == other and held[1][:len(SYSTEM)] == SYSTEM
    assert [g.reused_disk for g in gens] == [0, 5 * B]
    for prompt, gen in zip(prompts, gens):
        assert gen.output.tokens == reference_greedy(tiny_qwen, prompt, MAX_NEW)
