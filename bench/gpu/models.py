"""Random models in the real shapes, built from configs alone (the GPU machine can download nothing).

The shapes are the published configs' (Qwen2.5-0.5B as the drafter, Qwen2.5-7B and Qwen2.5-32B as targets), with
fewer layers: a cost per layer is measured over a few and scaled by the real layer count (said so in the report).
`--dry-run` uses TINY instead, on the CPU.
"""
from __future__ import annotations

from pathlib import Path

import torch

QWEN = dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
            tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
SHAPES = {  # hidden, intermediate, heads, kv heads, vocab, layers (the real count)
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, num_hidden_layers=24),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, num_hidden_layers=28),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_attention_heads=40, num_key_value_heads=8,
                        vocab_size=152064, num_hidden_layers=64),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            num_hidden_layers=4)


def qwen_config(shape: dict, layers: int | None = None):
    from transformers import Qwen2Config
    fields = dict(QWEN, **shape)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    fields.pop("model_type")
    config = Qwen2Config(**fields)
    config._attn_implementation = "sdpa"  # as model_parallel.loader.load_config sets it
    return config


def random_model(shape: dict, layers: int | None, device: str, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    """A Qwen2ForCausalLM with random weights, built on `device`. `scale` multiplies the head: random weights
    give flat logits, and a tiny parity model wants decisive greedy choices (fewer near-ties)."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = qwen_config(shape, layers)
    config.initializer_range = 0.3 if shape is TINY else 0.02
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights: a norm that is never read would show
                p.uniform_(0.5, 1.5)
        model.lm_head.weight.mul_(scale)
    return model


def save(model, folder: Path) -> str:
    model.save_pretrained(folder)
    return str(folder)


def layers_stage(model):
    """The product's Stage over `model`'s layers alone (as model_parallel.loader builds a middle rank's)."""
    from model_parallel.stage import Stage
    return Stage(model.config, list(model.model.layers), 0, model.model.rotary_emb)
