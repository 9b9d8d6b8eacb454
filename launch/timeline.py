"""Every rank on one time axis: per-round spans, each later rank's clock aligned to rank 0's, one Chrome trace.

Rank 0 knows its own spans from its round records (draft, stage0, send, wait, commit). The last rank puts
four `time.perf_counter()` readings in each reply (`protocol.Reply.marks`):

    [wait_start, recv_end, forward_end, send_start]     on the last rank's clock

so its spans are wait (for the round message), stage{r} (the forward of rank r), verify, and send (until the
next round's wait_start).

Clock alignment. Let theta = a later rank's clock minus rank 0's. Each round is a round trip, and causality
bounds theta: the later rank received the round after rank 0 began sending it, and rank 0 received the reply
after that rank began sending it:

    recv_end - theta >= send_start_0   ->  theta <= recv_end - send_start_0
    send_start - theta <= reply_end_0  ->  theta >= send_start - reply_end_0

Every reading sits on the safe side (a send time is read before the send, a receive time after the
receive), so the true theta is always inside. Every round narrows the interval [lo, hi]; theta is
its midpoint and the uncertainty its half-width (at most half of one round trip's time on the wire).
After alignment every later rank's span of a round lies inside that round's send..reply window on rank 0. If the bounds cross (clocks drifting
apart over a long run), the fastest round's NTP estimate is used and `consistent` is false.
A known least one-way time tightens both bounds by it: under the emulated delay (transport.emulate_delay_ms)
a message is delivered that long after its send began (netbridge/delay.py), never sooner.

On one host every rank reads the same monotonic clock, so the true offset is 0: a check of the method.

With N > 2 ranks each middle rank r puts the same four readings
in the Round it passes on (its verify span is empty: it only forwards); the last rank's Reply carries
them back. Every later rank receives a round after rank 0 sent it and sends before rank 0 has the
reply, so the same bounds align each one's clock; the trace has one row per rank.

Serving (launch.telemetry.ServeTelemetry) merges the rounds of the requests it served, live several at
once in slots of their own, into one trace: each round numbered across the whole serve and tagged with
its slot and request, every rank's spans of a slot on that slot's rows ("slot 3"), so overlapping
requests read apart; every round's bounds go into the one clock alignment.
Open the trace in https://ui.perfetto.dev or chrome://tracing.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass
class Span:
    rank: int
    name: str
    start_s: float  # on rank 0's clock (a later rank's after alignment)
    end_s: float
    round: int
    tid: int = 0  # a row of its own for a round's send and wait while several rounds are in flight (spec.in_flight)
    slot: int | None = None  # serving: the slot of the request the round belongs to (its rows: slot_row)
    request: int | None = None  # serving: that request's index


SLOT_ROWS = 16  # serving: each slot's rows in a rank's process (its main row, then its rounds on the way)


def slot_row(slot: int | None, row: int = 0) -> int:
    """The trace row (tid) of a slot's spans: one block of rows per slot, so overlapping requests read apart."""
    return row if slot is None else slot * SLOT_ROWS + row % SLOT_ROWS


@dataclass
class Part:
    """One generation's rounds in a trace and the later ranks' readings of them (per round: the last rank's
    four marks, and with N > 2 each middle rank's). Serving merges several, overlapping in time."""
    gen: object
    marks: list[list[float]]
    middle_marks: list[list[list[float]]] | None = None
    slot: int | None = None
    request: int | None = None


@dataclass
class ClockAlignment:
    offset_ms: float  # the later rank's clock minus rank 0's
    uncertainty_ms: float  # half-width of the interval every round allows
    rounds: int
    consistent: bool  # false: the rounds' bounds contradict each other (drift); NTP fallback used


def rank0_spans(gen, first: int = 0, slot: int | None = None, request: int | None = None) -> list[Span]:
    """Rank 0's spans from the round records (all on rank 0's perf_counter clock). The send, wait and
    commit edges are exact readings; draft and stage0 are placed by their durations. Serving: the rounds
    are numbered from `first` and tagged with the request's slot, on that slot's rows."""
    spans = []
    for i, r in enumerate(gen.rounds):
        start, sent = gen.t0_s + r.start_s, gen.t0_s + r.sent_s
        replied = sent + r.round_ms / 1000
        end = gen.t0_s + (gen.rounds[i + 1].start_s if i + 1 < len(gen.rounds) else gen.total_s)
        row = 1 + i % r.in_flight if r.in_flight > 1 else 0  # overlapping waits cannot share one row
        main, side = slot_row(slot), slot_row(slot, row)
        n = first + i
        spans += [Span(0, name, a, b, n, tid, slot, request) for name, a, b, tid in (
            ("round", start, end, main), ("draft", start, start + r.draft_ms / 1000, main),
            ("stage0", sent - r.stage0_ms / 1000, sent, main), ("send", sent, sent + r.send_ms / 1000, side),
            ("wait", sent + r.send_ms / 1000, replied, side), ("commit", replied, end, main))]
    return spans


