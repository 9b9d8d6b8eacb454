"""model.max_memory: what a rank may hold, and what a stage will hold, in bytes, before any weight is read.

A stage's bytes are computed from the model's tensor shapes (the model built on the meta device from
config.json: the shapes the loader checks every checkpoint tensor against) and the dtype it is loaded
in. NF4 counts what bitsandbytes stores per linear weight: the packed 4-bit data (half a byte per
weight), one absmax per block of 64 (fp32, or with double quantization uint8 plus an fp32 absmax per
256 blocks and a 256-entry code table), its 16-entry NF4 code table and offset. The KV cache is what
kvcache/static_cache.py allocates: keys and values [slots, kv_heads, max_len, head_dim] per layer, one
slot per request served at once (serve.max_concurrent), and a length per slot.

A rank's budget is model.max_memory (one size for every rank, or one per rank); unset, it is what the
rank's device has free (CUDA: mem_get_info; CPU: MemAvailable shared by the ranks on this host) less
HEADROOM, kept for activations, the allocator's slack and the runtime itself.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

HEADROOM = 0.10  # of the free memory, left out of an unset budget
NF4_BLOCK, NESTED_BLOCK = 64, 256  # bitsandbytes' blocksizes (weights; absmax under double quantization)
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SLOT_LENGTH = 8  # a slot's length in the cache: one int64
MAX_SIZE = 2**50  # 1 PiB: more than any host holds, so a larger model.max_memory is a typo, not a budget


def parse_size(value, key: str = "model.max_memory") -> int:
    """Bytes from 123456, "500MB" (10^6), "6GiB" (2^30), "1.5 GB"; a ValueError naming `key` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not a size: give bytes or a size with a unit such as 500MB or 6GiB")
    if isinstance(value, (int, float)):
        nbytes = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match and match.group(2).lower()
        if not match or unit not in UNITS:
            raise ValueError(f"{key}={value!r} is not a size: give bytes or a size with a unit such as 500MB or 6GiB "
                             f"(units: {', '.join(u for u in UNITS if u)}, case-insensitive)")
        nbytes = float(match.group(1)) * UNITS[unit]
    if not 0 < nbytes <= MAX_SIZE:  # NaN fails too; inf or 1e400 would reach int() as infinity
        raise ValueError(f"{key}={value!r} is not a size between 1 byte and 1 PiB")
    return int(nbytes)


