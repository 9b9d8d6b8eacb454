"""Int8 weights (model.quant=int8, draft.quant=int8): what Int8Linear computes, what a stage loaded in int8 holds
and what the memory estimate says it holds, and the target's stages in int8 giving transformers generate's tokens
of the model whose weights are the int8 ones (lossy against the float model, like NF4: docs/exactness.md)."""
from __future__ import annotations

import pytest
import torch

from model_parallel.loader import ModelSource, load_stage
from model_parallel.memory import int8_bytes, model_bytes
from model_parallel.quant import Int8Linear, Int8Settings, NF4Settings, int8_linear, quantize_linears, weight_bytes
from tests.support.tiny_models import ids_arg, load_reference, run_pair

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5]


@pytest.mark.parametrize("dtype,rel,rows", [(torch.float32, 1e-6, 5), (torch.bfloat16, 2**-8, 5),
                                           (torch.bfloat16, 2**-8, 40)])
def test_int8_linear_is_the_float_linear_within_half_a_step_per_weight(dtype, rel, rows):
    """Each weight is within half a quantization step (its row's scale / 2) of the float one, so each output is within
    sum|x| * scale / 2 of the float linear's; and the module computes x @ (q * scale).T + b to the rounding of its
    dtype (bf16 over 15 rows runs torch's int8 kernel; fp32, and bf16 over a prompt chunk's 120, dequantize: every
    path)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=True).to(dtype).eval()
    module = int8_linear(linear)
    assert module.weight.dtype == torch.int8 and module.scale.shape == (160,) and not module.training
    w, deq, scale = linear.weight.double(), module.dequantized().double(), module.scale.double()
    assert ((deq - w).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert (module.weight.abs().amax(1) == 127).all()  # every row uses the whole grid
    x = torch.randn(3, rows, 96).to(dtype)
    y = module(x).double()
    exact = x.double() @ deq.T + linear.bias.double()
    size = x.double().abs() @ deq.abs().T + linear.bias.double().abs()
    assert ((y - exact).abs() <= rel * size).all()
    full = x.double() @ w.T + linear.bias.double()
    assert ((full - exact).abs() <= x.double().abs().sum(-1, keepdim=True) * scale / 2 * (1 + 1e-6)).all()


def test_int8_kernel_for_a_decode_step_a_dequantized_matmul_for_a_prompt_chunk(monkeypatch):
    """torch's int8 kernel is a matrix-vector loop, its time linear in the rows (one thread: 55 ms over 512 rows of a
    0.5B drafter's MLP weight, where a bf16 matmul takes 4): over a prompt's chunk Int8Linear dequantizes the weight
    and multiplies once; over a decode step's few rows it runs the kernel."""
    calls = []
    kernel = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    module = int8_linear(torch.nn.Linear(64, 32).to(torch.bfloat16).eval())
    for rows in (1, 5, 16, 17, 512):
        module(torch.randn(1, rows, 64, dtype=torch.bfloat16))
    assert calls == [1, 5, 16]


def test_a_quantized_module_takes_the_eval_mode_of_the_linear_it_replaces():
    """bitsandbytes repacks a 4-bit weight for its fast CPU kernel only in eval mode: the start-up timing of an NF4
    drafter built its modules in training mode and timed the slow path (997 ms estimated per round, 336 run)."""
    for settings in (NF4Settings(torch.float32), Int8Settings()):
        layer = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).eval()
        quantize_linears(layer, settings)
        assert all(not m.training for m in layer.modules()), settings.name


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_stage_holds_what_the_estimate_says(family, dtype, tiny_qwen, tiny_llama):
    """The estimate counts a byte per weight and a scale per output row (model_parallel.memory); a loaded int8 stage
    holds exactly that for its layers, and its linears' weights are under half their bytes in bf16."""
    folder = tiny_qwen if family == "qwen2" else tiny_llama
    quant = Int8Settings(lm_head=True)
    estimate, plain = (model_bytes(ModelSource.open(folder, dtype), q, max_len=32) for q in (quant, None))
    stage = load_stage(folder, 0, 4, embed=True, head=True, dtype=dtype, quant=quant)
    linears = [m for m in stage.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * 7 + (family == "qwen2")  # every layer's 7 linears; a tied head stays the embeddings
    assert sum(weight_bytes(layer) for layer in stage.layers) == sum(estimate.layers)
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    assert all(weight_bytes(m) - (m.bias.numel() * size if m.bias is not None else 0)
               == int8_bytes(m.out_features, m.in_features, size) for m in linears)
    if family == "qwen2":
        assert weight_bytes(stage.head) == estimate.head < plain.head / size * 1.1
    else:
        assert stage.head.weight is stage.embed.weight
    weights = sum(m.weight.numel() for m in linears)
    assert sum(weight_bytes(m) for m in linears) < weights * 2 / 2 * 1.1  # ~half of bf16's 2 bytes per weight


def int8_reference(folder):
    """transformers' model of `folder` with every decoder linear's weight replaced by its int8 one, dequantized."""
    model = load_reference(folder)
    with torch.no_grad():
        for layer in model.model.layers:
            for m in layer.modules():
                if type(m) is torch.nn.Linear:
                    m.weight.copy_(int8_linear(m).dequantized())
    return model


def test_target_stages_in_int8_give_generate_s_tokens_of_the_int8_weights(tiny_qwen):
    """model.quant=int8 on both ranks (the head in full precision, model.quant_lm_head=false) is lossy against the
    float model but exact against the model it stands for: generate over the dequantized int8 weights."""
    n = 20
    expected = int8_reference(tiny_qwen).generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[0, len(PROMPT):]
    out = run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "model.quant=int8", "draft.kind=ngram", "spec.k=3",
                   f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={n}", "model.split=2")
    assert out["token_ids"] == expected.tolist()
