"""Each supported family, split across two ranks, is token-identical to transformers generate in fp32:
with K=0, with the n-gram drafter (mostly rejected: the rewind path) and with a model drafter of the
same family (the target itself: every draft accepted, the bonus token). Tiny random models built from
each family's config, saved with save_pretrained and read back through the real loader.

A family that keeps state no position can rewind (hybrid linear attention) is refused in one line."""
import json

import pytest
import torch
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, GenerationConfig, MistralConfig, Phi3Config,
                          Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

from model_parallel.loader import ModelLoadError, load_config
from tests.support.tiny_models import ids_arg, randomize_norms, reference_greedy, run_pair

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
MAX_NEW = 14
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)

FAMILIES = {
    "qwen3": lambda: Qwen3Config(head_dim=16, tie_word_embeddings=False, **COMMON),
    # transformers 5 fuses the experts' checkpoint tensors on load: the loader must apply its conversion
    # 12 experts: ten or more, so experts ordered as strings ("10" < "2") land in the wrong place
    "qwen3_moe": lambda: Qwen3MoeConfig(head_dim=16, num_experts=12, num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True, tie_word_embeddings=False, **COMMON),
    # sliding and global layers with two rotary bases; a window shorter than prompt + output, so it bites.
    # (Untied and a smaller init: with Gemma's sqrt(hidden)-scaled embeddings tied to the head, each token's
    # own embedding decides the argmax and no mask change shows.)
    "gemma3_text": lambda: Gemma3TextConfig(head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                                            **{**COMMON, "initializer_range": 0.1}, tie_word_embeddings=False,
                                            layer_types=["sliding_attention", "full_attention"] * 2,
                                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    # one window for every layer (the cache's own mask), shorter than prompt + output so it bites
    "mistral": lambda: MistralConfig(head_dim=16, sliding_window=6, tie_word_embeddings=False, **COMMON),
    "phi3": lambda: Phi3Config(tie_word_embeddings=False, **COMMON),
    # layer 2 runs without rotary embeddings (SmolLM3's NoPE layers)
    "smollm3": lambda: SmolLM3Config(no_rope_layers=[1, 1, 0, 1], tie_word_embeddings=True, **COMMON),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    torch.manual_seed(3)
    config = FAMILIES[request.param]()
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_norms(model)
    with torch.no_grad():  # decisive greedy choices (fewer near-ties): parity tests the code, not rounding
        model.get_output_embeddings().weight.mul_(4.0 if not config.tie_word_embeddings else 2.0)
    model.generation_config = GenerationConfig(eos_token_id=None, do_sample=False)
    folder = tmp_path_factory.mktemp(request.param) / "model"
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == request.param
    return folder


def family_args(folder, k: int, drafter: str) -> list[str]:
    args = [f"model.target={folder}", "model.dtype=float32", "model.split=2", f"spec.k={k}", "spec.adaptive=false",
            f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}"]
    if drafter == "model":
        return args + ["draft.kind=model", f"draft.model={folder}", "draft.dtype=float32"]
    return args + [f"draft.kind={drafter}"]


@pytest.mark.parametrize("k, drafter", [(0, "none"), (3, "ngram"), (3, "model")])
def test_family_split_matches_generate(family_model, k, drafter):
    out = run_pair(*family_args(family_model, k, drafter))
    assert out["token_ids"] == reference_greedy(family_model, PROMPT, MAX_NEW)
    if drafter == "model":  # the target drafting for itself: the accept-all and bonus-token paths ran
        assert out["stats"]["acceptance_rate"] == 1.0


def test_a_qwen3_moe_checkpoint_stores_experts_unfused(family_model):
    """The qwen3_moe parity above means something only if the checkpoint really has per-expert tensors
    (the names transformers renames while loading)."""
    if load_config(family_model).model_type != "qwen3_moe":
        pytest.skip("qwen3_moe only")
    names = json.loads((family_model / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (family_model / "model.safetensors").read_bytes()[:8], "little")])
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in names


@pytest.mark.parametrize("model_type, layer_types", [("qwen3_next", ["linear_attention", "full_attention"]),
                                                     ("some_new_hybrid", ["full_attention", "mamba"])])
def test_recurrent_families_are_refused_in_one_line(tmp_path, model_type, layer_types):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type=model_type, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=320,
        layer_types=layer_types)))
    with pytest.raises(ModelLoadError) as caught:
        load_config(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and model_type in message and "rewound" in message