def free_bytes(device: str, local_ranks: int = 1) -> tuple[int, str]:
    """(bytes free on `device` for this rank, how that was found)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"free on {device}"
    available = _meminfo("MemAvailable")
    if local_ranks > 1:
        return available // local_ranks, f"MemAvailable / {local_ranks} ranks on this host"
    return available, "MemAvailable"


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def rank_budget(setting, rank: int, world: int, device: str) -> tuple[int, str]:
    """(bytes rank `rank` may hold, where that figure came from) for model.max_memory=`setting`: one size
    for every rank, a list with one per rank (null in it: that rank's free memory), or None."""
    key = "model.max_memory"
    if setting is not None and not isinstance(setting, (str, int, float)):
        values = list(setting)
        if len(values) != world:
            raise ValueError(f"model.max_memory lists {len(values)} sizes for {world} ranks: give one per rank, "
                             f"or one size for all")
        setting, key = values[rank], f"model.max_memory[{rank}]"
    if setting is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if not device.startswith("cuda") else 1
        free, how = free_bytes(device, local)
        return int(free * (1 - HEADROOM)), f"{how}, less {HEADROOM:.0%}"
    return parse_size(setting, key), key


# --- what a stage holds -------------------------------------------------------------------------

def nf4_bytes(numel: int, double_quant: bool) -> int:
    """Bytes bitsandbytes keeps for one NF4-quantized weight of `numel` elements (checked against
    Params4bit in the tests): packed data, absmax per block, code table (16 fp32) and offset."""
    blocks = math.ceil(numel / NF4_BLOCK)
    packed, code = math.ceil(numel / 2), 16 * 4
    if not double_quant:
        return packed + blocks * 4 + code
    nested = math.ceil(blocks / NESTED_BLOCK) * 4 + 256 * 4  # fp32 absmax per 256 blocks, the 8-bit code table
    return packed + blocks + code + 4 + nested  # absmax as uint8, the offset one fp32


def int8_bytes(rows: int, cols: int, size: int) -> int:
    """Bytes an Int8Linear keeps for a [rows, cols] weight: the int8 matrix and a scale per row (`size` bytes)."""
    return rows * cols + rows * size


def linear_bytes(weight: torch.Tensor, size: int, quant, double: bool) -> int:
    """Bytes of one linear weight (of the meta shell) as loaded: full precision, NF4 or int8."""
    name = getattr(quant, "name", None)
    if name == "nf4":
        return nf4_bytes(weight.numel(), double)
    if name == "int8":
        return int8_bytes(weight.shape[0], weight.shape[1], size)
    return weight.numel() * size


@dataclass(frozen=True)
class ModelBytes:
    """Bytes of a model's parts as loaded: `layers[i]` is layer i's weights, `cache_per_layer` its KV
    cache at max_len; `embed` the embeddings, `norm` + `head` the final norm and the LM head (a head tied
    to the embeddings is the same matrix on a stage holding both, a copy on one that does not)."""
    layers: list[int]
    embed: int
    norm: int
    head: int
    cache_per_layer: int  # one slot's keys and values of one layer
    cache_fixed: int  # the cache's position bookkeeping (the positions, the first row's id), per stage
    rotary: int  # the rotary embedding's buffers, per stage
    tied: bool

    def stage(self, first: int, last: int, embed: bool, head: bool, slots: int = 1) -> int:
        """Bytes of a stage with layers [first, last) (and the embeddings / norm + head), its cache of
        `slots` slots included."""
        total = sum(self.layers[first:last]) + slots * self.slot(first, last) + self.cache_fixed + self.rotary
        if embed:
            total += self.embed
        if head:
            total += self.norm + (0 if self.tied and embed else self.head)
        return total

    def slot(self, first: int, last: int) -> int:
        """One slot of the cache of layers [first, last): every layer's keys and values, and its length."""
        return (last - first) * self.cache_per_layer + SLOT_LENGTH

    def layer(self) -> int:
        """One layer with one slot's cache (the largest, should layers differ)."""
        return max(self.layers) + self.cache_per_layer


def model_bytes(model, quant, max_len: int) -> ModelBytes:
    """Bytes of every part of `model` (a loader.ModelSource: config.json and the meta-device shell, in its
    dtype) as loaded (quant: NF4Settings, Int8Settings or None), with KV caches of `max_len` tokens. Reads no weight."""
    from model_parallel.loader import DTYPES
    config, shell = model.config, model.shell
    size = DTYPES[model.dtype].itemsize
    double = _double_quant(config, quant)
    layers = [_module_bytes(layer, size, quant, double) for layer in shell.model.layers]
    embed = shell.model.embed_tokens.weight.numel() * size
    tied = getattr(config, "tie_word_embeddings", False)
    head = linear_bytes(shell.lm_head.weight, size, quant if quant is not None and quant.lm_head else None, double)
    norm = sum(p.numel() for p in shell.model.norm.parameters()) * size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    cache_per_layer = 2 * kv_heads * max_len * head_dim * size  # keys and values, in the stage's dtype
    rotary = sum(b.numel() * b.element_size() for b in shell.model.rotary_emb.buffers())
    return ModelBytes(layers, embed, norm, head, cache_per_layer, max_len * 8 + 8, rotary, tied)  # int64 positions


def _double_quant(config, quant) -> bool:
    qc = getattr(config, "quantization_config", None)  # a checkpoint saved in NF4 keeps its own setting
    if qc is not None:
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        return bool(qc.get("bnb_4bit_use_double_quant", False))
    return bool(getattr(quant, "double_quant", False))


def _module_bytes(module: torch.nn.Module, size: int, quant, double: bool) -> int:
    """A layer's parameters: its linears' weights in NF4 or int8 when quantized, everything else in the dtype."""
    total = 0
    for sub in module.modules():
        for leaf, p in sub.named_parameters(recurse=False):
            if quant is not None and type(sub) is torch.nn.Linear and leaf == "weight":
                total += linear_bytes(p, size, quant, double)
            else:
                total += p.numel() * size
    return total
