"""The one interface the round loop talks to: send and receive messages (a kind, small control
fields, named tensors) to and from the other rank. Implementations move frames (netbridge.frames);
they differ only in how bytes reach the peer: gloo point-to-point here, the relay in netbridge.relay.
"""
from __future__ import annotations

import math
import queue
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from datetime import timedelta

import torch

from netbridge.delay import WireSchedule
from netbridge.frames import MAX_FRAME_BYTES, Message, decode, encode

# The meta field carrying a message's send time while a link is emulated; Channel.recv removes it
SENT_AT = "_sent_at"
BUNDLE = "bundle"  # the kind of a frame that carries several messages (Channel.send_all)
BUNDLE_BYTES = 1 << 20  # a bundle's tensors at most: decode rounds' blocks share a frame, a prompt's chunks do not


class PeerError(RuntimeError):
    """The other rank is gone, silent past the timeout, or speaking garbage."""


class PeerSilent(PeerError):
    """The other rank sent nothing within the channel's timeout_s (a wait with a bound of its own names it:
    launch.handshake's)."""


class Channel(ABC):
    """`send(kind, meta, **tensors)` / `recv(expect)`; with an emulated one-way delay and bandwidth.

    The emulation holds no sender (netbridge.delay): `send` stamps the message with the time it was handed
    over and returns; `recv` holds the message until its arrival on the emulated wire of its direction."""

    peer_name = "the other rank"  # in error lines; "rank 2" where there are more than two
    kind = "local"  # what carries the frames: "local" (one host), "relay" or "gloo"; the link probe reports it

    def __init__(self, timeout_s: float, emulate_delay_ms: float = 0.0, emulate_mbps: float = 0.0):
        self.timeout_s = timeout_s
        self.incoming = WireSchedule(emulate_delay_ms, emulate_mbps)  # the wire from the peer to this end
        self.unread: deque[Message] = deque()  # the rest of a bundle whose first message recv returned

    def send(self, kind: str, meta: dict | None = None, **tensors: torch.Tensor) -> None:
        meta = dict(meta or {})
        if self.incoming.active:  # both ends emulate the same link: the peer schedules this message
            meta[SENT_AT] = time.time()  # a clock both ends read alike on one host (and, NTP-synced, on two)
        self.send_frame(encode(Message(kind, meta, tensors)))

    def send_all(self, messages: list[Message]) -> None:
        """`messages` in as few frames as BUNDLE_BYTES allows; the peer's recv returns them one by one, in order. A
        frame costs both ends and the link a fixed amount whatever it carries (encoding, the channel's send and
        receive path, the relay's seal and hop: netbridge.link_probe's message_ms), so a batch of several streams'
        Rounds, and their Replies, travel as one frame, not one a row; a message too big to share one (a first
        round carrying a prompt's last chunk) goes alone, as it would have, so no frame outlasts a single one's."""
        for group in bundles(messages):
            if len(group) == 1:
                self.send(group[0].kind, group[0].meta, **group[0].tensors)
                continue
            parts, tensors = [], {}
            for i, msg in enumerate(group):
                parts.append([msg.kind, msg.meta, list(msg.tensors)])
                tensors.update({f"{i}/{name}": t for name, t in msg.tensors.items()})
            self.send(BUNDLE, {"parts": parts}, **tensors)

    def recv(self, expect: str | tuple[str, ...] | None = None) -> Message:
        if not self.unread:
            self.unread.extend(unbundle(self._recv_frame_message(), self.peer_name))
        msg = self.unread.popleft()
        kinds = (expect,) if isinstance(expect, str) else expect
        if expect is not None and msg.kind not in kinds:
            if msg.kind == "error":
                raise PeerError(f"{self.peer_name} failed: {msg.meta.get('error', '?')}")
            raise PeerError(f"protocol error: expected {' or '.join(kinds)}, got {msg.kind!r}; are both ranks the same "
                            "Tandem version and config?")
        return msg

    def _recv_frame_message(self) -> Message:
        frame = self.recv_frame()
        msg = decode(frame)
        sent = msg.meta.pop(SENT_AT, None)
        if isinstance(sent, (int, float)) and math.isfinite(sent) and self.incoming.active:
            self._until_arrival(float(sent), len(frame))
        return msg

    def _until_arrival(self, sent: float, nbytes: int) -> None:
        """EMULATION: wait until the message sent at `sent` has crossed the emulated wire. Never longer than
        its own transit from now: a peer clock running ahead cannot hold this end for longer."""
        arrival = self.incoming.arrival(sent, nbytes)
        wait = min(arrival - time.time(), arrival - sent)
        if wait > 0:
            time.sleep(wait)

    @abstractmethod
    def send_frame(self, frame: bytes) -> None: ...

    @abstractmethod
    def recv_frame(self) -> bytes: ...

    def close(self) -> None:
        pass


