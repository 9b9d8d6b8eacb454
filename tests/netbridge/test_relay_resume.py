"""RelayChannel surviving the network, and its end-to-end sealing, on loopback.

- the relay killed and restarted on the same port mid-stream, and one rank's socket shut down
  mid-stream: a ping-pong of numbered messages arrives exactly once, in order, on both sides;
- past transport.reconnect_s: one PeerError line naming the relay;
- a relay stand-in that flips a ciphertext byte, or replays a frame: refused with one PeerError line;
- what crosses the relay does not contain the plaintext.
"""
from __future__ import annotations

import collections
import signal
import socket
import struct
import threading
import time

import pytest
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from netbridge import secure
from netbridge.channel import PeerError
from netbridge.link import DATA, HEADER, LinkSocket
from netbridge.relay_channel import RelayChannel
from tests.support.relay_harness import PAIRING, TOKEN, pair, recv_exact, relay_process
from tests.support.tiny_models import free_port

MESSAGES = 120
TIMEOUT_S = 3.0  # heartbeats every 0.5 s: a silently dead link is noticed within 1.5 s


def ping_pong(c0: RelayChannel, c1: RelayChannel, fault_at: int, fault) -> tuple[list[int], list[int]]:
    """Rank 0 sends ping i and waits for pong i; rank 1 echoes. `fault()` runs (in its own thread) once rank 0 has sent
    ping `fault_at`. Returns the numbers each side received, in order."""
    got0, got1, errors = [], [], []

    def echo():
        try:
            for _ in range(MESSAGES):
                i = c1.recv("ping").meta["i"]
                got1.append(i)
                c1.send("pong", {"i": i}, x=torch.full((64,), float(i)))
        except Exception as e:  # noqa: BLE001 - reported by the test thread
            errors.append(f"rank 1: {e}")
    t = threading.Thread(target=echo, daemon=True)
    t.start()
    faults = []
    for i in range(MESSAGES):
        c0.send("ping", {"i": i}, x=torch.full((64,), float(i)))
        if i == fault_at:
            faults.append(threading.Thread(target=fault, daemon=True))
            faults[-1].start()
        msg = c0.recv("pong")
        assert torch.equal(msg.tensors["x"], torch.full((64,), float(msg.meta["i"])))
        got0.append(msg.meta["i"])
        time.sleep(0.005)
    t.join(30)
    for f in faults:
        f.join(30)
    assert not errors, errors
    return got0, got1


