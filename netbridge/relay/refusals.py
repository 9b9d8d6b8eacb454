"""Refused handshakes by source address: slowed, and logged as counts, not one line per dial.

A stranger (or a node with the wrong relay token in a retry loop) can dial as fast as the relay answers.
So each source's refusals in a row (each within WINDOW_S of the one before) delay its next REFUSED
answer: none for the first (an honest node with the wrong token learns it at once), then 1/16 of
--max-refusal-delay-s, doubling to that bound. The delay is per source: a source with no refusals is
never slowed, whatever another does. The delayed connection keeps its handshake slot meanwhile (see
Connection.refuse), so --max-pending-per-source bounds how many one source has waiting.

The log: the first refusal of a run from a source is one line at once, naming the connection and the
cause; the rest are counted, and every LOG_INTERVAL_S one line per source tells how many more there
were. A flood from many addresses (an IPv6 /48 holds 65,536 /64s) must not become a flood of lines
either: at most LINES_PER_INTERVAL sources get their own line per interval, the others one line together.
The table holds at most MAX_SOURCES sources; the least recently refused is forgotten first.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("tandem.relay")

MAX_REFUSAL_DELAY_S = 2.0  # default --max-refusal-delay-s
WINDOW_S = 10.0  # a refusal this long after the last one from its source starts a new run (no delay)
LOG_INTERVAL_S = 10.0
LINES_PER_INTERVAL = 5  # sources told apart per interval (their first refusal, or their count)
MAX_SOURCES = 4096


@dataclass
class SourceRefusals:
    streak: int = 0  # refusals in a row, each within WINDOW_S of the one before
    last_at: float = 0.0
    unlogged: int = 0  # refused since this source's last line
    since: float = 0.0  # when the first of those came
    why: str = ""  # the cause of the last one


class RefusalsBySource:
    """Per source: how long to hold its next refusal, and what is still to be logged about it."""

    def __init__(self, max_delay_s: float = MAX_REFUSAL_DELAY_S, interval_s: float = LOG_INTERVAL_S,
                 max_sources: int = MAX_SOURCES):
        self.max_delay_s, self.interval_s, self.max_sources = max(0.0, max_delay_s), interval_s, max(1, max_sources)
        self.table: OrderedDict[str, SourceRefusals] = OrderedDict()  # least recently refused first
        self.lines_left = LINES_PER_INTERVAL  # this interval's own lines, for first refusals and counts alike
        self.next_summary_at: float | None = None  # the end of this interval (the first sweep starts the first)
        self.forgotten = 0  # refusals of sources dropped from the full table before their count was logged

    def refused(self, source: str, name: str, why: str, now: float) -> float:
        """Count one refusal of connection `name` from `source`; returns how long to hold its answer."""
        entry = self.table.pop(source, None) or SourceRefusals()
        self.table[source] = entry
        if len(self.table) > self.max_sources:
            self.forgotten += self.table.popitem(last=False)[1].unlogged
        entry.streak = entry.streak + 1 if now - entry.last_at <= WINDOW_S else 1
        entry.last_at, entry.why = now, why
        if entry.streak == 1 and not entry.unlogged and self._take_line():
            log.warning("%s: handshake refused: %s", name, why)
        else:
            entry.since = entry.since if entry.unlogged else now
            entry.unlogged += 1
        return self.delay(entry.streak)

    def delay(self, streak: int) -> float:
        """None for the first of a run, then 1/16 of the bound, doubling up to it (the exponent capped: a streak
        of thousands, as a flood against --max-refusal-delay-s 0 makes, must not overflow a float)."""
        return 0.0 if streak <= 1 else min(self.max_delay_s, self.max_delay_s / 16 * 2 ** min(streak - 2, 4))

    def sweep(self, now: float) -> None:
        """Once an interval: one line per source refused since its last line (the busiest first, at most
        LINES_PER_INTERVAL, the rest together), and sources quiet for WINDOW_S forgotten."""
        if self.next_summary_at is None:
            self.next_summary_at = now + self.interval_s
        elif now >= self.next_summary_at:
            self.summarize(now)
            self.next_summary_at, self.lines_left = now + self.interval_s, LINES_PER_INTERVAL
        for source in [s for s, entry in self.table.items() if now - entry.last_at > WINDOW_S and not entry.unlogged]:
            del self.table[source]

    def summarize(self, now: float) -> None:
        """Log the counts not logged yet (each interval, and when the relay stops)."""
        due = sorted((item for item in self.table.items() if item[1].unlogged), key=lambda item: -item[1].unlogged)
        for source, entry in due[:LINES_PER_INTERVAL]:
            delay_s = self.delay(entry.streak)
            log.warning("refused %d dials from %s in the last %.0f s: %s; %s%s", entry.unlogged, source,
                        max(1.0, now - entry.since), entry.why, hint(entry.why),
                        f" (its refusals are answered {delay_s:.1f} s late now)" if delay_s else "")
        rest = due[LINES_PER_INTERVAL:]
        others = sum(entry.unlogged for _, entry in rest) + self.forgotten
        if others:
            log.warning("refused %d dials from other sources in the last %.0f s (a flood from many addresses? "
                        "rate-limit new connections in front of the relay)", others, self.interval_s)
        for _, entry in due:
            entry.unlogged = 0
        self.forgotten = 0

    def _take_line(self) -> bool:
        """One of this interval's own lines (sweep starts each interval with LINES_PER_INTERVAL)."""
        if self.lines_left <= 0:
            return False
        self.lines_left -= 1
        return True


def hint(why: str) -> str:
    """What to check, by the cause of a refusal (handshake.Refusal.why)."""
    if why.startswith("wrong MAC"):
        return ("is the relay token the same on every host? (the relay's --secret-file; the nodes' "
                "transport.relay_token_file or TANDEM_RELAY_TOKEN_FILE)")
    return "not a Tandem client of this version (a port scanner?)"
