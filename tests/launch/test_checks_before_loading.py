"""Issue 16: vocabulary and capacity are checked from config.json, the tokenizers and the safetensors
headers before rank 0 loads any weights: one line naming the cause, never an IndexError mid-run."""
import json

import pytest

from launch import ranks as lives
from launch.config import ConfigError
from model_parallel.loader import ModelLoadError
from tests.support.tiny_models import VOCAB, ids_arg, run_pair, save_tiny, save_tiny_tokenizer


@pytest.fixture
def loads(monkeypatch):
    """The ranks whose stage build_stage was asked for (rank 0 must not get there)."""
    ranks = []
    real = lives.build_stage

    def recording(plan):
        ranks.append(plan.rank)
        return real(plan)
    monkeypatch.setattr(lives, "build_stage", recording)
    return ranks


def with_tokenizer(folder, **extra):
    save_tiny(folder, "qwen2", **extra)
    save_tiny_tokenizer(folder)
    return folder


def run(target, draft=None, *extra):
    drafting = [f"draft.kind=model", f"draft.model={draft}", "draft.dtype=float32"] if draft else ["draft.kind=ngram"]
    return run_pair(f"model.target={target}", "model.dtype=float32", "model.split=2", *drafting,
                    f"prompt_ids={ids_arg([5, 6, 7])}", "gen.max_new_tokens=4", *extra, timeout_s=30)


def test_a_drafter_with_another_vocab_size_is_refused_before_loading(tmp_path, loads):
    target = with_tokenizer(tmp_path / "target", seed=1)
    draft = with_tokenizer(tmp_path / "draft", seed=2, layers=2, seed_vocab=VOCAB + 80)  # same tokenizer files
    with pytest.raises(ConfigError, match="draft vocab_size 400") as e:
        run(target, draft)
    assert "\n" not in str(e.value) and 0 not in loads


def test_a_smaller_padded_drafter_vocab_is_accepted(tmp_path):
    target = with_tokenizer(tmp_path / "target", seed=1, seed_vocab=VOCAB + 64)  # padding rows, as 7B vs 0.5B
    draft = with_tokenizer(tmp_path / "draft", seed=2, layers=2)
    assert len(run(target, draft)["token_ids"]) == 4


def test_embedding_rows_that_disagree_with_config_are_refused_before_loading(tmp_path, loads):
    target = save_tiny(tmp_path / "target", "qwen2", seed=1)
    config = json.loads((target / "config.json").read_text())
    config["vocab_size"] = VOCAB + 16
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="model.embed_tokens.weight has 320 rows but config.json's vocab_size is 336"):
        run(target)
    assert 0 not in loads


def test_a_prompt_that_cannot_fit_is_refused_before_loading(tmp_path, loads):
    target = save_tiny(tmp_path / "target", "qwen2", seed=1)
    with pytest.raises(ConfigError, match="model.max_len"):
        run(target, None, "model.max_len=8")
    assert 0 not in loads
