"""Verification on the last rank: given the target's logits at the K+1 positions [last, d1..dK] and the
K drafts, decide how many drafts to keep and which token comes next.

Greedy: the longest prefix of drafts equal to the target's argmax, then the target's own token.
Sampling: rejection sampling (Leviathan et al. 2023; Chen et al. 2023): keep d_i with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from normalize(max(0, p_i - q_i)); if all K
are kept, draw the bonus token from p_{K+1}. The committed tokens are then distributed exactly as the
target's own samples, whatever the drafter's q is, so q may be a sparse top-k distribution (it has to
cross the network) and a deterministic drafter is just a one-hot q.

With a grammar (structured outputs, speculative.grammar) the target's logits at each verified position are
masked first (-inf where the grammar refuses the token; then temperature and top-p, the order of transformers'
generate with the grammar as a logits processor), and the grammar advances through the drafts as they are kept:
a draft the grammar refuses has target probability 0 (never kept), and the tokens that come out are the
target's own under the grammar. The grammar ends having consumed exactly the committed tokens.

Log-probabilities (token_logprobs) are the target's raw ones: log_softmax of its logits at T=1, before
temperature, top-p and the grammar's mask, as transformers' log_softmax of the same model gives them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from speculative.grammar import Grammar


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


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, grammar: Grammar | None = None) -> tuple[int, int]:
    """logits [K+1, V], drafts [K] -> (accepted, next token). With a grammar, each position's argmax is over
    the tokens it allows there, and the grammar consumes the accepted drafts and the next token."""
    if grammar is not None:
        return _verify_greedy_constrained(logits, drafts.tolist(), grammar)
    best = logits.argmax(-1)
    k = drafts.numel()
    accepted = int((best[:k] == drafts).long().cumprod(0).sum()) if k else 0
    return accepted, int(best[accepted])


def _verify_greedy_constrained(logits: torch.Tensor, drafts: list[int], grammar: Grammar) -> tuple[int, int]:
    for i in range(len(drafts) + 1):
        best = int(logits[i].argmax())
        # the unmasked argmax, when allowed, is the masked one too (and the first of any tie, as argmax picks):
        # one bit of the mask instead of a pass over the vocabulary
        if not grammar.allows(best):
            best = int(grammar.mask_logits(logits[i]).argmax())
        grammar.accept(best)
        if i == len(drafts) or best != drafts[i]:
            return i, best
    raise AssertionError("unreachable")


def verify_sampled(probs: torch.Tensor, drafts: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                   generator: torch.Generator) -> tuple[int, int]:
    """probs [K+1, V] (target, after temperature/top-p); drafts [K]; the draft distributions as sparse
    rows q_ids/q_probs [K, m] (token ids and their probabilities; the rest of q is 0)."""
    return _rejection_sample(lambda i: probs[i], drafts.tolist(), q_ids, q_probs, generator)


def verify_sampled_constrained(logits: torch.Tensor, drafts: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                               generator: torch.Generator, temperature: float, top_p: float,
                               grammar: Grammar) -> tuple[int, int]:
    """verify_sampled against the target's distribution under the grammar: at each position the logits masked
    where the grammar (advanced through the drafts kept so far) refuses, then temperature and top-p."""
    def probs_at(i: int) -> torch.Tensor:
        return target_probs(grammar.mask_logits(logits[i]), temperature, top_p)
    accepted, token = _rejection_sample(probs_at, drafts.tolist(), q_ids, q_probs, generator, grammar.accept)
    grammar.accept(token)
    return accepted, token


def _rejection_sample(probs_at, drafts: list[int], q_ids, q_probs, generator, keep=lambda token: None):
    """`probs_at(i)`: the target's distribution at position i, asked in order once the drafts before it are
    kept (`keep(token)` is told each one)."""
    for i, token in enumerate(drafts):
        p = probs_at(i)
        q = torch.zeros_like(p).index_add_(0, q_ids[i], q_probs[i].float())
        p_tok, q_tok = float(p[token]), float(q[token])
        if q_tok <= 0:
            raise ValueError(f"draft token {token} has probability 0 under its own draft distribution")
        if torch.rand((), generator=generator).item() * q_tok < p_tok:  # u < p/q, without dividing
            keep(token)
            continue
        residual = (p - q).clamp_(min=0)
        if residual.sum() <= 0:  # p == q exactly: p is then the residual's limit
            residual = p
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    k = len(drafts)
    return k, int(torch.multinomial(probs_at(k), 1, generator=generator))


def verify(logits: torch.Tensor, drafts: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
           q_ids: torch.Tensor | None = None, q_probs: torch.Tensor | None = None,
           grammar: Grammar | None = None) -> tuple[int, int]:
    """The last rank's verification of one round: logits [K+1, V] at [last, d1..dK], drafts [K] ->
    (accepted drafts, the next token); greedy when temperature is 0, else rejection sampling."""
    if temperature <= 0:
        return verify_greedy(logits, drafts, grammar)
    if grammar is None:
        return verify_sampled(target_probs(logits, temperature, top_p), drafts, q_ids, q_probs, generator)
    return verify_sampled_constrained(logits, drafts, q_ids, q_probs, generator, temperature, top_p, grammar)


MAX_TOP_LOGPROBS = 20  # what OpenAI allows for top_logprobs


@dataclass
class TokenLogprobs:
    """The target's log-probabilities at each committed position: `chosen` [n] of the committed tokens,
    `top_ids` / `top` [n, top_n] the most likely tokens there and theirs (most likely first)."""
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top: torch.Tensor


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> TokenLogprobs:
    """logits [n, V] at the positions that chose `tokens` [n] (the accepted drafts and the next token)."""
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {top_n}")
    logprobs = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long).unsqueeze(-1)).squeeze(-1)
    top, top_ids = logprobs.topk(top_n, dim=-1)
    return TokenLogprobs(chosen, top_ids, top)
