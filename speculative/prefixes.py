"""cache.dir on one rank: which saved prefix of a prompt it holds, loading the agreed one, saving a new one.

The ranks agree on a prefix in one lap of the ring (the messages are netbridge.protocol's Lookup and Restore;
the round loops carry them, this class does the rest):

    rank 0: hashes of the prompt's whole blocks; reads what it holds of them
            Lookup(hashes, weights=[id_0], held=blocks rank 0 holds)       --> rank 1 ... --> rank N-1 --> rank 0
            each rank reads at most `held` of its own blocks, lowers `held` to what it has, adds its identity
    rank 0: Restore(hashes, weights, start, tokens)                       --> every rank
            each rank loads [start, tokens) from what it read (start: what memory already holds) and saves the
            prompt's blocks once its first round has run over them

Rank 0 sends a Lookup only when it holds more than memory does; a Restore goes whenever the prompt is long
enough to save (cache.min_tokens), so every rank knows what to save. A rank reads and checks its blocks before
it answers, so a file that turns out bad can only lower what it reports, never break a load agreed on.

The key of a rank's files is the identity of every weight its KV depends on: its own and every earlier rank's
(model_parallel.identity), which arrive in the messages' `weights`. Rank 0's drafter has its own model, key and files.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvcache.disk import KVDiskStore, SavedPrefix, SliceKey, prefix_hashes
from kvcache.static_cache import StaticKVCache
from netbridge.protocol import Lookup, Restore


@dataclass(frozen=True)
class CacheSettings:
    """cache.*: folder (None: off), min_tokens, max_bytes, block_tokens."""
    folder: str | None = None
    min_tokens: int = 512
    max_bytes: int = 20 * 2 ** 30
    block_tokens: int = 256


class RankPrefixes:
    """One rank's saved prefixes: its stage's slice, and on rank 0 also its model drafter's (`drafter`: the
    drafter's identity and the ModelDrafter, whose `cached` tokens its cache holds)."""

    def __init__(self, settings: CacheSettings, identity: str, cache: StaticKVCache, drafter=None, warn=None):
        self.settings, self.identity, self.warn = settings, identity, warn
        self.caches = {"target": cache}
        self.drafter_identity, self.drafter = drafter if drafter else (None, None)
        if self.drafter is not None:
            self.caches["drafter"] = self.drafter.stage.cache
        self.stores: dict[tuple[str, str, int], KVDiskStore] = {}
        self.found: dict[str, SavedPrefix] = {}  # what the last lookup read, per role
        self.to_save: dict[int, tuple[list[str], list[str], int]] = {}  # per slot: hashes, weights, block size
        self.drafter_to_save: dict[int, tuple[list[str], int]] = {}
        self.asked: tuple[list[str], int] = ([], 0)  # rank 0: the request's blocks, and how many it holds

    def store(self, role: str, weights: list[str], block: int) -> KVDiskStore:
        model = pipeline_identity(weights + [self.identity]) if role == "target" else pipeline_identity([self.drafter_identity])
        at = (role, model, block)
        if at not in self.stores:
            self.stores[at] = KVDiskStore(self.settings.folder, SliceKey.of_cache(self.caches[role], model, role),
                                          self.settings.max_bytes, block, self.warn)
        return self.stores[at]

    # --- rank 0 -------------------------------------------------------------------------------
    def begin(self, prompt: list[int]) -> list[str]:
        """Rank 0, a new request: the last lookup forgotten; the prompt's blocks to look up and save, none for a
        prompt shorter than cache.min_tokens. The last token is left out: a restored prefix must leave it to the
        prefill (its logits give the first token)."""
        self.found = {}
        if len(prompt) < self.settings.min_tokens:
            return []
        return prefix_hashes(prompt[:-1], self.settings.block_tokens)

    def look(self, hashes: list[str]) -> int:
        """Rank 0: read what it holds of `hashes` (its drafter's too); the target's blocks."""
        return self.on_lookup(hashes, [], len(hashes), self.settings.block_tokens)

    def lookup(self, prompt: list[int], reuse: int) -> Lookup | None:
        """Rank 0, a new request whose first `reuse` tokens the caches hold: the Lookup to send around the ring
        when rank 0 holds more of the prompt on disk, else None (then `restore(reuse, None)` at once)."""
        hashes, block = self.begin(prompt), self.settings.block_tokens
        held = self.look(hashes) if len(hashes) * block > reuse else 0
        self.asked = (hashes, held)
        return Lookup(hashes, [self.identity], held, block) if held * block > reuse else None

    def restore(self, reuse: int, answer: Lookup | None, slot: int = 0) -> Restore:
        """Rank 0: the Restore every rank acts on (sent for every request, so that a cancelled request's blocks are
        never saved after the next one's prefill), rank 0's own part done: load what every rank holds (the
        last rank's `answer`) beyond `reuse` into `slot`, note the blocks to save."""
        (hashes, held), block = self.asked, self.settings.block_tokens
        tokens = max(reuse, (answer.held if answer is not None else held) * block)
        self.on_restore(hashes, [], block, reuse, tokens, slot)
        return Restore(hashes, [self.identity], block, reuse, tokens, slot)

    def restore_drafter(self, tokens: int, slot: int = 0) -> None:
        """Rank 0's drafter, after its reset: what its lookup found, up to `tokens`, loaded after what it holds."""
        found = self.found.pop("drafter", None)
        tokens = min(tokens, found.tokens if found is not None else 0)
        held = self.drafter.cached[slot]
        if tokens > held:
            found.load_into(self.caches["drafter"].slot(slot), tokens, held)
            self.drafter.holds(tokens, slot=slot)

    def after_generation(self, slot: int = 0) -> None:
        """Rank 0: queue the drafter's blocks of the prompt, as far as it has taken the prompt in."""
        if slot in self.drafter_to_save:
            hashes, block = self.drafter_to_save.pop(slot)
            self.store("drafter", [], block).save(self.caches["drafter"].slot(slot),
                                                  hashes[:self.drafter.cached[slot] // block])

    # --- every rank ---------------------------------------------------------------------------
    def on_lookup(self, hashes: list[str], weights: list[str], held: int, block: int) -> int:
        """Read this rank's blocks among the first `held` of `hashes`; returns how many it holds of them."""
        self.found = {role: self.store(role, weights, block).read(hashes[:held]) for role in self.caches}
        return min(held, len(self.found["target"].blocks))

    def on_restore(self, hashes: list[str], weights: list[str], block: int, start: int, tokens: int,
                   slot: int = 0) -> None:
        """Load target tokens [start, tokens) from the last lookup into `slot`, and note the prompt's blocks to save
        once that slot holds the prompt (after_prefill)."""
        target = self.found.pop("target", None)
        if tokens > start:
            target.load_into(self.caches["target"].slot(slot), tokens, start)
        self.to_save.pop(slot, None)
        if hashes:
            self.to_save[slot] = (hashes, weights, block)

    def after_prefill(self, slot: int = 0) -> None:
        """`slot` holds its prompt (its first round has run): queue its new blocks for the writer."""
        if slot in self.to_save:
            hashes, weights, block = self.to_save.pop(slot)
            self.store("target", weights, block).save(self.caches["target"].slot(slot), hashes)
            if self.drafter is not None:
                self.drafter_to_save[slot] = (hashes, block)

    def close(self) -> None:
        """Every queued block on disk (a one-shot run ends right after)."""
        for store in self.stores.values():
            store.close()


def pass_on(prefixes: RankPrefixes | None, msg):
    """A later rank's part of a Lookup or Restore (netbridge.protocol); what it sends on. A rank without cache.dir
    holds nothing and names no weights (""), so no rank after it uses the cache either: its files' key would
    miss those weights."""
    mine = prefixes if prefixes is not None and "" not in msg.weights else None
    weights = msg.weights + [mine.identity if mine else ""]
    if isinstance(msg, Lookup):
        held = mine.on_lookup(msg.hashes, msg.weights, msg.held, msg.block) if mine else 0
        return Lookup(msg.hashes, weights, held, msg.block)
    if mine:
        mine.on_restore(msg.hashes, msg.weights, msg.block, msg.start, msg.tokens, msg.slot)
    return Restore(msg.hashes, weights, msg.block, msg.start, msg.tokens, msg.slot)


def pipeline_identity(rank_identities: list[str]) -> str:
    """The model identity every rank keys its files by: all ranks' stage identities, in rank order."""
    return hashlib.sha256(json.dumps(rank_identities).encode()).hexdigest()
