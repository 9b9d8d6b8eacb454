"""Verification on rank 1: given the target's logits at the K+1 positions [last, d1..dK] and the
K drafts, decide how many drafts to keep and which token comes next.

Greedy: the longest prefix of drafts equal to the target's argmax, then the target's own token.
Sampling: rejection sampling (Leviathan et al. 2023; Chen et al. 2023): keep d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from normalize(max(0, p_i - q_i)); if all K
are kept, draw the bonus token from p_{K+1}. The committed tokens are then distributed exactly as the
target's own samples, whatever the drafter's q is, so q may be a sparse top-k distribution (it has to
cross the network) and a deterministic drafter is just a one-hot q.
"""
from __future__ import annotations

import torch


MIN_TEMPERATURE = 1e-6  # a smaller T (1e-300 is a valid request) is 0 in float32: scores become NaN. Below
# this every float32 logit gap beyond ~1e-5 is one-hot already, so nothing a float32 sampler can show is lost.


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T), restricted to the top-p nucleus."""
    logits = logits.float()
    # the max subtracted first, so a small T cannot overflow the scores to inf (softmax of inf is NaN)
    probs = torch.softmax((logits - logits.amax(-1, keepdim=True)) / max(temperature, MIN_TEMPERATURE), dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep a token while the mass before it is < top_p (the most likely token is always kept)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        drop[..., 0] = False  # also when top_p is below float32's range (1e-300 is a valid request) and compares as 0
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """logits [K+1, V], drafts [K] -> (accepted, next token)."""
    best = logits.argmax(-1)
    k = drafts.numel()
    accepted = int((best[:k] == drafts).long().cumprod(0).sum()) if k else 0
    return accepted, int(best[accepted])


def verify_sampled(probs: torch.Tensor, drafts: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                   generator: torch.Generator) -> tuple[int, int]:
    """probs [K+1, V] (target, after temperature/top-p); drafts [K]; the draft distributions as sparse
    rows q_ids/q_probs [K, m] (token ids and their probabilities; the rest of q is 0)."""
    for i, token in enumerate(drafts.tolist()):
        q = torch.zeros_like(probs[i]).index_add_(0, q_ids[i], q_probs[i].float())
        p_tok, q_tok = float(probs[i, token]), float(q[token])
        if q_tok <= 0:
            raise ValueError(f"draft token {token} has probability 0 under its own draft distribution")
        if torch.rand((), generator=generator).item() * q_tok < p_tok:  # u < p/q, without dividing
            continue
        residual = (probs[i] - q).clamp_(min=0)
        if residual.sum() <= 0:  # p == q exactly: p is then the residual's limit
            residual = probs[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    k = drafts.numel()
    return k, int(torch.multinomial(probs[k], 1, generator=generator))
