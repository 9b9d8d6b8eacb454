"""speculative.prefixes over real stages of a tiny model, three ranks in one process (no channel: the lap of the
ring is the calls in rank order): a restored prefix gives the logits a cold prefill gives."""
from __future__ import annotations

import pytest
import torch

from model_parallel.identity import stage_identity
from speculative.prefixes import CacheSettings, RankPrefixes, pass_on
from model_parallel.loader import load_stage
from tests.support.tiny_models import save_tiny

B = 8
PROMPT = [(i * 37 + 11) % 300 for i in range(41)]  # 5 whole blocks before the last token


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("kv") / "tiny", "llama", layers=4)


def pipeline(folder, cuts=(1, 3)):
    bounds = [0, *cuts, 4]
    stages = [load_stage(folder, a, b, embed=a == 0, head=b == 4) for a, b in zip(bounds, bounds[1:])]
    for stage in stages:
        stage.allocate_cache(64, torch.float32)
    ids = [stage_identity(folder, a, b, a == 0, b == 4) for a, b in zip(bounds, bounds[1:])]
    return stages, ids


def run(stages, start: int, tokens: list[int]) -> torch.Tensor:
    """The prompt's tokens from `start` through every stage; the last position's logits."""
    x = torch.tensor([tokens[start:]])
    for stage in stages[:-1]:
        x = stage.run(start, x)
    return stages[-1].run(start, x, num_logits=1)[0, -1]


def ranks_of(stages, ids, folder_dir, **settings):
    settings = CacheSettings(str(folder_dir), min_tokens=16, block_tokens=B, **settings)
    return [RankPrefixes(settings, ident, stage.cache) for stage, ident in zip(stages, ids)]


def agree(ranks, prompt, memory: int = 0) -> int:
    """What the round loops do: rank 0 looks, the Lookup goes round (when rank 0 holds more than memory), the
    Restore goes round."""
    lookup = ranks[0].lookup(prompt, memory)
    for rank in ranks[1:] if lookup is not None else []:
        lookup = pass_on(rank, lookup)
    restore = ranks[0].restore(memory, lookup)
    for rank in ranks[1:]:
        restore = pass_on(rank, restore)
    return restore.tokens


def prefill_and_save(stages, ranks, prompt) -> torch.Tensor:
    """A request as the round loops serve it: agree, prefill the rest, save."""
    logits = run(stages, agree(ranks, prompt), prompt)
    for rank in ranks:
        rank.after_prefill()
        rank.close()
    return logits


def test_a_restored_prefix_gives_the_cold_logits_after_a_restart(folder, tmp_path):
    stages, ids = pipeline(folder)
    ranks = ranks_of(stages, ids, tmp_path)
    cold = prefill_and_save(stages, ranks, PROMPT)  # nothing saved yet: a whole prefill
    assert all(int(stage.cache.length) == len(PROMPT) for stage in stages)
    fresh, _ = pipeline(folder)  # a restart: new caches, new stores over the same folder
    again = ranks_of(fresh, ids, tmp_path)
    assert agree(again, PROMPT) == 5 * B
    assert all(int(stage.cache.length) == 5 * B for stage in fresh)
    restored = run(fresh, 5 * B, PROMPT)
    torch.testing.assert_close(restored, cold, rtol=0, atol=2e-4)  # fp32, other block shapes
    unrestored, _ = pipeline(folder)  # the same start over zeroed caches: what a missed load would give
    assert (run(unrestored, 5 * B, PROMPT) - cold).abs().max() > 1e-2


def test_a_prefix_shared_by_another_prompt(folder, tmp_path):
    stages, ids = pipeline(folder)
    prefill_and_save(stages, ranks_of(stages, ids, tmp_path), PROMPT)
    other = PROMPT[:3 * B + 2] + [5, 6, 7, 8, 9, 10, 11, 12]
    cold = run(pipeline(folder)[0], 0, other)
    fresh, _ = pipeline(folder)
    assert agree(ranks_of(fresh, ids, tmp_path), other) == 3 * B
    torch.testing.assert_close(run(fresh, 3 * B, other), cold, rtol=0, atol=2e-4)  # fp32, other block shapes