def bundles(messages: list[Message], limit: int = BUNDLE_BYTES) -> list[list[Message]]:
    """`messages` in order, in groups whose tensors hold at most `limit` bytes (a bigger message alone)."""
    groups, size = [], 0
    for msg in messages:
        nbytes = sum(t.numel() * t.element_size() for t in msg.tensors.values())
        if not groups or size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(msg)
        size += nbytes
    return groups


def unbundle(frame: Message, peer_name: str = "the other rank") -> list[Message]:
    """The messages a frame carries: itself, or a bundle's parts (Channel.send_all), each checked against the frame."""
    if frame.kind != BUNDLE:
        return [frame]
    parts, messages, used = frame.meta.get("parts"), [], set()
    try:
        for i, (kind, meta, names) in enumerate(parts):
            if not isinstance(kind, str) or kind == BUNDLE or not isinstance(meta, dict):
                raise TypeError
            messages.append(Message(kind, meta, {name: frame.tensors[f"{i}/{name}"] for name in names}))
            used.update(f"{i}/{name}" for name in names)
        if not messages or used != set(frame.tensors):
            raise TypeError
    except (TypeError, ValueError, KeyError):
        raise PeerError(f"protocol error: {peer_name} sent a malformed bundle frame; are both ranks the same Tandem "
                        "version?") from None
    return messages


class GlooChannel(Channel):
    """Frames over torch.distributed point-to-point (gloo): a length, then the bytes.

    A gloo send completes only when the peer receives it. Two ranks that both send before they receive
    (rank 0 with several rounds in flight, rank 1 with a reply to give) would wait on each other for good,
    so frames leave from a sender thread of this channel, in order; `send_frame` returns at once, as a
    socket's send does, and a failed send is raised by the next send or receive."""

    kind = "gloo"

    def __init__(self, peer: int, timeout_s: float, **emulation):
        super().__init__(timeout_s, **emulation)
        self.peer = peer
        self._outbox: queue.Queue = queue.Queue()
        self._send_error: PeerError | None = None
        self._sender: threading.Thread | None = None

    def send_frame(self, frame: bytes) -> None:
        self._raise_send_error()
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name=f"gloo-send-{self.peer}", daemon=True)
            self._sender.start()
        self._outbox.put(frame)

    def _send_loop(self) -> None:
        while (frame := self._outbox.get()) is not None:
            try:
                self._send_now(frame)
            except PeerError as e:
                self._send_error = e
                return

    def _send_now(self, frame: bytes) -> None:
        import torch.distributed as dist
        payload = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        self._wait(lambda: dist.isend(torch.tensor([payload.numel()], dtype=torch.int64), self.peer))
        self._wait(lambda: dist.isend(payload, self.peer))

    def _raise_send_error(self) -> None:
        if self._send_error is not None:
            raise self._send_error

    def close(self) -> None:
        """Let the frames already handed over leave (a Bye, an Error), within the timeout."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join(self.timeout_s)

    def recv_frame(self) -> bytes:
        self._raise_send_error()
        import torch.distributed as dist
        length = torch.zeros(1, dtype=torch.int64)
        self._wait(lambda: dist.irecv(length, self.peer))
        n = int(length.item())
        if not 0 < n <= MAX_FRAME_BYTES:
            raise PeerError(f"rank {self.peer} announced a frame of {n} bytes (bound {MAX_FRAME_BYTES}); garbage on the wire")
        payload = torch.empty(n, dtype=torch.uint8)
        self._wait(lambda: dist.irecv(payload, self.peer))
        return payload.numpy().tobytes()

    def _wait(self, start_op) -> None:
        """Start a gloo operation and wait for it, turning gloo's errors into one PeerError line: the peer's own
        cause when it left one (leave_last_words), else what gloo saw."""
        try:
            start_op().wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            words = last_words(self.peer)
            if words:
                raise PeerError(f"rank {self.peer} failed: {words}") from None
            cause = gloo_cause(str(e)) or type(e).__name__
            if "timed out" in cause.lower() or "timeout" in cause.lower():
                raise PeerSilent(f"rank {self.peer} sent nothing for {self.timeout_s:.0f} s (transport.timeout_s); is it still running? (gloo: {cause})") from None
            raise PeerError(f"lost rank {self.peer} (gloo: {cause}); the other process died or its host dropped off the network") from None


# A rank that fails says why in torchrun's store as well as on its channel: a gloo send completes only when the
# peer receives, so a rank that is itself sending (or loading) when its peer fails never reads the peer's Error
# frame; it sees only "Connection closed by peer". The store outlives the worker (torchrun's agent serves it).
LAST_WORDS = "tandem/last-words/rank{}"
LAST_WORDS_WAIT_S = 1.0  # a peer that is leaving writes its words before it closes its sockets


def leave_last_words(message: str) -> None:
    """Best effort: this rank's cause, for its peers' lines (last_words)."""
    store = _store()
    if store is not None:
        try:
            import torch.distributed as dist
            store.set(LAST_WORDS.format(dist.get_rank()), message)
        except Exception:  # noqa: BLE001 - the store may be gone too; the channel's Error is still tried
            pass


def last_words(rank: int) -> str | None:
    store = _store()
    if store is None:
        return None
    key = LAST_WORDS.format(rank)
    try:
        deadline = time.monotonic() + LAST_WORDS_WAIT_S
        while not store.check([key]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return store.get(key).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - no store, or its host is gone: gloo's own cause stands
        return None


def _store():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:  # noqa: BLE001 - a private helper: if it moves, the lines lose the peer's cause, nothing else
        return None


# gloo prefixes its errors with the C++ source location: "[/__w/pytorch/.../tcp/pair.cc:553] "
_GLOO_SOURCE_PREFIX = re.compile(r"^\[[^\]\s]+\.(?:cc|cpp|cxx|c|h|hpp):\d+\]\s*")


def gloo_cause(text: str, max_chars: int = 120) -> str:
    """The cause in one of gloo's error texts, for one readable line: its first line without the source
    location, up to the end of the first sentence (gloo appends generic advice after it), cut at a word
    boundary if still longer than `max_chars`. "" for an empty text."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    cause = _GLOO_SOURCE_PREFIX.sub("", lines[0])
    cause = re.split(r"(?<=[^\s.])\.(?:\s|$)", cause, maxsplit=1)[0]  # "peer. This is typically ..." -> "peer"
    return clip_at_word(cause, max_chars)


