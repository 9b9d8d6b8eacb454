"""Build a stage from a Hugging Face folder, materializing only the tensors that stage runs.

The full model is instantiated on the meta device (no memory), the stage's tensors are read one by
one from the safetensors files (sharded or single) and assigned in place, and the rest of the shell
is dropped. A rank therefore never holds the other rank's weights, not even briefly.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from model_parallel.stage import Stage

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model folder that cannot be used; the message says why and what to do."""


def load_config(folder: str | Path):
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        hint = "run `python -m model_parallel.fetch_weights` first" if "tandem" in str(folder) else "pass a local Hugging Face folder"
        raise ModelLoadError(f"model folder {folder} has no config.json ({'missing folder' if not folder.exists() else 'not a HF model folder'}); {hint}")
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ModelLoadError(f"{folder}: architecture {config.model_type!r} is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    config._attn_implementation = "sdpa"  # our boolean position mask is an sdpa mask
    return config


def checkpoint_index(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{folder} has no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are read)")
    with safe_open(single, "pt") as f:
        return {name: single for name in f.keys()}


def stage_tensor_names(config, first: int, last: int, embed: bool, head: bool, available) -> dict[str, str]:
    """Parameter name in the model -> tensor name in the checkpoint, for the stage's share."""
    wanted = {}
    prefixes = tuple(f"model.layers.{i}." for i in range(first, last))
    for name in available:
        if name.startswith(prefixes):
            wanted[name] = name
    if embed:
        wanted["model.embed_tokens.weight"] = "model.embed_tokens.weight"
    if head:
        wanted["model.norm.weight"] = "model.norm.weight"
        tied = getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in available
        # With tied embeddings the head *is* the embedding matrix: rank 1 reads it for its head
        # (a stage holding both, a drafter, shares one copy: see load_stage).
        if not (tied and embed):
            wanted["lm_head.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return wanted


def read_tensors(names: dict[str, str], index: dict[str, Path], dtype, device, progress: str | None):
    """Yield (param name, tensor) reading only the named tensors, file by file."""
    missing = [ckpt for ckpt in names.values() if ckpt not in index]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors this stage needs, e.g. {missing[0]!r}; is the folder complete?")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for param, ckpt in names.items():
        by_file.setdefault(index[ckpt], []).append((param, ckpt))
    bar = tqdm(total=len(names), desc=progress, unit="tensor", disable=progress is None, leave=False)
    for file, items in by_file.items():
        with safe_open(file, "pt", device="cpu") as f:
            for param, ckpt in items:
                yield param, f.get_tensor(ckpt).to(device=device, dtype=dtype)
                bar.update()
    bar.close()


def load_stage(folder: str | Path, first: int, last: int, embed: bool, head: bool,
               dtype: str = "float32", device: str = "cpu", progress: str | None = None,
               quant=None) -> Stage:
    """A stage with layers [first, last), plus the embeddings and/or norm + head.

    `quant` (optional) is a callable(layer_module) that replaces a layer's linears in place after its
    tensors arrived (NF4); it runs per layer so at most one full-precision layer exists at a time."""
    folder = Path(folder)
    config = load_config(folder)
    num_layers = config.num_hidden_layers
    if not 0 <= first < last <= num_layers:
        raise ModelLoadError(f"layer range [{first}, {last}) is outside the model's {num_layers} layers")
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    index = checkpoint_index(folder)
    names = stage_tensor_names(config, first, last, embed, head, index)
    params = dict(shell.named_parameters(remove_duplicate=False))
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ModelLoadError(f"{folder}: checkpoint tensor {unknown[0]!r} has no place in a {config.model_type} model; is config.json from the same model?")
    for param, tensor in read_tensors(names, index, torch_dtype, device, progress):
        expected = params[param].shape
        if tensor.shape != expected:
            raise ModelLoadError(f"{folder}: tensor {names[param]} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected)}; config and weights disagree")
        module_name, _, leaf = param.rpartition(".")
        module = shell.get_submodule(module_name)
        setattr(module, leaf, torch.nn.Parameter(tensor, requires_grad=False))
    if head and embed and "lm_head.weight" not in names:
        shell.lm_head.weight = shell.model.embed_tokens.weight
    layers = list(shell.model.layers[first:last])
    if quant is not None:
        for layer in layers:
            quant(layer)
    rotary = type(shell.model.rotary_emb)(config=config).to(device)  # built anew: its buffers are not in checkpoints
    stage = Stage(config, layers, first, rotary,
                  embed=shell.model.embed_tokens if embed else None,
                  norm=shell.model.norm if head else None,
                  head=shell.lm_head if head else None)
    still_meta = [n for n, p in stage.named_parameters() if p.is_meta]
    if still_meta:
        raise ModelLoadError(f"{folder}: no tensor in the checkpoint for {still_meta[0]}")
    return stage.eval()