def test_relay_killed_and_restarted_mid_stream(tmp_path):
    port = free_port()
    args = ("--no-store", "--port", str(port))  # the later --port wins over relay_process's --port 0
    with relay_process(tmp_path, *args) as relay:
        c0, c1 = pair(relay, "restart", timeout_s=TIMEOUT_S, reconnect_s=30)
        restarted = {}

        def kill_and_restart():
            relay.proc.send_signal(signal.SIGKILL)
            relay.proc.wait(10)
            time.sleep(1.0)
            restarted["cm"] = relay_process(tmp_path, *args)
            restarted["relay"] = restarted["cm"].__enter__()
        try:
            t0 = time.monotonic()
            got0, got1 = ping_pong(c0, c1, MESSAGES // 3, kill_and_restart)
            elapsed = time.monotonic() - t0
        finally:
            c0.close()
            c1.close()
            if "cm" in restarted:
                restarted["cm"].__exit__(None, None, None)
    assert got0 == got1 == list(range(MESSAGES))
    assert c0.resumes >= 1 and c1.resumes >= 1
    print(f"\nrelay restart: {MESSAGES} round trips exactly once in order, {c0.resumes}+{c1.resumes} resumes, {elapsed:.1f} s")


def test_one_ranks_socket_shut_down_mid_stream(tmp_path):
    with relay_process(tmp_path, "--no-store") as relay:
        c0, c1 = pair(relay, "cut", timeout_s=TIMEOUT_S, reconnect_s=20)
        try:
            # rank 1 loses its socket; rank 0 then learns from the relay that rank 1's link dropped (PEER_LEFT)
            got0, got1 = ping_pong(c0, c1, MESSAGES // 2, lambda: c1.link.sock.shutdown(socket.SHUT_RDWR))
        finally:
            c0.close()
            c1.close()
        assert got0 == got1 == list(range(MESSAGES))
        assert c0.resumes >= 1 and c1.resumes >= 1
        assert "session cut: rank 1 left" in relay.log()


def test_past_reconnect_s_the_error_is_one_line_naming_the_relay(tmp_path):
    with relay_process(tmp_path, "--no-store") as relay:
        c0, c1 = pair(relay, "gone", timeout_s=TIMEOUT_S, reconnect_s=1.5)
        try:
            c0.send("ping", x=torch.ones(1))
            c1.recv("ping")
            relay.proc.send_signal(signal.SIGKILL)
            relay.proc.wait(10)
            t0 = time.monotonic()
            with pytest.raises(PeerError) as caught:
                c1.recv()
            elapsed = time.monotonic() - t0
        finally:
            c0.close()
            c1.close()
    text = str(caught.value)
    assert "\n" not in text and f"relay at {relay.addr}" in text and "could not resume within 1.5 s (transport.reconnect_s" in text
    assert 1.4 < elapsed < 6, elapsed


# ---- end to end: a relay stand-in that sees (and may alter) every link frame ------------------
class StandIn:
    """Two channels joined through two socketpairs and a forwarding thread per direction that parses link frames,
    records every byte that crosses, and hands each DATA body to `mutate(direction, index, body)`, which returns
    the bodies to forward instead (a list: [] drops, [b, b] replays; an item ("back", b) goes back to the sender)."""

    def __init__(self, mutate=None):
        self.mutate = mutate or (lambda direction, index, body: [body])
        self.seen = bytearray()
        self.lock = threading.Lock()
        a0, r0 = socket.socketpair()
        a1, r1 = socket.socketpair()
        self.raw = (r0, r1)
        for direction, (src, dst) in enumerate(((r0, r1), (r1, r0))):
            threading.Thread(target=self._forward, args=(direction, src, dst), daemon=True).start()
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("c1", RelayChannel(LinkSocket(a1, "stand-in", 5), 1, "e2e", 5, secret=PAIRING)))
        t.start()
        self.c0 = RelayChannel(LinkSocket(a0, "stand-in", 5), 0, "e2e", 5, secret=PAIRING)
        t.join(5)
        self.c1 = box["c1"]

    def _forward(self, direction: int, src: socket.socket, dst: socket.socket) -> None:
        index = 0
        try:
            while True:
                header = recv_exact(src, HEADER.size)
                if header is None:
                    return
                kind, n = HEADER.unpack(header)
                body = recv_exact(src, n) if n else b""
                with self.lock:
                    self.seen += header + body
                bodies = [body]
                if kind == DATA:
                    bodies = self.mutate(direction, index, body)
                    index += 1
                for b in bodies:
                    to, b = (src, b[1]) if isinstance(b, tuple) else (dst, b)
                    to.sendall(HEADER.pack(kind, len(b)) + b)
        except OSError:
            return

    def close(self) -> None:
        self.c0.close()
        self.c1.close()
        for s in self.raw:
            s.close()


def flip_byte_of(target: int):
    """Flip one ciphertext byte of rank 0's DATA frame number `target` (0 is its hello)."""
    def mutate(direction, index, body):
        if direction == 0 and index == target:
            body = bytearray(body)
            body[len(body) // 2] ^= 0x01
            return [bytes(body)]
        return [body]
    return mutate


def replay(target: int):
    def mutate(direction, index, body):
        return [body, body] if direction == 0 and index == target else [body]
    return mutate


def second_frame_refusal(tamper) -> str:
    """The line rank 1 refuses the second frame with, the relay stand-in applying `tamper` to it."""
    s = StandIn(tamper)
    try:
        s.c0.send("ping", {"i": 0}, x=torch.arange(16))
        assert s.c1.recv("ping").meta["i"] == 0
        s.c0.send("ping", {"i": 1}, x=torch.arange(16))
        with pytest.raises(PeerError) as caught:
            s.c1.recv("ping")
    finally:
        s.close()
    return str(caught.value)


def test_a_flipped_ciphertext_byte_is_refused():
    text = second_frame_refusal(flip_byte_of(2))
    assert "\n" not in text and "relay stand-in" in text and "tampered with" in text, text


def test_a_replayed_frame_is_refused():
    s = StandIn(replay(1))
    try:
        s.c0.send("ping", {"i": 0}, x=torch.arange(16))
        assert s.c1.recv("ping").meta["i"] == 0  # the original
        with pytest.raises(PeerError) as caught:
            s.c1.recv("ping")  # its copy
    finally:
        s.close()
    text = str(caught.value)
    assert "\n" not in text and "relay stand-in" in text and "replayed (seq 1 again, expected 2)" in text, text


def test_a_reordered_frame_is_refused_before_anything_is_delivered():
    """The stand-in holds rank 0's first message back and forwards it after the second: rank 1's first receive
    must fail, not deliver message 1 first."""
    held = []

    def swap(direction, index, body):
        if direction == 0 and index == 1:  # (0 is the hello)
            held.append(body)
            return []
        if direction == 0 and index == 2:
            return [body, held.pop()]
        return [body]
    s = StandIn(swap)
    try:
        s.c0.send("ping", {"i": 0}, x=torch.arange(16))
        s.c0.send("ping", {"i": 1}, x=torch.arange(16))
        with pytest.raises(PeerError) as caught:
            s.c1.recv("ping")
    finally:
        s.close()
    text = str(caught.value)
    assert "\n" not in text and "relay stand-in" in text and "out of order (seq 2, expected 1)" in text, text


def test_a_frame_reflected_to_its_sender_is_refused():
    """The stand-in forwards rank 0's message and also sends a copy back to rank 0, which must not take its own
    frame for one of rank 1's (it is sealed under the other direction's key)."""
    def reflect(direction, index, body):
        return [body, ("back", body)] if direction == 0 and index == 1 else [body]
    s = StandIn(reflect)
    try:
        s.c0.send("ping", {"i": 0}, x=torch.arange(16))
        assert s.c1.recv("ping").meta["i"] == 0
        with pytest.raises(PeerError) as caught:
            s.c0.recv()
    finally:
        s.close()
    text = str(caught.value)
    assert "\n" not in text and "refused a frame from rank 1 through the relay stand-in: tampered with" in text, text


def rewrite_header_of(target: int, field: str):
    """Rewrite one field of the clear 17-byte header (type, seq, ack) of rank 0's DATA frame number `target`, leaving
    the ciphertext and tag as they were: the header is the AEAD's associated data, so the tag must no longer match."""
    def mutate(direction, index, body):
        if direction == 0 and index == target:
            kind, seq, ack = secure.SEALED_HEADER.unpack_from(body)
            header = {"type": (secure.CLOSE, seq, ack), "ack": (kind, seq, ack + 7)}[field]
            return [secure.SEALED_HEADER.pack(*header) + body[secure.SEALED_HEADER.size:]]
        return [body]
    return mutate


@pytest.mark.parametrize("field", ["ack", "type"])
def test_a_rewritten_header_field_is_refused(field):
    """docs/relay.md: the seq / ack / type header is authenticated. A relay that raises the ack (so the peer forgets
    frames it may have to resend) or turns a message into a CLOSE must be refused as tampering, not obeyed."""
    text = second_frame_refusal(rewrite_header_of(2, field))
    assert "\n" not in text and "refused a frame from rank 0 through the relay stand-in: tampered with" in text, text


def test_the_relay_cannot_read_the_plaintext():
    s = StandIn()
    marker = torch.tensor([0x5EC12E7] * 64, dtype=torch.int32)  # 256 known bytes
    try:
        s.c0.send("confidential", {"note": "the-plaintext-header"}, x=marker)
        msg = s.c1.recv("confidential")
        assert torch.equal(msg.tensors["x"], marker) and msg.meta == {"note": "the-plaintext-header"}
        s.c1.send("answer", y=marker * 2)
        assert torch.equal(s.c0.recv("answer").tensors["y"], marker * 2)
    finally:
        s.close()
    with s.lock:
        seen = bytes(s.seen)
    for known in (marker.numpy().tobytes()[:16], (marker * 2).numpy().tobytes()[:16], b"the-plaintext-header",
                  b"confidential", b"TDM1"):
        assert known not in seen, f"{known!r} crossed the relay in the clear"
    assert len(seen) > 2 * 256  # the messages did cross, sealed


# ---- from the attacker's seat: what the relay holds does not open the traffic ---------------------
def recorded_envelopes(seen: bytes) -> list[bytes]:
    """The DATA bodies in a recording of link frames (both directions interleaved, as the stand-in saw them)."""
    out, i = [], 0
    while i + HEADER.size <= len(seen):
        kind, n = HEADER.unpack_from(seen, i)
        if kind == DATA:
            out.append(seen[i + HEADER.size:i + HEADER.size + n])
        i += HEADER.size + n
    return out


def opens(key: bytes, envelope: bytes) -> bool:
    """True when `key` opens a recorded SEALED envelope (from either rank: both nonce prefixes are tried)."""
    header = envelope[:secure.SEALED_HEADER.size]
    _, seq, _ = secure.SEALED_HEADER.unpack(header)
    for sender in (0, 1):
        try:
            AESGCM(key).decrypt(struct.pack("!IQ", sender, seq), envelope[secure.SEALED_HEADER.size:], header)
            return True
        except InvalidTag:
            pass
    return False


def keys_a_relay_can_derive(held: list[bytes], session: str, hellos: list[bytes]) -> list[bytes]:
    """Every key the relay can compute from what it holds: the secrets it has, the session id, and the recorded hellos
    (both public keys, MACs, sequence numbers). It has no ephemeral private key of a rank; the best it can do is use
    one of its own in the real derivation."""
    publics = [public for _, public in sorted((hello_fields(h).rank, hello_fields(h).public) for h in hellos)]
    candidates = []
    for secret in held:
        pairing = secure.pairing_keys(secret, session)
        # HKDF over anything derivable from the secret, salted and labelled every way the two derivations do (the one
        # before issue 21, HKDF(secret, salt = the values sent in the clear), opened every frame)
        infos = (b"tandem-e2e-v1|" + session.encode(), b"tandem-e2e-v2 keys|" + session.encode() + b"|" + b"".join(publics))
        for ikm in (secret, pairing.hello_mac, pairing.kdf_salt, b"".join(publics)):
            for salt in (None, b"".join(publics), pairing.kdf_salt):
                for info in infos:
                    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=salt, info=info).derive(ikm)
                    candidates += [okm[:32], okm[32:]]
        candidates += [pairing.hello_mac, pairing.kdf_salt]
        own_private, _ = secure.new_ephemeral()  # the real derivation, with the only private key the relay has: its own
        for rank in (0, 1):
            for peer_public in publics:
                candidates += secure.traffic_keys(pairing, session, own_private, rank, peer_public)
    return candidates


def test_a_relay_with_its_token_and_a_recording_cannot_decrypt():
    """The relay's seat: it holds its token, the session id and every byte of the handshake and the frames; no key
    it can derive opens a frame. Even the pairing secret, leaked after the session (forward secrecy), does not."""
    s = StandIn()
    marker = torch.tensor([0x5EC12E7] * 64, dtype=torch.int32)
    try:
        for i in range(3):
            s.c0.send("confidential", {"i": i}, x=marker)
            assert torch.equal(s.c1.recv("confidential").tensors["x"], marker)
            s.c1.send("answer", y=marker + i)
            s.c0.recv("answer")
    finally:
        s.close()
    with s.lock:
        envelopes = recorded_envelopes(bytes(s.seen))
    hellos = [e for e in envelopes if secure.envelope_type(e) == secure.HELLO]
    sealed = [e for e in envelopes if secure.envelope_type(e) == secure.SEALED]
    assert len(hellos) == 2 and len(sealed) >= 6
    # the recording is complete and its frames are decryptable, by the rank holding the keys
    kind, _, _, plaintext = s.c1.secure.sealer.open(bytearray(sealed[0]), 1)
    assert kind == secure.SEALED and b"confidential" in plaintext
    for held in ([TOKEN], [TOKEN, PAIRING]):
        for key in keys_a_relay_can_derive(held, "e2e", hellos):
            assert not any(opens(key, e) for e in sealed), f"a key derived from {len(held)} secret(s) opened a frame"


def hellos_of(s: StandIn) -> dict[int, bytes]:
    """{rank: the ephemeral public key in its hello}, as the relay saw them."""
    with s.lock:
        envelopes = recorded_envelopes(bytes(s.seen))
    fields = [hello_fields(e) for e in envelopes if secure.envelope_type(e) == secure.HELLO]
    return {h.rank: h.public for h in fields}


def test_every_pairing_has_fresh_ephemeral_keys():
    """Forward secrecy needs key pairs that nothing can make again: two pairings with the same pairing secret and session
    id (what an attacker holding the secret later can replay) must show four different public keys. A private key
    derived from the pairing secret (or the session, or the rank) would give the same public key twice."""
    publics = []
    for _ in range(2):
        s = StandIn()
        try:
            s.c0.send("ping", x=torch.arange(4))
            s.c1.recv("ping")
        finally:
            s.close()
        seen = hellos_of(s)
        assert sorted(seen) == [0, 1]
        publics += seen.values()
    assert len(set(publics)) == 4, "an ephemeral public key was the same in two pairings with the same secret"


def private_keys_reachable_from(root) -> list:
    """Every X25519 private key reachable from `root` through attributes, containers and bound methods."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, bytearray, int, float, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, X25519PrivateKey):
            found.append(obj)
            continue
        if isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            todo += list(obj)
        if hasattr(obj, "__self__"):  # a bound method (a thread's target, a callback)
            todo.append(obj.__self__)
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo += list(vars(obj).values())
        for slot in getattr(type(obj), "__slots__", ()):
            todo.append(getattr(obj, slot, None))
    return found


def test_no_private_key_is_kept_after_the_handshake():
    """The ephemeral private key is dropped once the traffic keys are derived: a process whose memory is read later
    (a core dump, a swap file) must not hold what re-derives the keys from recorded hellos."""
    s = StandIn()
    try:
        assert private_keys_reachable_from(s.c0), "the walk does not reach the channel's key before the handshake"
        s.c0.send("ping", x=torch.arange(4))
        s.c1.recv("ping")
        s.c1.send("pong", x=torch.arange(4))
        s.c0.recv("pong")
        for channel in (s.c0, s.c1):
            assert channel.secure.established
            assert not private_keys_reachable_from(channel), f"rank {channel.rank} still holds its private key"
    finally:
        s.close()


def hello_fields(body: bytes) -> secure.Hello:
    """A recorded hello read as the relay can: its fields are in the clear (only the MAC needs the pairing secret)."""
    return secure.Hello(*struct.unpack("!BB32s32sQ", body[:secure.HELLO_BYTES - 32])[1:])


def forged_hello(original: bytes, secret: bytes, public: bytes) -> bytes:
    """Rank 1's hello with the attacker's public key in it, MACed with `secret` as if it were the pairing secret."""
    return secure.pack_hello(secure.pairing_keys(secret, "e2e"), hello_fields(original)._replace(public=public))


@pytest.mark.parametrize("held", ["token", "pairing secret"])
def test_a_relay_putting_its_own_key_in_the_middle_needs_the_pairing_secret(held):
    """Active attack: the relay swaps rank 1's ephemeral key for its own in the hello rank 0 receives. With only its
    token it cannot MAC that hello, and rank 0 refuses it in one line; with the pairing secret (the control that
    shows the attack is real) rank 0 accepts it and the relay reads rank 0's next frame."""
    secret = TOKEN if held == "token" else PAIRING
    private, public = secure.new_ephemeral()
    seen = {}

    def middle(direction, index, body):
        if index == 0:  # each rank's hello
            seen[direction] = body
            if direction == 1:
                return [forged_hello(body, secret, public)]
        elif direction == 0 and index == 1:
            seen["frame"] = body
        return [body]
    s = StandIn(middle)
    marker = torch.tensor([0x5EC12E7] * 64, dtype=torch.int32)
    try:
        if held == "token":
            with pytest.raises(PeerError) as caught:
                s.c0.send("confidential", x=marker)
            text = str(caught.value)
            assert "\n" not in text and "rank 1's hello through the relay stand-in is not signed with this node's pairing " \
                   "secret" in text, text
            assert "frame" not in seen
            return
        s.c0.send("confidential", x=marker)
        deadline = time.monotonic() + 10  # send returns once the bytes are in the socket, before the stand-in has read them
        while "frame" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        s.close()
    assert "frame" in seen, "the stand-in relay never saw rank 0's frame"
    rank0_public = hello_fields(seen[0]).public
    keys = secure.traffic_keys(secure.pairing_keys(secret, "e2e"), "e2e", private, 1, rank0_public)
    _, _, _, plaintext = secure.Sealer(keys, 1).open(bytearray(seen["frame"]), 1)
    assert marker.numpy().tobytes() in plaintext


def test_a_wrong_pairing_secret_on_one_node_is_one_clear_line(tmp_path):
    """Both nodes get past the relay (right token); the one with the wrong pairing secret and its peer each fail
    with one line naming the pairing secret, not a tampering or a hang."""
    with relay_process(tmp_path, "--no-store") as relay:
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("c1", RelayChannel.connect(
            relay.addr, "mispaired", 1, TOKEN, b"another-pairing-secret", timeout_s=5)))
        t.start()
        c0 = RelayChannel.connect(relay.addr, "mispaired", 0, TOKEN, PAIRING, timeout_s=5)
        t.join(10)
        c1 = box["c1"]
        errors = []
        t1 = threading.Thread(target=lambda: errors.append(_error_of(c1.recv)))
        t1.start()
        errors.append(_error_of(lambda: c0.send("ping", x=torch.ones(1))))
        t1.join(10)
        c0.close()
        c1.close()
    assert len(errors) == 2
    for text in errors:
        assert text and "\n" not in text and "is not signed with this node's pairing secret: transport.secret_file" in text, text


def _error_of(fn) -> str | None:
    try:
        fn()
    except PeerError as e:
        return str(e)
    return None
