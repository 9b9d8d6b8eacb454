"""Link frames: how a client and the relay talk once the handshake of netbridge.auth is done.

Every frame is a 5-byte header, then its body:

    u8 type | u32 length (of the body, network byte order) | body

    DATA       1  one end-to-end envelope (netbridge.secure), 1..MAX_FRAME_BYTES bytes; client -> relay -> peer
    HEARTBEAT  2  empty; sent by a client that has nothing else to say, forwarded once paired
    PAIRED     3  empty; relay -> both data ranks: the other rank of the session is there
    PEER_LEFT  4  empty; relay -> a data rank: the other rank left (sent only at a frame boundary)
    RDZV_DONE  5  RDZV_BODY; relay -> each torchrun agent: its node rank and the run's store token
    NOTICE     6  UTF-8 text, 1..MAX_NOTICE_BYTES; relay -> a client still waiting (for PAIRED or RDZV_DONE): a
                  claim for its session was refused (e.g. a node with the wrong secret); the client warns, keeps waiting
    DIAL       7  a connection id (ASCII); relay -> a registered service's control connection: dial back for that
                  client (netbridge.backend); the control connection's heartbeats are answered with one

Bounds: a header is judged before any of its body is read, so a claimed length never makes anyone
allocate. The relay drops a connection on an unknown type, a heartbeat with a body, or DATA that
is empty or longer than its --max-frame-bytes (and on NOTICE: only the relay sends it); a client
(LinkSocket.recv) refuses an unknown type, empty DATA, a NOTICE that is empty or over MAX_NOTICE_BYTES,
or any length above its bound (LinkGarbage).

Standard library only: the relay imports this module and must stay small (no torch).
"""
from __future__ import annotations

import select
import socket
import struct
import threading
import time

HEADER = struct.Struct("!BI")
DATA, HEARTBEAT, PAIRED, PEER_LEFT, RDZV_DONE, NOTICE, DIAL = 1, 2, 3, 4, 5, 6, 7
KINDS = (DATA, HEARTBEAT, PAIRED, PEER_LEFT, RDZV_DONE, NOTICE, DIAL)
RDZV_BODY = struct.Struct("!BB16sB")  # node rank, world, store token (hex), where the store is (STORE_AT_*)
# RDZV_BODY's last field: older relays hosted the run's store themselves (1, or 0 when they could not start it);
# this version's relay has node rank 0's agent host it and reach it through the dial-back
STORE_AT_RELAY, STORE_AT_NODE0 = 1, 2
# One frame's bound, for the link and for netbridge.frames alike: a 64k-token prefill of hidden size
# 2048 in bf16.
MAX_FRAME_BYTES = 256 * 1024 * 1024
# A notice is one line for a human; the bound keeps what a stranger can make a waiting node print small.
MAX_NOTICE_BYTES = 400

_SMALL = 64 * 1024  # frames up to this size go out in one send together with their header
_WAIT_TICK_S = 0.5  # the longest a receive sleeps in poll() before it checks liveness again
# While a client waits at the relay (for its peer, for the rendezvous) it says so this often: a join timeout
# of 120 s in silence looks like a hang
WAITING_LINE_S = 10.0


class LinkTimeout(Exception):
    """The deadline of one receive passed (the caller turns it into a message)."""


class LinkClosed(Exception):
    """The connection ended; `mid_frame` says whether part of a frame had already come."""

    def __init__(self, mid_frame: bool, reason: str = ""):
        super().__init__(reason)
        self.mid_frame, self.reason = mid_frame, reason


class LinkGarbage(Exception):
    """A header no Tandem relay sends: the other end is not a relay of this version (the text says so)."""


class UnexpectedFrame(Exception):
    """A well-formed frame of a kind that has no place at this point of the exchange."""

    def __init__(self, kind: int):
        super().__init__(f"frame type {kind}")
        self.kind = kind


