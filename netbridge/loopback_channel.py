"""The direct link between two ranks of one host: frames over a TCP connection on 127.0.0.1.

Two ranks of one host need neither the relay nor its encryption: their bytes never leave the machine. One
end listens (`LoopbackListener`: a port and a random token, which the launch publishes through torchrun's
store, launch.transport.local_link), the other connects and presents the token, so a stray connection to
that port is turned away. Then each frame goes as a length and the bytes (netbridge.frames), as the other
channels carry them.

A peer that dies closes its socket (the kernel does, on this host), so its loss is seen at once; a live
peer that sends nothing is a PeerError after transport.timeout_s, as on every Channel.
"""
from __future__ import annotations

import hmac
import secrets
import socket
import struct
import time

from netbridge.channel import Channel, PeerError, PeerSilent
from netbridge.frames import MAX_FRAME_BYTES, FrameError, decode

LENGTH = struct.Struct("!I")
TOKEN_BYTES = 16
_SMALL = 64 * 1024  # frames up to this size go out in one send with their length
LEFT_FRAMES, LEFT_WAIT_S = 64, 0.5  # a failed send looks this far into what the peer sent for its Error frame


class LoopbackChannel(Channel):
    """A Channel over a connected loopback socket: `kind` "local" (the link probe and the start-up lines say so)."""

    kind = "local"

    def __init__(self, sock: socket.socket, timeout_s: float, peer_name: str = "the other rank", **emulation):
        super().__init__(timeout_s, **emulation)
        self.sock, self.peer_name = sock, peer_name
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, port: int, token: bytes, timeout_s: float, peer_name: str = "the other rank", **emulation) -> LoopbackChannel:
        """Dial the listener of the peer on this host and present its token."""
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
            sock.sendall(token)
        except OSError as e:
            raise PeerError(f"could not reach {peer_name} on this host at 127.0.0.1:{port} "
                            f"({e.strerror or type(e).__name__}); is it still running?") from None
        return cls(sock, timeout_s, peer_name, **emulation)

    def send_frame(self, frame: bytes) -> None:
        header = LENGTH.pack(len(frame))
        try:
            self.sock.settimeout(self.timeout_s)  # callers may shorten timeout_s (a last "error" message)
            if len(frame) <= _SMALL:
                self._send_all(header + frame)
            else:
                self._send_all(header)
                self._send_all(frame)
        except socket.timeout:
            raise PeerError(f"{self.peer_name} took no bytes for {self.timeout_s:g} s (transport.timeout_s); is it stuck?") from None
        except OSError as e:
            cause = self._left_word()
            if cause is not None:
                raise PeerError(f"{self.peer_name} failed: {cause}") from None
            raise PeerError(f"lost {self.peer_name} on this host while sending ({e.strerror or type(e).__name__}): "
                            "its process ended") from None

    def _left_word(self) -> str | None:
        """After a send failed: the cause in the Error frame the peer left before its socket closed (a rank that
        fails says why on its links first), if its bytes are still in this end's buffer; None when there is none."""
        try:
            for _ in range(LEFT_FRAMES):
                msg = decode(self.recv_frame(LEFT_WAIT_S))
                if msg.kind == "error":
                    return str(msg.meta.get("error", "?"))
        except (PeerError, FrameError, OSError):
            pass
        return None

    def _send_all(self, data) -> None:
        # Not sendall: its timeout bounds the whole call; here each send() waits at most the timeout for room
        view, sent = memoryview(data).cast("B"), 0
        while sent < len(view):
            sent += self.sock.send(view[sent:])

    def recv_frame(self, timeout_s: float | None = None) -> bytes:
        self.sock.settimeout(self.timeout_s if timeout_s is None else timeout_s)
        (n,) = LENGTH.unpack(self._read(LENGTH.size, frame_started=False))
        if not 0 < n <= MAX_FRAME_BYTES:
            raise PeerError(f"{self.peer_name} announced a frame of {n} bytes (bound {MAX_FRAME_BYTES}); garbage on the wire")
        return bytes(self._read(n, frame_started=True))

    def _read(self, n: int, frame_started: bool) -> bytearray:
        out, got = bytearray(n), 0
        view = memoryview(out)
        while got < n:
            try:
                k = self.sock.recv_into(view[got:])
            except socket.timeout:
                raise PeerSilent(f"{self.peer_name} sent nothing for {self.timeout_s:g} s (transport.timeout_s); "
                                "is it still running?") from None
            except OSError as e:
                k, why = 0, e.strerror or type(e).__name__
            else:
                why = "closed by the other end"
            if k == 0:
                where = " in the middle of a frame" if frame_started or got else ""
                raise PeerError(f"lost {self.peer_name} on this host ({why}{where}): its process ended")
            got += k
        return out

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the peer's next receive fails at once
        except OSError:
            pass
        self.sock.close()


class LoopbackListener:
    """The listening end: bound at once (so the port can be published before anyone waits), accepting later."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.token = secrets.token_bytes(TOKEN_BYTES)

    def accept(self, timeout_s: float, peer_name: str = "the other rank", **emulation) -> LoopbackChannel:
        """The channel to the first connection that presents the token within `timeout_s`; others are closed."""
        deadline = time.monotonic() + timeout_s
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                try:
                    sock, _ = self.sock.accept()
                except socket.timeout:
                    break
                if self._presents_token(sock, deadline):
                    return LoopbackChannel(sock, timeout_s, peer_name, **emulation)
                sock.close()
        finally:
            self.sock.close()
        raise PeerError(f"{peer_name} did not connect to this rank's port 127.0.0.1:{self.port} within {timeout_s:g} s "
                        "(transport.timeout_s); is it started on this host?")

    def _presents_token(self, sock: socket.socket, deadline: float) -> bool:
        sock.settimeout(max(0.1, min(5.0, deadline - time.monotonic())))
        got = b""
        try:
            while len(got) < TOKEN_BYTES:
                chunk = sock.recv(TOKEN_BYTES - len(got))
                if not chunk:
                    return False
                got += chunk
        except OSError:
            return False
        return hmac.compare_digest(got, self.token)

    def close(self) -> None:
        self.sock.close()


def loopback_pair(timeout_s: float = 60.0, **emulation) -> tuple[LoopbackChannel, LoopbackChannel]:
    """(the listening end, the connecting end) of one loopback link in this process (tests, benchmarks)."""
    listener = LoopbackListener()
    dialer = LoopbackChannel.connect(listener.port, listener.token, timeout_s, **emulation)
    return listener.accept(timeout_s, **emulation), dialer
