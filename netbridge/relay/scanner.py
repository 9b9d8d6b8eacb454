"""Pure: following one client's stream of link frames (netbridge.link) without holding a body, and saying
which byte ranges go on to its peer. No socket, no state of anyone else: the connection acts on what it returns."""
from __future__ import annotations

from netbridge.link import DATA, HEADER, HEARTBEAT


class LinkFrameScanner:
    """Follows one client's stream of link frames without ever holding a body: checks each header once it
    is complete, and says which byte ranges go on to the peer (a header only once complete and checked)."""

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self.hdr = bytearray()  # header bytes seen so far
        self.body_left = 0  # body bytes of the current frame still to come
        self.fwd = False  # the current frame goes to the peer

    def scan(self, data: bytes, paired: bool) -> tuple[list, int, str | None]:
        """(pieces for the peer: (start, end) into data, or bytes; bytes of the frames begun; an error that
        ends the connection, or None). The pieces stop at the frame in error."""
        mv = memoryview(data)
        n, i = len(mv), 0
        out: list = []
        forwarded = 0
        while i < n:
            if self.body_left:
                k = min(self.body_left, n - i)
                if self.fwd:
                    out.append((i, i + k))
                self.body_left -= k
                i += k
                continue
            start, hdr_was = i, len(self.hdr)
            k = min(HEADER.size - hdr_was, n - i)
            self.hdr += mv[i:i + k]
            i += k
            if len(self.hdr) < HEADER.size:
                break
            kind, length = HEADER.unpack(self.hdr)
            whole_header = bytes(self.hdr)
            self.hdr.clear()
            error = self._check(kind, length, paired)
            if error:
                return out, forwarded, error
            self.fwd = paired
            if self.fwd:
                out.append((start, i) if hdr_was == 0 else whole_header)
                forwarded += length + HEADER.size
            self.body_left = length
        return out, forwarded, None

    def _check(self, kind: int, length: int, paired: bool) -> str | None:
        if kind == HEARTBEAT:
            return None if length == 0 else f"heartbeat with a {length}-byte body"
        if kind == DATA:
            if not paired:
                return "sent data before its peer joined"
            if not 0 < length <= self.max_frame_bytes:
                return f"frame of {length} bytes outside the bound (1..{self.max_frame_bytes})"
            return None
        return f"unknown frame type {kind}"

    def at_boundary(self) -> bool:
        """True when the bytes forwarded so far end at a frame boundary of the peer's stream."""
        return not (self.fwd and self.body_left)  # header bytes are forwarded only once complete