class LinkSocket:
    """Link frames over a connected socket, with deadlines.

    Receiving waits in poll() in short slices so the caller can check liveness while it waits; a
    frame body is read straight into its own buffer. Sending is serialized by a lock, so a heartbeat
    thread may send while the owner receives.
    """

    def __init__(self, sock: socket.socket, name: str, send_timeout_s: float, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.sock, self.name, self.max_frame_bytes = sock, name, max_frame_bytes
        sock.settimeout(send_timeout_s)  # bounds each send call (no progress that long = stalled); receives poll first
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)
        self.lock = threading.Lock()
        self.buf = bytearray(256 * 1024)
        self.start = self.end = 0
        now = time.monotonic()
        self.last_rx = self.last_tx = now

    def send(self, kind: int, body: bytes | bytearray | memoryview = b"") -> None:
        header = HEADER.pack(kind, len(body))
        with self.lock:
            if len(body) <= _SMALL:
                self._send_all(header + body)
            else:
                self._send_all(header)
                self._send_all(body)
            self.last_tx = time.monotonic()

    def _send_all(self, data) -> None:
        # Not sendall: its timeout bounds the whole call, and a big frame on a slow link may rightly take
        # longer than that. Each send() here waits at most the timeout for room: a timeout means no progress.
        view, sent = memoryview(data).cast("B"), 0
        while sent < len(view):
            sent += self.sock.send(view[sent:])

    def try_heartbeat(self) -> None:
        """Send a heartbeat unless a send is in progress (bytes moving are liveness enough)."""
        if self.lock.acquire(blocking=False):
            try:
                self._send_all(HEADER.pack(HEARTBEAT, 0))
                self.last_tx = time.monotonic()
            finally:
                self.lock.release()

    def wait_for(self, kind: int, deadline: float, heartbeat_s: float, on_notice=None, still_waiting=None) -> bytes:
        """Body of the next frame of `kind`, sending a heartbeat every `heartbeat_s` while waiting (the relay
        drops a silent client). Heartbeats that arrive are skipped; the text of a NOTICE goes to `on_notice`
        (skipped without one) and the wait goes on; `still_waiting(now)` is called while nothing arrives (a
        WaitingLine). Raises UnexpectedFrame for any other kind, LinkTimeout once `deadline`
        (time.monotonic()) passes, LinkClosed, or LinkGarbage."""
        def keep_alive(now: float) -> None:
            if now - self.last_tx >= heartbeat_s:
                self.try_heartbeat()
            if still_waiting is not None:
                still_waiting(now)
        while True:
            got, body = self.recv(deadline, keep_alive, tick=min(_WAIT_TICK_S, heartbeat_s))
            if got == kind:
                return body
            if got == NOTICE:
                if on_notice is not None:
                    on_notice(notice_text(body))
            elif got != HEARTBEAT:
                raise UnexpectedFrame(got)

    def recv(self, deadline: float, on_wait=None, tick: float = _WAIT_TICK_S, progress_s: float | None = None):
        """(type, body) of the next frame. The header must come by `deadline`; once it has, the body may take
        as long as it keeps arriving (no `progress_s` without a byte). Raises LinkTimeout, LinkClosed,
        LinkGarbage, or what on_wait raises."""
        kind, length = HEADER.unpack(self._read(HEADER.size, deadline, on_wait, tick, False, None))
        if kind not in KINDS or length > self.max_frame_bytes or (kind == DATA and length == 0) or \
                (kind == NOTICE and not 0 < length <= MAX_NOTICE_BYTES):
            raise LinkGarbage(f"garbage from the relay at {self.name} (frame type {kind}, {length} bytes); "
                              "is that address a Tandem relay of the same version?")
        return kind, (self._read(length, deadline, on_wait, tick, True, progress_s) if length else b"")

    def _read(self, n: int, deadline: float, on_wait, tick: float, frame_started: bool, progress_s: float | None):
        avail = self.end - self.start
        if n <= avail:
            out = bytes(self.buf[self.start:self.start + n])
            self.start += n
            return out
        if n <= len(self.buf):  # small: gather in the ring buffer
            if self.start:
                self.buf[:avail] = self.buf[self.start:self.end]
                self.start, self.end = 0, avail
            view = memoryview(self.buf)
            while self.end < n:
                dl = time.monotonic() + progress_s if progress_s else deadline
                self.end += self._recv_into(view[self.end:], dl, on_wait, tick, frame_started or self.end > 0)
            out = bytes(self.buf[:n])
            self.start = n
            return out
        out = bytearray(n)  # large: straight into the frame's own buffer, at most the frame bound
        out[:avail] = self.buf[self.start:self.end]
        self.start = self.end = 0
        view, got = memoryview(out), avail
        while got < n:
            got += self._recv_into(view[got:], time.monotonic() + progress_s if progress_s else deadline, on_wait, tick, True)
        return out

    def _recv_into(self, view: memoryview, deadline: float, on_wait, tick: float, mid_frame: bool) -> int:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise LinkTimeout()
            try:
                ready = self.poll.poll(max(1, int(min(tick, deadline - now) * 1000)))
            except OSError as e:
                raise LinkClosed(mid_frame, e.strerror or "poll failed") from None
            if not ready:
                # liveness is judged only while nothing is there to read: after a long computation the
                # owner may come back to bytes that arrived long ago, and last_rx is as old as its last read
                if on_wait is not None:
                    on_wait(time.monotonic())
                continue
            try:
                got = self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError, socket.timeout):
                continue
            except OSError as e:
                raise LinkClosed(mid_frame, e.strerror or type(e).__name__) from None
            if got == 0:
                raise LinkClosed(mid_frame, "closed by the other end")
            self.last_rx = time.monotonic()
            return got

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# ---- notices: the relay telling a waiting client that a claim for its session was refused ---------
def notice_frame(text: str) -> bytes:
    """A whole NOTICE frame; the text is cut to MAX_NOTICE_BYTES at a word boundary, never mid-character."""
    body = clip_words(text, MAX_NOTICE_BYTES).encode()
    return HEADER.pack(NOTICE, len(body)) + body


