"""The ranks meet before any weight loads: each says what model it runs, what it may hold and (for
model.split=auto) how fast it is, in a Hello; every rank gathers all the Hellos in one exchange around the
ring and settles the same Plan from them (launch.plan).

A rank whose config disagrees with an earlier rank's (another model, dtype, quant, version or given split)
stops the ring with one line naming both; a split that breaks a budget stops every rank, each with the same
line. Every rank holds the same KV slots (requests served at once): the fewest any rank asks for (a one-shot
rank 0 asks for one), or, serve.max_concurrent=null on every rank, the most every budget holds (launch.plan).
The start-up line of each rank says what it holds and, when timed, its estimated ms per round; serving, its
KV slots.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, replace

from launch.config import START_TIMEOUT_S, ConfigError, TandemConfig
from launch.distributed import release_freed_memory
from launch.plan import (Models, Plan, asked_slots, describe, given_cuts, rank_alone_ms, rank_costs, rank_speed,
                         ring_text, settle, split_text, timed, with_draft_format)
from model_parallel.split import RankCosts
from netbridge import protocol
from netbridge.channel import PeerError, PeerSilent
from netbridge.link_probe import LinkProbe, probe_ring
from netbridge.protocol import Hello, Hellos


def handshake(cfg: TandemConfig, models: Models, prev, next, rank: int, ranks: int) -> Plan:
    """This rank's Plan, agreed with every other rank over the ring (`prev`: the link from the rank before,
    `next`: to the rank after; one channel both ways with two ranks). With model.split=auto each rank times
    its share on its own device: all at once with spec.overlap (in a round the ranks then work at the same
    time, so ranks that share a host's cores time what they will meet there), else in turns, each after the
    Hellos of the ranks before it have come (as a round without overlap runs them one after another); with
    spec.overlap each also times a layer again in its turn, alone: the two say how much the ranks slow each other
    when they compute at once (ranks sharing a host's cores; ~1 on hosts of their own; speculative.cost_model). First
    each rank measures its link on to the next rank (netbridge.link_probe); the Plan carries every link's."""
    given = given_cuts(cfg, models.target.num_layers, ranks)
    models = with_draft_format(cfg, models)  # rank 0, draft.quant=auto: each format's draft step timed now
    costs, source = rank_costs(cfg, models, rank, ranks)
    link = probe_ring(prev, next, rank)  # after this rank's own checks: a mistake here is named before any wait
    auto, together = given is None or cfg.plan_only, bool(cfg.spec.overlap)  # plan_only: timed for the predictions
    if auto and together:
        costs = timed(costs, rank_speed(cfg, models, rank, ranks))

    def mine(before: list[Hello]) -> Hello:
        nonlocal costs
        message = disagreement([*before, hello(cfg, models, costs, given, link)])
        if message:
            protocol.send(next, protocol.Error(message))
            raise ConfigError(message)
        if auto and not together:  # in turns: the ranks before this one are done timing
            costs = timed(costs, rank_speed(cfg, models, rank, ranks))
        elif auto:  # and alone (the others wait for the Hellos meanwhile): what sharing a host's cores costs
            costs = replace(costs, **rank_alone_ms(cfg, models, rank, ranks))
        return hello(cfg, models, costs, given, link)
    hellos = gather(prev, next, rank, ranks, mine, cfg.transport.start_timeout_s)
    release_freed_memory()  # the timing's placeholder layers: the weights load next
    every = [costs_of(h) for h in hellos]
    cuts = next_given(hellos)
    plan = settle(cfg, models, rank, every, source, cuts, [h.slots for h in hellos], ring_links(hellos))
    ring = f"[{ring_text(plan.links, int(os.environ.get('GROUP_WORLD_SIZE', 1)))}]\n" if rank == 0 else ""
    sys.stderr.write(f"[{describe(plan)}]\n{ring}")  # one write: the ranks share a terminal
    sys.stderr.flush()
    return plan


def gather(prev, next, rank: int, ranks: int, mine, wait_s: float = START_TIMEOUT_S) -> list[Hello]:
    """Every rank's Hello, in one pass around the ring: rank 0 sends its own; each later rank adds its own
    (`mine(the Hellos before it)`) and sends them all on; the last rank's, now whole, go on around to rank 0
    and down to the middle ranks, until every rank holds every Hello. Each waits up to `wait_s` for them
    (at_start): the other ranks time their layers meanwhile, alone, one after another."""
    with at_start(prev, (rank - 1) % ranks, wait_s):
        before = [] if rank == 0 else protocol.recv(prev, Hellos).hellos
        every = [*before, mine(before)]
        protocol.send(next, Hellos(every))
        if len(every) < ranks:  # not the last rank: the whole list comes round
            every = protocol.recv(prev, Hellos).hellos
            if rank + 1 < ranks - 1:  # on to the middle ranks after this one
                protocol.send(next, Hellos(every))
    return every


@contextmanager
def at_start(prev, peer: int, wait_s: float):
    """Receives from rank `peer` on `prev` wait up to `wait_s` (transport.start_timeout_s; at least the channel's
    own per-message transport.timeout_s): at start-up a rank waits while others time their layers, which a host
    without fast kernels for model.dtype takes minutes over (the embedded pair's 1.5B target in bf16 on a CPU
    without avx512_bf16: rank 0's timing alone ~2.5 minutes)."""
    per_message, prev.timeout_s = prev.timeout_s, max(prev.timeout_s, wait_s)
    try:
        yield
    except PeerSilent:
        raise PeerError(f"rank {peer} sent nothing for {prev.timeout_s:g} s at start-up (transport.start_timeout_s): "
                        "the ranks time their layers first, one after another, which a slow host takes minutes over; "
                        "raise transport.start_timeout_s, or see whether a rank stopped") from None
    finally:
        prev.timeout_s = per_message


def next_given(hellos: list[Hello]) -> list[int] | None:
    """The cuts given on some rank (they agree, disagreement checked it), or None: auto on every rank."""
    return next((h.cuts for h in hellos if h.cuts is not None), None)


def hello(cfg: TandemConfig, models: Models, costs: RankCosts, given: list[int] | None, link: LinkProbe) -> Hello:
    return Hello(models.target.num_layers, cfg.model.dtype, cfg.model.quant, given, costs.budget, costs.fixed_bytes,
                 costs.layer_bytes, costs.layer_ms, costs.fixed_ms, asked_slots(cfg),
                 [costs.slot_fixed_bytes, costs.slot_layer_bytes], asdict(link),
                 layer_token_ms=costs.layer_token_ms, draft_step_ms=costs.draft_step_ms,
                 prefill_ms={name: getattr(costs, name) for name in PREFILL_MS})


def costs_of(h: Hello) -> RankCosts:
    """The RankCosts a rank's Hello carries (hello's inverse)."""
    return RankCosts(h.budget, h.fixed_bytes, h.layer_bytes, h.layer_ms, h.fixed_ms, *h.slot_bytes,
                     layer_token_ms=h.layer_token_ms, draft_step_ms=h.draft_step_ms, **h.prefill_ms)


# RankCosts' fields a Hello carries in prefill_ms
PREFILL_MS = ("attend_ms", "draft_token_ms", "draft_attend_ms", "alone_layer_ms", "alone_draft_step_ms",
              "alone_layer_token_ms", "alone_attend_ms", "alone_prefill_ms", "alone_draft_prefill_ms", "context_ms",
              "draft_context_ms", "context_row_ms", "draft_context_row_ms", "layer_row_ms", "head_row_ms",
              "draft_row_ms", "core_share", "host_rank")


def ring_links(hellos: list[Hello]) -> tuple[LinkProbe, ...]:
    """Every ring link as its sending rank measured it: index i = the link rank i -> rank i+1."""
    try:
        return tuple(LinkProbe(**h.link) for h in hellos)
    except TypeError:
        raise PeerError("protocol error: a Hello without its link probe; are all ranks the same Tandem version?") from None


def disagreement(hellos: list[Hello]) -> str | None:
    """The line every rank stops with when the last of `hellos` names another model than an earlier one
    (or another given split)."""
    mine, rank = hellos[-1], len(hellos) - 1
    diff = []
    for key in ["num_layers", "dtype", "quant", "version", "cuts"]:
        for i, theirs in reversed(list(enumerate(hellos[:-1]))):  # the nearest rank first
            a, b = getattr(theirs, key), getattr(mine, key)
            if key == "cuts" and None in (a, b):
                continue
            if a != b:
                name, a, b = ("split", split_text(a), split_text(b)) if key == "cuts" else (key, a, b)
                diff.append(f"{name} (rank {i}: {a}, rank {rank}: {b})")
                break
    if not diff:
        return None
    return "the ranks disagree on " + ", ".join(diff) + "; give every rank the same config and Tandem version"