def test_the_ranks_agree_on_what_every_rank_holds(folder, tmp_path):
    stages, ids = pipeline(folder)
    ranks = ranks_of(stages, ids, tmp_path)
    prefill_and_save(stages, ranks, PROMPT)
    middle = ranks[1].store("target", [ids[0]], B)
    middle.paths(ranks[0].begin(PROMPT))[2].unlink()  # the middle rank lost its third block
    fresh, _ = pipeline(folder)
    assert agree(ranks_of(fresh, ids, tmp_path), PROMPT) == 2 * B
    assert all(int(stage.cache.length) == 2 * B for stage in fresh)


def test_memory_already_holding_part_of_the_prefix_is_left_as_it_is(folder, tmp_path):
    stages, ids = pipeline(folder)
    prefill_and_save(stages, ranks_of(stages, ids, tmp_path), PROMPT)
    fresh, _ = pipeline(folder)
    run(fresh, 0, PROMPT[:13])  # the last request's 12 tokens + 1 are in memory
    assert agree(ranks_of(fresh, ids, tmp_path), PROMPT, memory=12) == 5 * B
    torch.testing.assert_close(run(fresh, 5 * B, PROMPT), run(pipeline(folder)[0], 0, PROMPT), rtol=0, atol=2e-4)  # fp32, other block shapes


def test_a_split_change_or_an_earlier_ranks_new_weights_never_load_old_files(folder, tmp_path):
    stages, ids = pipeline(folder)
    prefill_and_save(stages, ranks_of(stages, ids, tmp_path), PROMPT)
    resplit, new_ids = pipeline(folder, cuts=(2, 3))
    assert agree(ranks_of(resplit, new_ids, tmp_path), PROMPT) == 0
    ranks = ranks_of(*pipeline(folder), tmp_path)
    ranks[0].identity = "rank 0 loads other weights"  # rank 0 alone changed: every later rank's KV is stale too
    hashes = ranks[0].begin(PROMPT)
    assert ranks[1].on_lookup(hashes, [ranks[0].identity], len(hashes), B) == 0
    assert ranks[2].on_lookup(hashes, [ranks[0].identity, ids[1]], len(hashes), B) == 0


def test_a_short_prompt_is_neither_looked_up_nor_saved(folder, tmp_path):
    stages, ids = pipeline(folder)
    ranks = ranks_of(stages, ids, tmp_path)
    assert ranks[0].begin(PROMPT[:15]) == []
    prefill_and_save(stages, ranks, PROMPT[:15])
    assert not list(tmp_path.glob("*.kv"))


def test_the_prompts_last_token_is_always_prefilled(folder, tmp_path):
    """Its logits give the first new token: a prompt of exactly 5 blocks restores 4."""
    stages, ids = pipeline(folder)
    prefill_and_save(stages, ranks_of(stages, ids, tmp_path), PROMPT)
    fresh, _ = pipeline(folder)
    assert agree(ranks_of(fresh, ids, tmp_path), PROMPT[:5 * B]) == 4 * B


def test_a_request_without_blocks_to_save_forgets_the_last_ones(folder, tmp_path):
    """A long request cancelled before its first round, then a short one: the short one's KV must not be saved
    under the long prompt's blocks (rank 0 sends a Restore for every request)."""
    stages, ids = pipeline(folder)
    ranks = ranks_of(stages, ids, tmp_path)
    agree(ranks, PROMPT)  # the long request's Restore; no round follows
    short = [(i * 11 + 3) % 300 for i in range(12)]
    prefill_and_save(stages, ranks, short)
    assert not list(tmp_path.glob("*.kv"))