def clip_at_word(text: str, max_chars: int) -> str:
    """`text` if it fits in `max_chars`, else its longest run of whole words that fits, plus "..."."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars - 3]
    cut = head.rfind(" ")
    return (head[:cut] if cut > 0 else head).rstrip(" ,;:") + "..."


class LocalChannel(Channel):
    """Frames through in-process queues: two ranks as two threads of one process (tests, one-host
    demos). Frames are still encoded and decoded, so the protocol is exercised byte for byte."""

    def __init__(self, inbox, outbox, timeout_s: float, **emulation):
        super().__init__(timeout_s, **emulation)
        self.inbox, self.outbox = inbox, outbox

    def send_frame(self, frame: bytes) -> None:
        self.outbox.put(frame)

    def recv_frame(self) -> bytes:
        import queue
        try:
            frame = self.inbox.get(timeout=self.timeout_s)
        except queue.Empty:
            raise PeerSilent(f"{self.peer_name} sent nothing for {self.timeout_s:g} s (transport.timeout_s)") from None
        if frame is None:
            raise PeerError(f"lost {self.peer_name} (its end of the in-process channel was closed)")
        return frame

    def close(self) -> None:
        self.outbox.put(None)  # the peer's next receive fails at once instead of waiting out its timeout


def local_pair(timeout_s: float = 60.0, **emulation) -> tuple[LocalChannel, LocalChannel]:
    """(rank 0's channel, rank 1's channel), connected by a queue each way; `emulation`: as for any Channel."""
    import queue
    a_to_b, b_to_a = queue.Queue(), queue.Queue()
    return LocalChannel(b_to_a, a_to_b, timeout_s, **emulation), LocalChannel(a_to_b, b_to_a, timeout_s, **emulation)


def local_ring(ranks: int, timeout_s: float = 60.0, **emulation) -> list[tuple[LocalChannel, LocalChannel]]:
    """Each rank's (link from the rank before, link to the rank after) on the ring 0 -> 1 -> ... -> N-1 -> 0,
    for N ranks as threads of one process: one local_pair per two neighbours (launch.distributed.open_links'
    rule), so with two ranks both links are one channel."""
    pairs = {frozenset((r, (r + 1) % ranks)): local_pair(timeout_s, **emulation) for r in range(ranks)}

    def end(rank: int, peer: int) -> LocalChannel:  # the lower rank holds a pair's first end
        link = pairs[frozenset((rank, peer))][0 if rank < peer else 1]
        if len(pairs) > 1:  # one neighbour is "the other rank"
            link.peer_name = f"rank {peer}"
        return link
    return [(end(r, (r - 1) % ranks), end(r, (r + 1) % ranks)) for r in range(ranks)]
