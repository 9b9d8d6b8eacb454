"""Quantized linears for a stage, made one layer at a time while the stage loads: NF4 (bitsandbytes 4-bit)
and int8 (weight-only, one scale per output channel).

The loader hands each layer over as soon as its tensors arrived; `quantize_linears` swaps the layer's
nn.Linear modules for quantized ones (the settings object says which: `NF4Settings` or `Int8Settings`) and
drops the full-precision weights before the next layer is read. A checkpoint saved by transformers already in
NF4 is rebuilt with `prequantized_linear`. A quantized module takes its training flag from the linear it
replaces: bitsandbytes repacks a 4-bit weight for its fast CPU kernel only in eval mode, and a stage timed
with modules left in training mode ran the slow unpacked path every step (the start-up estimate of an NF4
drafter read 3x its real step).

NF4 dtypes (the same as transformers' `from_pretrained(dtype=model.dtype, quantization_config=
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

Int8 (`Int8Linear`): w ~ q * scale, q int8 in [-127, 127], scale = max|w of the row| / 127 in model.dtype (one
per output channel), computed in the input's dtype. Why torch's own `torch._weight_int8pack_mm` and not torchao:
on CPU it is the kernel torchao's weight-only int8 reaches there too, and it reads one byte per weight (a 0.5B
decode step 137 -> 87 ms at one thread, bf16); torchao would add a dependency and a tensor subclass that the
CUDA graph capture and `weight_bytes` would have to see through, for no speed here. The kernel is fast for bf16 /
fp16 inputs on CPU over a few rows only (a decode step's, not a prompt chunk's: INT8_KERNEL_MAX_ROWS): with fp32
inputs it falls to a slow loop (6x an fp32 matmul), and its CUDA version is a
naive one-thread-per-output kernel (where it exists at all: torch 2.11 may lack it). Elsewhere Int8Linear
dequantizes and multiplies (a cast + one matmul: capturable in a CUDA graph, slower than the full-precision
weight unless torch.compile fuses it); draft.quant=auto times what runs and keeps what pays.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class NF4Settings:
    compute_dtype: torch.dtype = torch.bfloat16  # dtype of the 4-bit matmuls
    double_quant: bool = True  # quantize the per-block absmax too (~0.4 bits per weight saved)
    lm_head: bool = False  # quantize the LM head as well (transformers, too, keeps it by default)
    name = "nf4"

    def linear(self, linear: nn.Linear) -> nn.Module:
        return nf4_linear(linear, self)


@dataclass(frozen=True)
class Int8Settings:
    lm_head: bool = False  # quantize the LM head as well (a drafter's: see launch.plan.DRAFT_INT8_HEAD)
    name = "int8"

    def linear(self, linear: nn.Linear) -> nn.Module:
        return int8_linear(linear)


# Past this many rows the weight dequantized and one matmul beat the int8 kernel: the kernel is a matrix-vector loop,
# its time linear in the rows (one thread, bf16, a 0.5B drafter's 4864x896 MLP weight: 0.30 ms over 1 row, 1.70
# over 16, 55 over 512, where the cast and a bf16 matmul take 1.5, 2.0 and 6.0), so a prompt's chunk through an
# int8 drafter ran ~10x its bf16 cost (the embedded pair's 2,000-token prompt: ~12 s of a 20 s first token).
INT8_KERNEL_MAX_ROWS = 16


def int8_fast_kernel(x: torch.Tensor) -> bool:
    """Whether torch._weight_int8pack_mm is the fast path for `x` (see the module's docstring)."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and hasattr(torch, "_weight_int8pack_mm")
            and x.numel() // x.shape[-1] <= INT8_KERNEL_MAX_ROWS)


class Int8Linear(nn.Module):
    """y = x @ (q * scale).T + bias, q [out, in] int8, scale [out] in the model's dtype."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.bias = bias  # an nn.Parameter or None, shared with the linear it replaced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale.dtype == x.dtype else self.scale.to(x.dtype)
        if int8_fast_kernel(x):
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight, scale)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = nn.functional.linear(x, self.weight.to(x.dtype)) * scale
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight this module stands for, q * scale, in fp32 (exact: an 8-bit integer times a bf16 scale)."""
        return self.weight.float() * self.scale.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale in weight's dtype) with weight ~ q * scale[:, None], each row's absmax mapped to 127. The
    scale is rounded to its dtype first and q rounded against that rounded scale, so q * scale is the nearest
    int8 grid point to w: every weight within half a step (scale / 2) of its original."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(weight.dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def int8_linear(linear: nn.Linear) -> Int8Linear:
    """An Int8Linear holding `linear`'s weight in int8, on the weight's device; the bias is shared."""
    q, scale = int8_weight(linear.weight.data)
    module = Int8Linear(q, scale, linear.bias)
    return module.train(linear.training).requires_grad_(False)


def _empty_linear4bit(linear_in: int, linear_out: int, bias: bool, settings: NF4Settings,
                      double_quant: bool):
    # Built on meta: its own placeholder weight would otherwise cost a full-precision matrix.
    from bitsandbytes.nn import Linear4bit  # here, not at the top: int8 alone needs no bitsandbytes
    module = Linear4bit(linear_in, linear_out, bias=bias, compute_dtype=settings.compute_dtype,
                        compress_statistics=double_quant, quant_type="nf4", device="meta")
    module.requires_grad_(False)
    return module


def nf4_linear(linear: nn.Linear, settings: NF4Settings) -> nn.Module:
    """A Linear4bit holding `linear`'s weight in NF4, on the weight's device; the bias is shared."""
    from bitsandbytes.nn import Params4bit
    module = _empty_linear4bit(linear.in_features, linear.out_features, linear.bias is not None,
                               settings, settings.double_quant)
    weight = linear.weight.data
    module.weight = Params4bit(weight, requires_grad=False, compress_statistics=settings.double_quant,
                               quant_type="nf4", quant_storage=torch.uint8, module=module).to(weight.device)
    if linear.bias is not None:
        module.bias = linear.bias
    return module.train(linear.training)  # eval, as the linear was: bitsandbytes repacks only in eval mode


def quantize_linears(module: nn.Module, settings: NF4Settings | Int8Settings) -> int:
    """Replace every full-precision nn.Linear under `module` in place; returns how many."""
    plain = [(name, child) for name, child in module.named_modules() if type(child) is nn.Linear]
    for name, child in plain:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, settings.linear(child))
    return len(plain)  # the replaced fp weights are freed with `plain` on return


def prequantized_linear(like: nn.Linear, weight: torch.Tensor, stats: dict[str, torch.Tensor],
                        bias: torch.Tensor | None, settings: NF4Settings, device) -> nn.Module:
    """A Linear4bit in place of `like` (a meta nn.Linear of the shell) from a checkpoint's packed weight
    and its `weight.<stat>` tensors, keyed by the part after "weight." ("absmax", "quant_map",
    "quant_state.bitsandbytes__nf4", ...). Blocksize and double quantization come from the checkpoint."""
    from bitsandbytes.nn import Params4bit
    module = _empty_linear4bit(like.in_features, like.out_features, bias is not None, settings,
                               double_quant="nested_absmax" in stats)
    module.weight = Params4bit.from_prequantized(data=weight, quantized_stats=dict(stats), requires_grad=False,
                                                 device=device, module=module)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)
    return module


def quantized_shape(module: nn.Module) -> tuple[int, ...] | None:
    """The full-precision shape a Linear4bit's weight stands for (None for other modules)."""
    if getattr(getattr(module, "weight", None), "quant_state", None) is not None:
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
