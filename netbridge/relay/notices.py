"""Notices: a claim for a session was refused, and the members of that session that wait are told.

A refused node (a wrong token, a rank already taken, another --nnodes) would otherwise leave the nodes it
was meant to meet waiting out their timeout in silence. The ones waiting now get a NOTICE frame; a member
that starts waiting within REFUSAL_MEMORY_S of a refusal is told on joining (the refused node may well
have come first). A wrong-token claim is unauthenticated, so its notice says "claiming". Anyone who knows
a session id can send bad claims for it, so notices are rate-limited per session and bounded in length,
and the refusals remembered are bounded in number.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable

from netbridge.link import notice_frame

Member = Any  # a connection of the relay: told a notice through its .tell(frame)

log = logging.getLogger("tandem.relay")

# At most one notice per session this often: anyone who knows a session id can send bad claims for it,
# and must not be able to flood a waiting node's terminal
NOTICE_INTERVAL_S = 1.0
REFUSAL_MEMORY_S = 60.0  # a refusal is told to members that start waiting this long after it
MAX_REMEMBERED_REFUSALS = 256  # sessions whose last refusal is kept (strangers can invent session ids)


class RefusalNotices:
    """Recent refusals by session, and the rate limit on telling the members that wait."""

    def __init__(self, waiting_members: Callable[[str], list]):
        self.waiting_members = waiting_members  # session -> its members still waiting, with an open transport
        self.notice_due: dict[str, float] = {}  # session -> when it may get its next notice (entries swept once due)
        self.last_refusal: OrderedDict[str, tuple[float, str]] = OrderedDict()  # session -> (when, notice), oldest first

    def refused_claim(self, session: str, text: str) -> None:
        """A claim for `session` was refused: remember it for members yet to come, tell those waiting now."""
        self.last_refusal.pop(session, None)
        self.last_refusal[session] = (time.monotonic(), text)
        if len(self.last_refusal) > MAX_REMEMBERED_REFUSALS:
            self.last_refusal.popitem(last=False)
        self.notify_waiting(session, text)

    def tell_recent_refusal(self, conn: Member) -> None:
        """A member starts waiting: if a claim for its session was refused lately, it hears of it now."""
        when, text = self.last_refusal.get(conn.session, (None, ""))
        if when is not None and time.monotonic() - when <= REFUSAL_MEMORY_S:
            conn.tell(notice_frame(f"{text} ({time.monotonic() - when:.0f} s before this node came)"))

    def notify_waiting(self, session: str, text: str) -> None:
        """Send `text` as a NOTICE to the members of `session` that still wait (for their peer or for the
        rendezvous); at most once per NOTICE_INTERVAL_S per session. Paired connections get nothing: their
        stream carries the peer's frames, and a refused stranger is no news to a running session."""
        waiting = self.waiting_members(session)
        now = time.monotonic()
        if not waiting or now < self.notice_due.get(session, 0.0):
            return
        self.notice_due[session] = now + NOTICE_INTERVAL_S
        frame = notice_frame(text)
        for member in waiting:
            member.tell(frame)
        log.info("session %s: told %d waiting member(s): %s", session, len(waiting), text)

    def sweep(self, now: float) -> None:
        """Forget rate limits that have run out and refusals too old to tell (both tables stay bounded)."""
        for session, due in list(self.notice_due.items()):
            if due <= now:
                del self.notice_due[session]
        while self.last_refusal and now - next(iter(self.last_refusal.values()))[0] > REFUSAL_MEMORY_S:
            self.last_refusal.popitem(last=False)
