"""Rank 0's half of a round: a stream's drafts and stage 0's output over them, as a Block to send. Fresh blocks
for several streams at once (one batched drafting step, stage 0 as one forward), and, while a lone stream's
rounds are on the way, blocks prepared on the bet that they are fully accepted (spec.in_flight, spec.overlap)."""
from __future__ import annotations

import time

import torch

from speculative.k_choice import in_step
from speculative.rounds import padded
from speculative.streams import Block, Stream


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def widths(streams: list[Stream]) -> list[int]:
    """Each stream's drafts this round: its K, and a greedy stream's widened to the widest K of the batch (never
    past its answer's end; a stream prefilling drafts nothing, nor one whose K is 0). A batch's drafting steps run
    max(K) times over every row, and every later rank pads each block to the longest, so a row with a smaller K
    (spec.adaptive shrinks it after a miss) would pay for drafts it throws away: they cost nothing, and greedy
    output is the target's whatever was drafted. Not a sampled stream's: its seeded draws at a position depend on
    whether a draft is there, and it draws the same tokens alone and among others. The K policies judge a round
    by the K it asked for (k_choice.AdaptiveK)."""
    ks = [0 if s.prefilling else min(s.k_now, s.remaining - 1) for s in streams]  # never overshoot
    return [min(max(ks), s.remaining - 1) if k and s.params.temperature == 0 else k for s, k in zip(streams, ks)]


class BlockMaker:
    def __init__(self, stage, drafter, k_policy, overlap: bool = False):
        self.stage, self.drafter, self.k_policy, self.overlap = stage, drafter, k_policy, overlap

    def fresh(self, streams: list[Stream]) -> list[Block]:
        """Rank 0's half of a round for each stream from its committed tokens: its drafts (one batched drafting
        step for all), then stage 0 over [pending..., d1..dK] from each block's start, as one forward."""
        t0 = time.perf_counter()
        ks = widths(streams)
        rooms = [s.remaining - 1 for s in streams]  # a lookup may propose past K, never past the answer's end
        drafts = self.drafter.propose_rows([s.committed for s in streams], ks, [s.slot for s in streams], rooms)
        draft_ms, t1 = _ms(t0), time.perf_counter()
        fed = [s.pending + d.tokens.tolist() for s, d in zip(streams, drafts)]
        hidden = self.stage_zero([s.start for s in streams], fed, [s.slot for s in streams])
        stage0_ms = _ms(t1)
        return [Block(s.start, f, d, h, s.k_now, draft_ms, stage0_ms, stream=s)
                for s, f, d, h in zip(streams, fed, drafts, hidden)]

    def stage_zero(self, starts: list[int], fed: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
        """Stage 0 over each block's tokens from its start in its slot: one forward (rows padded on the right)."""
        device = self.stage.device
        if len(fed) == 1:
            return [self.stage.run(starts[0], torch.tensor(fed, device=device), slot=slots[0])]
        ids, ends = padded([torch.tensor([f])[..., None] for f in fed])
        out = self.stage.run_rows(starts, ids[..., 0].to(device), slots, ends)
        return [out[b:b + 1, :end] for b, end in enumerate(ends)]

    def use_the_wait(self, s: Stream, depth: int, send) -> tuple[float, int]:
        """While rounds are in flight: prepare blocks on the bet, each sent at once while the depth allows,
        one more held back under spec.overlap; returns the ms spent preparing them and how many. When the next round will
        draft nothing, the drafter takes in the committed tokens now, not all at once when K rises again (where it
        is in step: a prompt it skipped at K=0 waits for a K that pays for taking it in, KFromCosts.pays_intake)."""
        prepared_ms, prepared = 0.0, 0
        while s.chain and s.chain[-1].sent_at is not None:  # else one is held back already
            tip = s.chain[-1]
            k_next = min(self.k_policy.bet(tip.k, len(tip.drafts), s.k_now), s.remaining - s.promised - 1)
            if k_next == 0 and in_step(self.drafter.lacks(len(s.committed), s.slot), self.k_policy.k_max):
                self.drafter.catch_up(s.committed, slot=s.slot)  # (not a prompt skipped at K=0)
            if k_next <= 0 or not (s.sent < depth or self.overlap):
                break
            block = self.bet(s, tip, k_next)
            if block is None:
                break
            s.chain.append(block)
            prepared_ms, prepared = prepared_ms + block.prepared_ms, prepared + 1
            if s.sent < depth:
                send([block])
        if s.chain and s.chain[-1].drafts.looked_up:
            t0 = time.perf_counter()
            self.take_in_lookups(s)
            prepared_ms += _ms(t0)
        return prepared_ms, prepared

    def take_in_lookups(self, s: Stream) -> None:
        """The model drafter takes in the chain's looked-up tokens now, in the wait (draft.kind=hybrid), where a
        lookup did not go through it (HybridDrafter.checked: a sampled request, a model unlike the target): where a
        copy diverges the next round would first run it over the whole copy, in line, while the later ranks idle.
        On a bet that fails, commit() rewinds it to what was kept."""
        context = s.committed[:s.chain[0].start] + [t for block in s.chain for t in block.fed]
        self.drafter.catch_up(context[:-1], slot=s.slot)  # the last token is fed by the next drafting step

    def bet(self, s: Stream, tip: Block, k_next: int) -> Block | None:
        """Draft the guess plus k_next tokens after the tip's drafts and run stage 0 over them: on a hit the
        caches are exactly where this block needs them. None when the drafter has no draft after its guess.
        A lookup (ngram, hybrid) may find fewer than k_next: the block then carries what it found."""
        t0 = time.perf_counter()
        context = s.committed[:s.chain[0].start] + [t for block in s.chain for t in block.fed]
        proposal = self.drafter.propose(context, k_next + 1, slot=s.slot, room=s.remaining - s.promised)
        if len(proposal) < 2:  # nothing to propose (n-gram miss, no drafter), or the guess alone
            return None
        guess, drafts = int(proposal.tokens[0]), proposal.after_first()
        fed = [guess] + drafts.tokens.tolist()
        hidden = self.stage.run(len(context), torch.tensor([fed], device=self.stage.device), slot=s.slot)
        return Block(len(context), fed, drafts, hidden, k_next, guess=guess, prepared_ms=_ms(t0), stream=s)
