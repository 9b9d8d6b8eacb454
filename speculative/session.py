"""Rank 0's side of a session: one generation after another over the same caches.

Every cache (both stages, the drafter) is indexed by position, so the tokens of the last request are
still there when the next one arrives. A new prompt that begins with them (the next turn of a
conversation, the same document with another question) rewinds every cache to the longest common
prefix and prefills only the rest: the output is what a fresh run gives, since a rewound cache holds
exactly what a fresh prefill of that prefix would have written.
"""
from __future__ import annotations

from netbridge import protocol
from netbridge.protocol import Request
from speculative.k_choice import KFromCosts
from speculative.output import Output
from speculative.rounds import Generation, run_rank0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    def __init__(self, stage, drafter, channel, k: int, adaptive: bool, overlap: bool = False, prefill_chunk: int = 512,
                 k_from_costs: bool = False, replies=None):
        self.stage, self.drafter, self.channel = stage, drafter, channel
        self.replies = replies  # the last rank's link with more than two ranks (run_rank0)
        self.k, self.adaptive, self.overlap, self.prefill_chunk = k, adaptive, overlap, prefill_chunk
        self.k_costs = KFromCosts(k, overlap) if k_from_costs and k > 0 else None  # its estimates carry over requests
        self.cached: list[int] = []  # the tokens every cache holds, in order

    def generate(self, prompt_ids: list[int], output: Output, request: Request = Request(), on_round=None,
                 cancelled=lambda: False) -> Generation:
        # at least the prompt's last token is fed again: its logits give the first new token
        reuse = common_prefix(self.cached, prompt_ids[:-1])
        self.cached = []  # unknown until the generation ends cleanly (an exception leaves it so)
        gen = run_rank0(self.stage, self.drafter, self.channel, prompt_ids, output, self.k, on_round=on_round,
                        adaptive=self.adaptive, request=request, reuse=reuse, cancelled=cancelled,
                        overlap=self.overlap, prefill_chunk=self.prefill_chunk, k_costs=self.k_costs,
                        replies=self.replies)
        # the caches hold every committed token but the newest (the next round feeds it), or, when no
        # round ran at all, just the reused prefix
        self.cached = (prompt_ids + output.tokens)[:-1] if gen.rounds else prompt_ids[:reuse]
        return gen

    def idle(self) -> None:
        """Tell the other ranks the links are alive while no request is waiting (their receives have a timeout)."""
        protocol.send(self.channel, protocol.Idle())

    def close(self) -> None:
        protocol.send(self.channel, protocol.Bye())
