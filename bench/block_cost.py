"""How a block of tokens costs against one token on this machine: one MLP-sized matmul of the embedded
target (Qwen2.5-Coder-1.5B: 8960 x 1536), 1 thread, in bf16 and fp32. Speculation pays only where a
block of K+1 costs much less than K+1 single tokens.

    python bench/block_cost.py
"""
from __future__ import annotations

import time

import torch


def ms(weight: torch.Tensor, tokens: int, repeats: int = 20) -> float:
    x = torch.randn(tokens, weight.shape[1], dtype=weight.dtype)
    for _ in range(3):
        torch.nn.functional.linear(x, weight)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, weight)
    return (time.perf_counter() - t0) / repeats * 1000


def main() -> None:
    torch.set_num_threads(1)
    print(f"# {torch.backends.cpu.get_cpu_capability()}, 1 thread, one 8960x1536 linear")
    print("| dtype | " + " | ".join(f"{n} tok ms" for n in (1, 2, 5, 9)) + " | 5 tok / 1 tok |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.randn(8960, 1536, dtype=dtype)
        t = [ms(weight, n) for n in (1, 2, 5, 9)]
        print(f"| {str(dtype).split('.')[-1]} | " + " | ".join(f"{v:.2f}" for v in t) + f" | {t[2] / t[0]:.1f}x |")


if __name__ == "__main__":
    main()