def round_windows(gen) -> list[tuple[float, float]]:
    """Rank 0's (send start, reply received) per round."""
    return [(gen.t0_s + r.sent_s, gen.t0_s + r.sent_s + r.round_ms / 1000) for r in gen.rounds]


def align_clocks(windows: list[tuple[float, float]], marks: list[list[float]],
                 min_one_way_s: float = 0.0, hops: tuple[int, int] = (1, 1),
                 held: list[tuple[float, float]] | None = None) -> ClockAlignment:
    """theta (a later rank's clock minus rank 0's) from the round trips (`marks`: that rank's, per round); see the
    module docstring. N > 2: `hops`, the messages from rank 0 to this rank and from it back to rank 0 (rank r: r in, N - r back), each taking
    at least `min_one_way_s`; `held`, per round, how long the ranks on the way in and on the way back
    held the block (durations each measured on its own clock)."""
    held = held or [(0.0, 0.0)] * len(windows)
    pairs = [(w, m, h) for w, m, h in zip(windows, marks, held) if m]
    if not pairs:
        return ClockAlignment(0.0, float("inf"), 0, False)
    lo = max(m[3] + hops[1] * min_one_way_s + h[1] - w[1] for w, m, h in pairs)
    hi = min(m[1] - hops[0] * min_one_way_s - h[0] - w[0] for w, m, h in pairs)
    if lo <= hi:
        return ClockAlignment((lo + hi) / 2 * 1000, (hi - lo) / 2 * 1000, len(pairs), True)
    w, m, h = min(pairs, key=lambda p: (p[0][1] - p[0][0]) - (p[1][3] - p[1][1]) - sum(p[2]))  # least time on the wire
    theta = ((m[1] - h[0] - w[0]) + (m[3] + h[1] - w[1])) / 2
    wire = (w[1] - w[0]) - (m[3] - m[1]) - sum(h) - sum(hops) * min_one_way_s
    return ClockAlignment(theta * 1000, wire / 2 * 1000, len(pairs), False)


def rank_spans(marks: list[list[float]], offset_ms: float, rank: int = 1, verifies: bool = True,
               parts: list[tuple[int | None, int | None]] | None = None) -> list[Span]:
    """A later rank's spans on rank 0's clock (`rank`'s: the last one verifies; a middle one only forwards).
    A send lasts until the rank waits for its next round (the next wait in time: serving interleaves the
    requests' rounds); the last one has no end reading, so it is left out. `parts`: per round, the
    (slot, request) it belongs to (serving)."""
    theta = offset_ms / 1000
    order = sorted((m[0], i) for i, m in enumerate(marks) if m)  # the rank's own order of rounds
    spans = []
    for n, (_, i) in enumerate(order):
        wait_start, recv_end, forward_end, send_start = (x - theta for x in marks[i])
        slot, request = parts[i] if parts else (None, None)
        tid = slot_row(slot)
        spans += [Span(rank, "wait", wait_start, recv_end, i, tid, slot, request),
                  Span(rank, f"stage{rank}", recv_end, forward_end, i, tid, slot, request)]
        if verifies:
            spans.append(Span(rank, "verify", forward_end, send_start, i, tid, slot, request))
        if n + 1 < len(order) and order[n + 1][0] - theta > send_start:  # rounds run as one forward share their marks
            spans.append(Span(rank, "send", send_start, order[n + 1][0] - theta, i, tid, slot, request))
    return spans


