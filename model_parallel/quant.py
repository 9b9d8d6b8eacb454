"""NF4 (bitsandbytes 4-bit) linears for a stage, made one layer at a time while the stage loads.

The loader hands each layer over as soon as its tensors arrived; `quantize_linears` swaps the layer's
nn.Linear modules for bitsandbytes `Linear4bit` and drops the full-precision weights before the next
layer is read. A checkpoint saved by transformers already in NF4 is rebuilt with `prequantized_linear`.

Dtypes (the same as transformers' `from_pretrained(dtype=model.dtype, quantization_config=
BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=...))`):
- A weight is cast to model.dtype first and then quantized by the very call transformers makes
  (`Params4bit(w).to(device)`: blocks of 64, NF4, absmax optionally double-quantized), so both give
  the same bytes.
- Everything that is not a 4-bit linear (embeddings, norms, biases, a full-precision head) and the
  hidden states between layers stay in model.dtype; so does the KV cache.
- A Linear4bit casts its input to quant_compute_dtype, multiplies by the weight dequantized in that
  dtype and casts the product back to model.dtype.
On a CPU with AVX512-BF16, bitsandbytes repacks each 4-bit weight on its first forward (about 10 s
for half of a 1.5B model on 2 cores): the first token pays for it, not the load.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn
from bitsandbytes.nn import Linear4bit, Params4bit


@dataclass(frozen=True)
class NF4Settings:
    compute_dtype: torch.dtype = torch.bfloat16  # dtype of the 4-bit matmuls
    double_quant: bool = True  # quantize the per-block absmax too (~0.4 bits per weight saved)
    lm_head: bool = False  # quantize the LM head as well (transformers, too, keeps it by default)


def _empty_linear4bit(linear_in: int, linear_out: int, bias: bool, settings: NF4Settings,
                      double_quant: bool) -> Linear4bit:
    # Built on meta: its own placeholder weight would otherwise cost a full-precision matrix.
    module = Linear4bit(linear_in, linear_out, bias=bias, compute_dtype=settings.compute_dtype,
                        compress_statistics=double_quant, quant_type="nf4", device="meta")
    module.requires_grad_(False)
    return module


def nf4_linear(linear: nn.Linear, settings: NF4Settings) -> Linear4bit:
    """A Linear4bit holding `linear`'s weight in NF4, on the weight's device; the bias is shared."""
    module = _empty_linear4bit(linear.in_features, linear.out_features, linear.bias is not None,
                               settings, settings.double_quant)
    weight = linear.weight.data
    module.weight = Params4bit(weight, requires_grad=False, compress_statistics=settings.double_quant,
                               quant_type="nf4", quant_storage=torch.uint8, module=module).to(weight.device)
    if linear.bias is not None:
        module.bias = linear.bias
    return module


def quantize_linears(module: nn.Module, settings: NF4Settings) -> int:
    """Replace every full-precision nn.Linear under `module` in place; returns how many."""
    plain = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear]
    for name, child in plain:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, nf4_linear(child, settings))
    return len(plain)  # the replaced fp weights are freed with `plain` on return


def prequantized_linear(like: nn.Linear, weight: torch.Tensor, stats: dict[str, torch.Tensor],
                        bias: torch.Tensor | None, settings: NF4Settings, device) -> Linear4bit:
    """A Linear4bit in place of `like` (a meta nn.Linear of the shell) from a checkpoint's packed weight
    and its `weight.<stat>` tensors, keyed by the part after "weight." ("absmax", "quant_map",
    "quant_state.bitsandbytes__nf4", ...). Blocksize and double quantization come from the checkpoint."""
    module = _empty_linear4bit(like.in_features, like.out_features, bias is not None, settings,
                               double_quant="nested_absmax" in stats)
    module.weight = Params4bit.from_prequantized(data=weight, quantized_stats=dict(stats), requires_grad=False,
                                                 device=device, module=module)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)
    return module


def quantized_shape(module: nn.Module) -> tuple[int, ...] | None:
    """The full-precision shape a Linear4bit's weight stands for (None for other modules)."""
    if isinstance(module, Linear4bit) and module.weight.quant_state is not None:
        return tuple(module.weight.quant_state.shape)
    return None


def stored_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers, and each 4-bit weight's quantization state (absmax, code tables,
    offset, nested state)."""
    tensors = []
    for t in [*module.parameters(), *module.buffers()]:
        tensors.append(t)
        state = getattr(t, "quant_state", None)
        while state is not None:
            tensors += [x for x in (state.absmax, state.code, state.offset) if isinstance(x, torch.Tensor)]
            state = state.state2
    return tensors


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, counting a 4-bit weight's packed data and its
    quantization state, shared tensors once.

    A tensor is known by its storage, where in it it starts and how many bytes it spans: a bare address
    (data_ptr) is shared by a view and its base, and by a tensor and whatever is later allocated where a
    freed one was. Every tensor counted is held in `tensors` until the count is done, so no address can
    be freed and reused while counting."""
    tensors = stored_tensors(module)
    spans = {(t.device, t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(), t.numel() * t.element_size())
             for t in tensors}
    return sum(span[-1] for span in spans)


def return_freed_heap() -> None:
    """Hand freed heap memory back to the OS (glibc; elsewhere a no-op).

    Quantizing one matrix on CPU makes several fp32/int32 temporaries of its size; glibc keeps what
    they leave behind in its heap, so without this a rank's RSS after loading would be about twice
    its 4-bit weights and its peak would grow with every layer."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
