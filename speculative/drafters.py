"""Drafters behind one small interface: `reset(keep, temperature, seed, slot)` when a request starts,
`propose(context, k, slot)` -> Drafts each round (or `propose_rows` for several requests at once), `commit(n, slot)`
after it.

`context` is every committed token (prompt + output), its last one the token the target has yet to
see. A drafter returns at most k tokens (fewer is fine) and, when the target samples, the sparse
distribution each was drawn from (the last rank needs q for rejection sampling). `slot` is the request's KV slot
(serve.max_concurrent): a drafter with a cache keeps each slot's tokens apart; the others ignore it.

Four kinds (draft.kind): none, ngram (prompt lookup: free, one-hot q), model (a small LM: its own q), and hybrid
(a lookup when the context is being copied, else the model). Each round's Drafts carry the q they were drawn
from, so the last rank's rejection sampling is exact whichever kind proposed them, round by round.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from speculative.draft_step import DraftStep

CHECK_MIN = 0.5  # hybrid: lookups are checked against the model while its first tokens are the target's this often
FEW_MISSING = 8  # a slot lacking at most this many tokens catches up in a batch with others (spec.k is at most 8 or so)


@dataclass
class Drafts:
    tokens: torch.Tensor  # [k] int64
    q_ids: torch.Tensor | None = None  # [k, m] token ids of each draft's distribution
    q_probs: torch.Tensor | None = None  # [k, m] their probabilities
    looked_up: bool = False  # found in the context (q one-hot), no model step; else the model's own q (None greedy)
    cut: bool = False  # looked up, cut where the model parts from the copy, the model's drafts after (HybridDrafter)

    def __len__(self) -> int:
        return self.tokens.numel()

    def after_first(self) -> Drafts:
        """The drafts after the first (which draft_ahead uses as its guess of the target's next token)."""
        return self.sliced(1, None)

    def sliced(self, first: int, end: int | None) -> Drafts:
        cut = (lambda t: None if t is None else t[first:end])
        return Drafts(self.tokens[first:end], cut(self.q_ids), cut(self.q_probs), self.looked_up, self.cut)


def one_hot_drafts(tokens: list[int], looked_up: bool = False) -> Drafts:
    """A deterministic proposal is a one-hot q: rejection sampling then keeps d with probability p(d).
    `looked_up`: the tokens were found in the context (a lookup round, when there are any)."""
    t = torch.tensor(tokens, dtype=torch.long)
    return Drafts(t, t[:, None].clone(), torch.ones(len(tokens), 1), looked_up and bool(tokens))


class StatelessDrafter:
    """A drafter that keeps nothing between rounds."""

    def reset(self, keep: int, temperature: float, seed: int, slot: int = 0) -> None:
        pass

    def catch_up(self, context: list[int], slot: int = 0, guesses: bool = False) -> dict[int, int]:
        return {}

    def commit(self, n_committed: int, slot: int = 0) -> None:
        pass

    def lacks(self, tokens: int, slot: int = 0) -> int:
        """How many of a context's first `tokens` the slot has not taken in (its next drafting round feeds them)."""
        return 0

    def copy_prefix(self, source: int, slot: int, tokens: int) -> None:
        pass

    def propose(self, context: list[int], k: int, slot: int = 0, room: int | None = None) -> Drafts:
        """k drafts after `context`. `room`: the most a lookup may propose past k (HybridDrafter's long copies;
        the others propose k at most and ignore it)."""
        raise NotImplementedError

    def propose_rows(self, contexts: list[list[int]], ks: list[int], slots: list[int],
                     rooms: list[int] | None = None) -> list[Drafts]:
        """Several requests' drafts: nothing to share between them, so one after another."""
        return [self.propose(context, k, slot=slot) for context, k, slot in zip(contexts, ks, slots)]


class NoDrafter(StatelessDrafter):
    """K=0: one token per round trip."""

    def propose(self, context: list[int], k: int, slot: int = 0, room: int | None = None) -> Drafts:
        return Drafts(torch.zeros(0, dtype=torch.long))


class NgramDrafter(StatelessDrafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    `max_n` down to `min_n`) and propose what followed it. Free, and strong on code and quotes."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, context: list[int], k: int, slot: int = 0, room: int | None = None) -> Drafts:
        return one_hot_drafts(self.look_up(context, k), looked_up=True)

    def look_up(self, context: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix found (at least one token: the
        occurrence ends before the context does), at most k tokens; [] when no suffix recurs."""
        if k > 0:
            for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
                suffix = context[-n:]
                for start in range(len(context) - n - 1, -1, -1):
                    if context[start:start + n] == suffix:
                        return context[start + n:start + n + k]
        return []


class ModelDrafter:
    """A small causal LM (a built Stage with embeddings and head) with a static KV cache indexed by position,
    one slot per request being served.

    A slot holds `cached[slot]` tokens of its request's context. A round feeds whatever the slot lacks (the
    prompt at first; normally just the last committed token; after a fully accepted round also dK,
    so the cache never has a hole), then runs K single-token steps: for several slots at once, the same
    steps batched over them (propose_rows)."""

    def __init__(self, stage, max_k: int = 8, top_k: int = 32, use_graph: bool = False, slots: int | None = None):
        self.stage = stage
        self.device = stage.device
        slots = stage.cache.num_slots if slots is None else slots
        if slots != stage.cache.num_slots:
            raise ValueError(f"a drafter for {slots} slots over a cache of {stage.cache.num_slots}: allocate the "
                             f"drafter's cache with slots={slots}")
        self.cached = [0] * slots
        self.step = DraftStep(stage, max(max_k, 1) + 1, top_k, use_graph)  # + 1: draft_ahead's guess

    @property
    def vocab_size(self) -> int:
        return self.stage.config.vocab_size

    def reset(self, keep: int, temperature: float, seed: int, slot: int = 0) -> None:
        """A new request in `slot`, whose context shares its first `keep` tokens with what the slot holds."""
        self.cached[slot] = min(self.cached[slot], keep)
        self.stage.cache.rewind(self.cached[slot], slot)
        self.step.configure(temperature, seed, slot)

    def catch_up(self, context: list[int], slot: int = 0, guesses: bool = False) -> dict[int, int]:
        """Take in every token of `context` the slot lacks (a prompt, ahead of drafting). With `guesses`, returns
        the model's greedy guess at the token after each one taken in, by position (HybridDrafter.checked)."""
        start, missing = self.cached[slot], context[self.cached[slot]:]
        if not missing:
            return {}
        # Stage.run checks the room (the setting named) and writes at the slot's own positions
        out = self.stage.run(start, torch.tensor([missing], device=self.device),
                             num_logits=len(missing) if guesses else None, slot=slot)
        self.cached[slot] = len(context)
        return {start + 1 + i: token for i, token in enumerate(out[0].argmax(-1).tolist())} if guesses else {}

    def lacks(self, tokens: int, slot: int = 0) -> int:
        return max(tokens - self.cached[slot], 0)

    def propose(self, context: list[int], k: int, slot: int = 0, room: int | None = None) -> Drafts:
        return self.propose_rows([context], [k], [slot], None if room is None else [room])[0]

    def propose_rows(self, contexts: list[list[int]], ks: list[int], slots: list[int],
                     rooms: list[int] | None = None) -> list[Drafts]:
        """Drafts for several requests, row b from contexts[b] in slots[b]: each row takes in what its slot lacks,
        then max(ks) single-token steps batched over the rows (the weights read once per step for all);
        row b keeps its first ks[b] drafts. A row with k=0 drafts nothing and takes no part."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"propose_rows over slots {slots}: each request drafts in a slot of its own")
        drafts = [one_hot_drafts([]) for _ in slots]
        rows = [b for b, k in enumerate(ks) if k > 0]
        if not rows:
            return drafts
        for b in rows:
            self.stage.cache.check_room(len(contexts[b]) + ks[b] - 1)
        self.catch_up_rows([contexts[b][:-1] for b in rows], [slots[b] for b in rows])
        tokens, q_ids, q_probs = self.step.run_rows([contexts[b][-1] for b in rows], [ks[b] for b in rows],
                                                    [len(contexts[b]) - 1 for b in rows], [slots[b] for b in rows])
        for i, b in enumerate(rows):
            k, slot = ks[b], slots[b]
            self.cached[slot] = len(contexts[b]) + k - 1
            if self.step.slot_temperature[slot] > 0:
                drafts[b] = Drafts(tokens[i, :k], q_ids[i, :k], q_probs[i, :k])
            else:
                drafts[b] = Drafts(tokens[i, :k])
        return drafts

    def catch_up_rows(self, contexts: list[list[int]], slots: list[int]) -> None:
        """`catch_up` for several slots: the rows that lack a few tokens (after a fully accepted round, its last
        draft) in one right-padded forward, as a drafting step reads the weights once for all; a longer gap (a
        prompt) alone, so short rows are not padded to its length."""
        few = [b for b, (context, slot) in enumerate(zip(contexts, slots))
               if 0 < len(context) - self.cached[slot] <= FEW_MISSING]
        starts = [self.cached[slots[b]] for b in few]
        width = max((len(contexts[b]) - start for b, start in zip(few, starts)), default=0)
        if len(few) > 1 and max(starts) + width <= self.stage.cache.capacity:  # the padding fits too
            missing = [contexts[b][start:] for b, start in zip(few, starts)]
            padded = torch.tensor([m + [0] * (width - len(m)) for m in missing], device=self.device)
            self.stage.run_rows(starts, padded, [slots[b] for b in few], [len(m) for m in missing], num_logits=None)
            for b in few:  # every row advanced by the padded width: back to its real tokens
                self.stage.cache.rewind(len(contexts[b]), slots[b])
                self.cached[slots[b]] = len(contexts[b])
        for context, slot in zip(contexts, slots):
            self.catch_up(context, slot=slot)  # what is left: nothing for the rows above

    def holds(self, n: int, slot: int = 0) -> None:
        """Its slot now holds the context's first n tokens (cache.dir loaded them: speculative.prefixes)."""
        self.cached[slot] = n
        self.stage.cache.rewind(n, slot)

    def copy_prefix(self, source: int, slot: int, tokens: int) -> None:
        """`slot` takes the first `tokens` of `source`, as far as that slot holds them (Session.shared_prefix)."""
        self.cached[slot] = min(tokens, self.cached[source])
        self.stage.cache.copy_prefix(source, slot, self.cached[slot])

    def commit(self, n_committed: int, slot: int = 0) -> None:
        # Valid: the committed prefix the slot saw. Its last committed token is fed next round.
        self.cached[slot] = min(self.cached[slot], n_committed - 1)
        self.stage.cache.rewind(self.cached[slot], slot)


class HybridDrafter(ModelDrafter):
    """draft.kind=hybrid: each round looks the context (prompt and output so far) up first, as NgramDrafter does;
    when its last `lookup_min` tokens (or more, up to `lookup_max`) occurred earlier, what followed them is the
    round's proposal (a one-hot q), with no model step. Otherwise the model drafts.

    A lookup may propose up to `lookup_k` tokens, past the round's K (within the row's `room`: what the answer may
    still take, so the caches' room for K drafts is never exceeded): K bounds what the model's steps cost, and a
    copy costs none; on a GPU the target's verify of a 33-token block costs about what a 5-token one does (a decode
    forward reads every weight once either way; on a 2-core CPU it costs ~40% more: bench/README.md), so a copied
    stretch commits several times the tokens per round trip.

    Where the model parts from a copy, the target likely does too (the model drafts for it: 0.8-0.97 of its drafts
    are the target's own), so a greedy request's lookup is checked first (`checked`): the model's first step says
    whether it would propose the copy's first token (if not, the copy goes and that step is the first of its own
    drafts); if so, one forward of the model over the rest of the copy gives its own guess at each copied token,
    and the copy goes only as far as the model agrees with it, the model's own drafts after it. The copy past that
    point would mostly be thrown away, each token a position of every later rank's block, and the round after would
    find no copy and draft in line. That forward is the one the model needs anyway to take the copy in (which
    otherwise it does the next time it drafts, everything it lacks in one forward, as after a fully accepted round;
    a lone stream under spec.overlap sooner, in the wait: BlockMaker.take_in_lookups), so a copied stretch costs
    the model one forward over it, not a step per token.
    A model that is not the target's likeness would cut good copies short: lookups are checked only while the
    model's first token of a block is kept more often than not (`model_is_right`). In a batch some rows may be
    looked up and others drafted by the model: the looked-up rows take no part in the model's steps."""

    def __init__(self, stage, lookup_min: int = 3, lookup_max: int | None = None, lookup_k: int = 0, **model):
        super().__init__(stage, **model)
        self.lookup = NgramDrafter(max(lookup_max or lookup_min, lookup_min), lookup_min)
        self.lookup_k = lookup_k
        self.own_first: dict[int, list[int]] = {}  # slot: where the model's first token is, in each block since
        self.own_kept = self.own_missed = 0  # its last commit; how often the target kept it, over every slot

    def propose_rows(self, contexts: list[list[int]], ks: list[int], slots: list[int],
                     rooms: list[int] | None = None) -> list[Drafts]:
        rooms = ks if rooms is None else rooms
        drafts = [self.lookup.propose(context, k and max(k, min(self.lookup_k, room)))
                  for context, k, room in zip(contexts, ks, rooms)]
        for b, d in enumerate(drafts):
            if d.looked_up and self.step.slot_temperature[slots[b]] == 0 and self.model_is_right():
                drafts[b] = self.checked(contexts[b], d, ks[b], slots[b])
        rows = [b for b, d in enumerate(drafts) if not len(d)]  # no lookup: the model drafts them, in one batch
        modelled = super().propose_rows([contexts[b] for b in rows], [ks[b] for b in rows], [slots[b] for b in rows])
        for b, d in zip(rows, modelled):
            drafts[b] = d
            if len(d):
                self.own_first.setdefault(slots[b], []).append(len(contexts[b]))
        return drafts

    def checked(self, context: list[int], copy: Drafts, k: int, slot: int) -> Drafts:
        """The copy as far as the model would propose it too, then the model's own drafts (K in all, at least its
        first); the model's K drafts where it parts at the copy's first token (its first step tells: a step the
        round takes then anyway, so a copy the model rejects at once costs nothing). Greedy requests
        (propose_rows): each is the model's argmax, a deterministic proposal (q one-hot). The slot then holds what
        a model round of those drafts leaves."""
        tokens = copy.tokens.tolist()
        own = self.drafts_after(context, [], 1, slot)
        if own != tokens[:1]:
            self.own_first.setdefault(slot, []).append(len(context))
            return Drafts(torch.tensor(own + self.drafts_after(context, own, k - 1, slot), dtype=torch.long))
        guesses = self.catch_up(context + tokens[:-1], slot=slot, guesses=True)
        parts = next((j for j in range(1, len(tokens)) if guesses[len(context) + j] != tokens[j]), None)
        if parts is None:
            return copy
        self.holds(len(context) + parts, slot)  # the copy up to there; the model's first token is fed next
        own = [guesses[len(context) + parts]]
        own += self.drafts_after(context, tokens[:parts] + own, k - parts - 1, slot)
        self.own_first.setdefault(slot, []).append(len(context) + parts)
        return replace(one_hot_drafts(tokens[:parts] + own, looked_up=True), cut=True)

    def drafts_after(self, context: list[int], more: list[int], k: int, slot: int) -> list[int]:
        """The model's k greedy drafts (none for k <= 0) after context + more, in its steps (never a lookup:
        ModelDrafter's, not this class's propose_rows)."""
        if k <= 0:
            return []
        return ModelDrafter.propose_rows(self, [context + more], [k], [slot])[0].tokens.tolist()

    def reset(self, keep: int, temperature: float, seed: int, slot: int = 0) -> None:
        self.own_first.pop(slot, None)
        super().reset(keep, temperature, seed, slot)

    def model_is_right(self) -> bool:
        """Whether the model's first token of a block is the target's more often than not, as measured (1/2 each
        way until then, over every slot): checked."""
        return (self.own_kept + 1) / (self.own_kept + self.own_missed + 2) >= CHECK_MIN

    def commit(self, n_committed: int, slot: int = 0) -> None:
        for own in self.own_first.pop(slot, []):  # kept: committed past it; missed: the target's token there
            self.own_kept += n_committed > own + 1
            self.own_missed += n_committed == own + 1
        super().commit(n_committed, slot)