def chrome_trace(spans: list[Span], t0_s: float, alignment: ClockAlignment, meta: dict | None = None) -> dict:
    """Chrome-trace JSON ("X" complete events in microseconds since generation start), one process per
    rank, and a flow arrow per message (round: rank 0 send -> rank 1 stage1 (-> rank 2 stage2 ...); reply: the
    last rank's verify -> rank 0)."""
    us = lambda t: round((t - t0_s) * 1e6, 3)  # noqa: E731
    ranks = sorted({s.rank for s in spans} | {0, 1})
    events = [{"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}} for r in ranks]
    events += [{"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}} for r in ranks]
    events += slot_row_names(spans)
    for s in spans:
        tags = {"round": s.round} if s.slot is None else {"round": s.round, "slot": s.slot, "request": s.request}
        events.append({"name": s.name, "cat": "round" if s.name == "round" else "span", "ph": "X", "ts": us(s.start_s),
                       "dur": round((s.end_s - s.start_s) * 1e6, 3), "pid": s.rank, "tid": s.tid, "args": tags})
    by_key = {(s.rank, s.name, s.round): s for s in spans}
    n, last = len(ranks), ranks[-1]
    for (rank, name, i), s in by_key.items():
        if rank == 0 and name == "send":  # the block's way down the pipe, one arrow per hop
            for hop in range(1, n):
                came_from = s.start_s if hop == 1 else by_key.get((hop - 1, f"stage{hop - 1}", i), s).end_s
                if (hop, f"stage{hop}", i) in by_key:
                    events += _flow(f"round {i}", n * i + hop - 1, came_from, hop - 1,
                                    by_key[(hop, f"stage{hop}", i)].start_s, hop, us)
        if rank == last and name == "verify" and (0, "wait", i) in by_key:
            events += _flow(f"reply {i}", n * i + n - 1, s.end_s, last, by_key[(0, "wait", i)].end_s, 0, us)
    other = {"clock_offset_ms": alignment.offset_ms, "clock_uncertainty_ms": alignment.uncertainty_ms,
             "clock_rounds": alignment.rounds, "clock_consistent": alignment.consistent, **(meta or {})}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def slot_row_names(spans: list[Span]) -> list[dict]:
    """Serving: each slot's rows named after it (in the order of the slots)."""
    rows = sorted({(s.rank, s.tid, s.slot) for s in spans if s.slot is not None})
    return [event for rank, tid, slot in rows for event in (
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
         "args": {"name": f"slot {slot}" if tid == slot_row(slot) else f"slot {slot}: rounds on the way"}},
        {"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid, "args": {"sort_index": tid}})]


def _flow(name, flow_id, t_from, pid_from, t_to, pid_to, us):
    common = {"name": name, "cat": "message", "id": flow_id, "tid": 0}
    return [{**common, "ph": "s", "ts": us(t_from), "pid": pid_from},
            {**common, "ph": "f", "bp": "e", "ts": us(t_to), "pid": pid_to}]


def build_timeline(gen, last_marks: list[list[float]], meta: dict | None = None,
                   min_one_way_s: float = 0.0, middle_marks: list[list[list[float]]] | None = None) -> tuple[dict, ClockAlignment]:
    """The merged trace of one generation, and the clock alignment it used (the last rank's).
    `middle_marks` (N > 2): per round, each middle rank's readings (Reply.middle_marks)."""
    return merged_timeline([Part(gen, last_marks, middle_marks)], meta, min_one_way_s)


def merged_timeline(parts: list[Part], meta: dict | None = None, min_one_way_s: float = 0.0) -> tuple[dict, ClockAlignment]:
    """The merged trace of several generations (serving: requests whose rounds interleave through the pipe),
    their rounds numbered one after another, and the clock alignment every round's bounds give."""
    parts = [_trimmed(p) for p in parts]
    middle_marks = [m for p in parts for m in p.middle_marks or [[]] * len(p.marks)]
    last_marks = [m for p in parts for m in p.marks]
    windows = [w for p in parts for w in round_windows(p.gen)]
    tags = [(p.slot, p.request) for p in parts for _ in p.marks] if any(p.slot is not None for p in parts) else None
    middles = max((len(m) for m in middle_marks), default=0)
    last = middles + 1
    marks = {r: [m[r - 1] if len(m) >= r else [] for m in middle_marks] for r in range(1, last)}
    marks[last] = last_marks
    held = {r: [m[3] - m[1] if m else 0.0 for m in marks[r]] for r in marks}  # a rank's own reading: no offset in it

    def held_around(r: int) -> list[tuple[float, float]]:
        return [(sum(held[q][i] for q in range(1, r)), sum(held[q][i] for q in range(r + 1, last + 1)))
                for i in range(len(last_marks))]
    alignments = {r: align_clocks(windows, marks[r], min_one_way_s, hops=(r, last + 1 - r),
                                  held=held_around(r)) for r in marks}
    alignment = alignments[last]
    spans, first = [], 0
    for p in parts:
        spans += rank0_spans(p.gen, first, p.slot, p.request)
        first += len(p.gen.rounds)
    for r in marks:
        spans += rank_spans(marks[r], alignments[r].offset_ms if alignments[r].rounds else 0.0, rank=r,
                             verifies=r == last, parts=tags)
    if middles:
        meta = {**(meta or {}), "clock_offsets_ms": {str(r): alignments[r].offset_ms for r in sorted(alignments)},
                "clock_uncertainties_ms": {str(r): alignments[r].uncertainty_ms for r in sorted(alignments)}}
    return chrome_trace(spans, min(p.gen.t0_s for p in parts), alignment, meta), alignment


def _trimmed(p: Part) -> Part:
    """The part's rounds and readings, as many of each (a round whose reply never came has none)."""
    n = min(len(p.gen.rounds), len(p.marks))
    gen = p.gen if n == len(p.gen.rounds) else replace(p.gen, rounds=p.gen.rounds[:n])
    return replace(p, gen=gen, marks=p.marks[:n], middle_marks=p.middle_marks[:n] if p.middle_marks else None)


def write_trace(path: Path, trace: dict) -> None:
    from launch.private_files import write_private
    write_private(path, json.dumps(trace, separators=(",", ":")))


def alignment_dict(alignment: ClockAlignment) -> dict:
    return asdict(alignment)