def clip_words(text: str, max_bytes: int) -> str:
    """`text` in at most `max_bytes` of UTF-8, cut at the last space that fits (with an ellipsis) when too long."""
    if len(text.encode()) <= max_bytes:
        return text
    room = max_bytes - len(" ...".encode())
    head = text.encode()[:room].decode("utf-8", "ignore")
    cut = head.rfind(" ")
    return (head[:cut] if cut > 0 else head) + " ..."


def notice_text(body: bytes) -> str:
    """A notice as one printable line: whatever bytes came, no control characters reach the terminal."""
    text = body.decode("utf-8", "replace")
    return "".join(ch if ch.isprintable() else " " for ch in text)


class WaitingLine:
    """Says every WAITING_LINE_S that a wait at the relay goes on: `say(waited_s)` writes the line."""

    def __init__(self, say):
        self.say, self.every_s = say, WAITING_LINE_S
        self.start = time.monotonic()
        self.next_at = self.start + self.every_s

    def __call__(self, now: float) -> None:
        if now >= self.next_at:
            self.next_at = now + self.every_s
            self.say(now - self.start)


class NoticeBoard:
    """What a waiting client heard from the relay: each distinct notice is printed once (at most
    `max_printed` of them, since a stranger can cause them), and the last one is kept for the final message."""

    def __init__(self, warn, max_printed: int = 5):
        self.warn, self.max_printed = warn, max_printed
        self.printed: set[str] = set()
        self.last: str | None = None

    def __call__(self, text: str) -> None:
        self.last = text
        if text not in self.printed and len(self.printed) < self.max_printed:
            self.printed.add(text)
            self.warn(text)

    def suffix(self) -> str:
        """'; <the last notice>' for a timeout message, or '' when none came."""
        return f"; {self.last}" if self.last else ""
