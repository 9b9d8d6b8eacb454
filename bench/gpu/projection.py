"""Tokens per second in the seed's setting (Qwen2.5-7B over two T4s, ~86 ms round trip, a 0.5B drafter),
projected from the costs measured here and the acceptance measured on the CPU with the real weights.

    round_ms   = draft_ms(K) + L * layer_ms(K+1) + head_ms(K+1) + rtt_ms + overhead_ms
    tokens/s   = 1000 * tokens_per_round / round_ms

draft_ms, layer_ms and head_ms come from this device (graph-captured draft step when there is one); L = 28
layers; overhead_ms is what the real entry's measured round at 0 ms spends beyond its draft and layers (gloo,
Python); tokens_per_round is 3.97, what the embedded Qwen2.5-Coder pair commits per round on the CPU (README).
A T4 is far slower than this device: its memory bandwidth is 320 GB/s, so the memory-bound decode costs are
also given scaled by this device's bandwidth over the T4's (an estimate, said so). This is a projection, not
a measurement of two T4s.
"""
from __future__ import annotations

SEED = {"avg_tokens_per_s": 20.31, "peak_tokens_per_s": 28.10, "rtt_ms": 86.0, "layers": 28}
TOKENS_PER_ROUND_CPU = 3.97  # README: the quick start's tokens/round with the real weights (K=4, adaptive)
T4_BANDWIDTH_GBS = 320.0
BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0, "T4": 320.0}


def device_bandwidth(name: str) -> float | None:
    return next((gbs for key, gbs in BANDWIDTH_GBS.items() if key in name), None)


def project(draft_ms: float, layer_ms: float, head_ms: float, overhead_ms: float, device_name: str) -> dict:
    layers, rtt = SEED["layers"], SEED["rtt_ms"]
    compute = draft_ms + layers * layer_ms + head_ms
    here = 1000 * TOKENS_PER_ROUND_CPU / (compute + rtt + overhead_ms)
    bandwidth = device_bandwidth(device_name)
    scale = bandwidth / T4_BANDWIDTH_GBS if bandwidth else None
    on_t4 = 1000 * TOKENS_PER_ROUND_CPU / (compute * scale + rtt + overhead_ms) if scale else None
    return {
        "formula": "tokens/s = 1000 * tokens_per_round / (draft_ms + L*layer_ms + head_ms + rtt_ms + overhead_ms)",
        "inputs": {"draft_ms": draft_ms, "layer_ms_k_plus_1": layer_ms, "L": layers, "head_ms": head_ms, "rtt_ms": rtt,
                   "overhead_ms": overhead_ms, "tokens_per_round": TOKENS_PER_ROUND_CPU, "device": device_name,
                   "t4_scale_by_bandwidth": scale},
        "tokens_per_s_this_device": here,
        "tokens_per_s_t4_estimate": on_t4,
        "seed": SEED,
    }
