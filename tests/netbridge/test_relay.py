"""The relay and RelayChannel on loopback: data both ways, authentication, refusals, liveness, emulation.

The relay harness (a relay subprocess, raw authenticated clients) is tests/support/relay_harness.py,
shared with the other netbridge tests.
"""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from netbridge import auth
from netbridge.channel import PeerError
from netbridge.link import (DATA, HEADER, HEARTBEAT, MAX_FRAME_BYTES, PAIRED, PEER_LEFT, LinkClosed, LinkGarbage, LinkSocket,
                            LinkTimeout, UnexpectedFrame)
from netbridge.relay_channel import RelayChannel
from tests.support.relay_harness import (PAIRING, REPO, TOKEN, RelayProcess, closed_by_peer, dial_raw, loops, pair, read_link,
                                         recv_exact, relay_process, run_in_thread)


# ---- tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=loops())
def relay(tmp_path_factory, request):
    # --max-refusal-delay-s 0: the wrong-token dials here test what is told, not the slowing (test_relay_refusals.py)
    with relay_process(tmp_path_factory.mktemp("relay"), "--no-store", "--handshake-timeout-s", "1", "--max-refusal-delay-s", "0",
                       "--loop", request.param) as r:
        yield r


@contextmanager
def link_pair(send_timeout_s: float = 5.0):
    """A LinkSocket and the raw socket at its other end (playing the relay), without a relay."""
    ours, theirs = socket.socketpair()
    link = LinkSocket(ours, "fake-relay", send_timeout_s)
    try:
        yield link, theirs
    finally:
        link.close()
        theirs.close()


def test_wait_for_skips_heartbeats_and_sends_its_own():
    with link_pair() as (link, relay_end):
        relay_end.sendall(HEADER.pack(HEARTBEAT, 0) * 3)
        threading.Timer(0.3, lambda: relay_end.sendall(HEADER.pack(PAIRED, 0))).start()
        assert link.wait_for(PAIRED, time.monotonic() + 5, heartbeat_s=0.05) == b""
        relay_end.settimeout(1)
        sent = relay_end.recv(4096)
    assert len(sent) >= 2 * HEADER.size and sent == HEADER.pack(HEARTBEAT, 0) * (len(sent) // HEADER.size)


def test_wait_for_raises_on_another_kind_at_the_deadline_and_on_close():
    with link_pair() as (link, relay_end):
        relay_end.sendall(HEADER.pack(HEARTBEAT, 0) + HEADER.pack(PEER_LEFT, 0))
        with pytest.raises(UnexpectedFrame) as caught:
            link.wait_for(PAIRED, time.monotonic() + 5, heartbeat_s=1)
        assert caught.value.kind == PEER_LEFT
        t0 = time.monotonic()
        with pytest.raises(LinkTimeout):
            link.wait_for(PAIRED, t0 + 0.2, heartbeat_s=1)
        assert time.monotonic() - t0 < 1
        relay_end.shutdown(socket.SHUT_WR)
        with pytest.raises(LinkClosed, match="closed by the other end"):
            link.wait_for(PAIRED, time.monotonic() + 5, heartbeat_s=1)


def test_a_header_beyond_the_frame_bound_is_garbage_before_any_body_is_read():
    from netbridge import frames
    assert frames.MAX_FRAME_BYTES is MAX_FRAME_BYTES  # the message bound is the link's, one definition
    with link_pair() as (link, relay_end):
        relay_end.sendall(HEADER.pack(DATA, MAX_FRAME_BYTES + 1))  # no body follows: reading one would hang
        with pytest.raises(LinkGarbage, match=r"garbage from the relay at fake-relay \(frame type 1, 268435457 bytes\)"):
            link.recv(time.monotonic() + 5)


def test_relay_channel_reports_garbage_from_the_relay_as_a_peer_error():
    with link_pair() as (link, relay_end):
        channel = RelayChannel(link, 0, "garbage", timeout_s=5)
        try:
            relay_end.sendall(HEADER.pack(99, 0))
            with pytest.raises(PeerError, match=r"garbage from the relay at fake-relay \(frame type 99, 0 bytes\); is that address"):
                channel.recv_frame()
        finally:
            channel.close()


def test_relay_imports_without_torch_or_model_code():
    code = ("import sys, netbridge.relay; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'model_parallel', 'speculative', 'launch')]; print(bad); assert not bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_tensors_go_both_ways_exactly(relay):
    c0, c1 = pair(relay, "exact")
    try:
        big = torch.randn(2_621_440)  # 10 MB of fp32
        sent = {"f": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "i": torch.arange(11), "m": torch.rand(4) > 0.5, "big": big}
        t, box = run_in_thread(c1.recv, "x")  # a frame bigger than the buffers on the way needs a reader
        c0.send("x", {"round": 3}, **sent)
        t.join(30)
        msg = box["value"]
        assert msg.meta == {"round": 3} and set(msg.tensors) == set(sent)
        for k, t in sent.items():
            assert msg.tensors[k].dtype == t.dtype and torch.equal(msg.tensors[k], t)
        c1.send("y", h=msg.tensors["f"] * 2)
        assert torch.equal(c0.recv("y").tensors["h"], sent["f"] * 2)
    finally:
        c0.close()
        c1.close()


def test_wrong_secret_is_refused_and_learns_nothing(relay):
    with pytest.raises(PeerError, match=rf"relay at {relay.addr} refused .*token does not match"):
        RelayChannel.connect(relay.addr, "wrong-secret", 0, b"not-the-token", PAIRING, timeout_s=3)
    # the same answer for a session that is in use: a stranger cannot probe which sessions exist
    c0, c1 = pair(relay, "busy")
    try:
        with pytest.raises(PeerError, match="token does not match"):
            RelayChannel.connect(relay.addr, "busy", 0, b"not-the-token", PAIRING, timeout_s=3)
        c0.send("still", x=torch.ones(2))
        assert c1.recv("still").tensors["x"].tolist() == [1.0, 1.0]
    finally:
        c0.close()
        c1.close()
    assert "wrong MAC" in relay.log()


def test_a_new_claimant_of_a_taken_rank_replaces_it_and_is_not_resumed_with(relay):
    """A rank that re-dials must get its slot back even while the relay still holds its old connection, so a newly
    authenticated claimant replaces the old one. A different process (another job with the same session id) gets
    the slot, but the session's other rank refuses to resume with it: its hello carries another nonce."""
    c0, c1 = pair(relay, "taken")
    try:
        c0.send("before", x=torch.tensor([5]))
        assert c1.recv("before").tensors["x"].item() == 5
        t, box = run_in_thread(RelayChannel.connect, relay.addr, "taken", 0, TOKEN, PAIRING, 3.0)
        with pytest.raises(PeerError, match=r"rank 0 of session 'taken' at the relay .* is not the process this session "
                                            r"started with \(it restarted, or another job uses the same transport.session\)"):
            c1.recv()
        t.join(5)
        if "value" in box:
            box["value"].close()
    finally:
        c0.close()
        c1.close()
    assert "session taken: rank 0 re-joined" in relay.log()


def test_peer_leaving_is_reported_with_the_relay_address(relay):
    c0, c1 = pair(relay, "leave")
    c0.send("last", x=torch.tensor([1]))
    c0.close()
    assert c1.recv("last").tensors["x"].item() == 1  # what was sent before leaving still arrives
    with pytest.raises(PeerError, match=rf"rank 0 left session 'leave' at the relay {relay.addr}"):
        c1.recv()
    c1.close()
    c0, c1 = pair(relay, "leave")  # the session id is free again
    c0.close()
    c1.close()


def test_alive_but_silent_peer_times_out_with_its_own_message(relay):
    c0, c1 = pair(relay, "silent", timeout_s=1.2)  # heartbeats every 0.2 s
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerError, match=r"rank 1 is connected \(its heartbeats arrive.*no message for 1.2 s \(transport.timeout_s\)"):
            c0.recv()
        assert 1.1 < time.monotonic() - t0 < 3.0
    finally:
        c0.close()
        c1.close()


def test_dead_peer_is_told_apart_from_a_silent_one(relay):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("raw", dial_raw(relay, "dead", 1)))
    t.start()
    c0 = RelayChannel.connect(relay.addr, "dead", 0, TOKEN, PAIRING, timeout_s=10, heartbeat_s=0.2)
    t.join(5)
    raw = box["raw"]  # paired, then never a byte again: a frozen host
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerError, match=r"nothing from rank 1 through the relay .* not even heartbeats"):
            c0.recv()
        assert time.monotonic() - t0 < 3.0  # 3 heartbeats, far below transport.timeout_s
    finally:
        c0.close()
        raw.close()


def test_no_relay_and_no_peer_errors_say_what_to_check(relay, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_addr = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(PeerError, match=rf"cannot reach the relay at {dead_addr} .*is `tandem-relay` running there"):
        RelayChannel.connect(dead_addr, "nobody", 0, TOKEN, PAIRING, timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match=rf"rank 1 did not join session 'lonely' at the relay {relay.addr} within 1 s"):
        RelayChannel.connect(relay.addr, "lonely", 0, TOKEN, PAIRING, timeout_s=5, join_timeout_s=1)
    assert time.monotonic() - t0 < 3


def test_transport_settings_open_a_relay_link_with_the_token_and_pairing_files(relay, tmp_path):
    """launch.transport reads the two secret files once; the link opened from those settings carries data, and the
    relay's token given as the pairing secret is refused before dialing (the relay could then decrypt)."""
    from launch.config import TransportConfig
    from launch.transport import relay_link, transport_settings
    token_file, secret_file = tmp_path / "token", tmp_path / "secret"
    token_file.write_bytes(TOKEN + b"\n")
    secret_file.write_bytes(PAIRING + b"\n")
    t = TransportConfig(kind="relay", relay=relay.addr, session="cfg", relay_token_file=str(token_file),
                        secret_file=str(secret_file), timeout_s=10)
    settings = transport_settings(t)
    t1, box = run_in_thread(relay_link, settings, 1)
    c0 = relay_link(settings, 0)
    t1.join(10)
    c1 = box["value"]
    c0.send("hi", x=torch.tensor([9]))
    assert c1.recv("hi").tensors["x"].item() == 9
    c0.close()
    c1.close()
    same = transport_settings(TransportConfig(**{**vars(t), "secret_file": str(token_file)}))
    with pytest.raises(PeerError, match=r"the pairing secret \(transport.secret_file\) is the relay's token"):
        relay_link(same, 0)


def test_oversized_and_unknown_frames_close_only_that_session(relay):
    healthy0, healthy1 = pair(relay, "healthy")
    try:
        for bad in (HEADER.pack(DATA, MAX_FRAME_BYTES + 1), HEADER.pack(DATA, 0), HEADER.pack(77, 3) + b"abc", HEADER.pack(HEARTBEAT, 4) + b"xxxx"):
            box: dict = {}
            t = threading.Thread(target=lambda: box.setdefault("victim", RelayChannel.connect(relay.addr, "bad", 1, TOKEN, PAIRING, timeout_s=5)))
            t.start()
            raw = dial_raw(relay, "bad", 0)
            assert read_link(raw) == (PAIRED, b"")
            t.join(5)
            raw.sendall(bad)
            assert closed_by_peer(raw), f"relay kept a connection that sent {bad[:8]!r}"
            with pytest.raises(PeerError, match=r"rank 0 left session 'bad'"):
                box["victim"].recv()
            box["victim"].close()
            raw.close()
        healthy0.send("ok", x=torch.arange(3))
        assert healthy1.recv("ok").tensors["x"].tolist() == [0, 1, 2]
    finally:
        healthy0.close()
        healthy1.close()
    log = relay.log()
    assert "outside the bound" in log and "unknown frame type 77" in log and "heartbeat with a 4-byte body" in log


def test_data_before_pairing_and_vanishing_mid_frame(relay):
    raw = dial_raw(relay, "early", 0)
    raw.sendall(HEADER.pack(DATA, 4) + b"abcd")
    assert closed_by_peer(raw)
    raw.close()
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("victim", RelayChannel.connect(relay.addr, "midframe", 1, TOKEN, PAIRING, timeout_s=5)))
    t.start()
    raw = dial_raw(relay, "midframe", 0)
    assert read_link(raw) == (PAIRED, b"")
    t.join(5)
    raw.sendall(HEADER.pack(DATA, 1000) + b"x" * 10)
    time.sleep(0.1)
    raw.close()
    with pytest.raises(PeerError, match=r"closed the connection in the middle of a frame"):
        box["victim"].recv()
    box["victim"].close()


def test_slowloris_handshake_is_cut_off(relay):
    s = socket.create_connection(("127.0.0.1", relay.port))
    assert recv_exact(s, auth.HELLO_BYTES)[:4] == auth.HELLO_MAGIC
    s.sendall(b"TND")  # then nothing
    t0 = time.monotonic()
    assert closed_by_peer(s, timeout_s=5)
    assert time.monotonic() - t0 < 3  # --handshake-timeout-s 1, swept every 0.25 s
    s.close()
    assert "no complete handshake within 1 s" in relay.log()


def test_client_checks_that_the_relay_knows_the_secret():
    """A server that greets like a relay and says OK, but cannot produce the relay's MAC, is rejected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def fake():
        c, _ = srv.accept()
        hello, _ = auth.hello()
        c.sendall(hello)
        c.recv(4096)
        c.sendall(bytes([auth.OK]) + b"\0" * auth.MAC_BYTES)
        time.sleep(0.5)
        c.close()
    threading.Thread(target=fake, daemon=True).start()
    with pytest.raises(auth.HandshakeError, match="does not know our relay token"):
        auth.dial(f"127.0.0.1:{srv.getsockname()[1]}", TOKEN, "s", auth.ROLE_DATA, 0, 2, 3)
    srv.close()


def round_trip_and_transfer_s(relay: RelayProcess, session: str, payload: torch.Tensor) -> tuple[float, float]:
    """(the fastest of 7 small-message round trips, the faster of 2 one-way transfers of `payload`) through `relay`."""
    c0, c1 = pair(relay, session)
    try:
        rtts = []
        for i in range(7):
            t0 = time.perf_counter()
            c0.send("p", x=torch.tensor([i]))
            c1.send("q", x=c1.recv("p").tensors["x"])
            assert c0.recv("q").tensors["x"].item() == i
            rtts.append(time.perf_counter() - t0)
        transfers = []
        for _ in range(2):
            t, box = run_in_thread(c1.recv, "big")
            t0 = time.perf_counter()
            c0.send("big", x=payload)
            t.join(10)
            transfers.append(time.perf_counter() - t0)
            assert box["value"].tensors["x"].numel() == payload.numel()
            c1.send("done")  # the next transfer starts on an idle wire
            c0.recv("done")
    finally:
        c0.close()
        c1.close()
    return min(rtts), min(transfers)


@pytest.mark.parametrize("loop", loops())
def test_emulated_delay_and_bandwidth(tmp_path, loop):
    """What the relay's emulation adds, over the same exchanges through a relay without it, is its link model within
    15 %: 2 x 25 ms per round trip, and 2 MB at 80 Mbit/s (0.2 s) + 25 ms for a one-way transfer."""
    payload = torch.zeros(500_000)  # 2 MB
    with relay_process(tmp_path, "--no-store", "--loop", loop) as plain:
        base_rtt, base_transfer = round_trip_and_transfer_s(plain, "fast", payload)
    with relay_process(tmp_path, "--no-store", "--emulate-delay-ms", "25", "--emulate-mbps", "80", "--loop", loop) as r:
        rtt, transfer = round_trip_and_transfer_s(r, "slow", payload)
    added_rtt, added_transfer = rtt - base_rtt, transfer - base_transfer
    wire_s = (payload.numel() * 4) / (80e6 / 8)
    print(f"\nemulation added {added_rtt * 1000:.1f} ms per round trip (model 50), {added_transfer * 1000:.0f} ms per "
          f"2 MB transfer (model {(wire_s + 0.025) * 1000:.0f})")
    assert abs(added_rtt - 0.050) <= 0.15 * 0.050, (rtt, base_rtt)
    assert abs(added_transfer - (wire_s + 0.025)) <= 0.15 * (wire_s + 0.025), (transfer, base_transfer)


def test_a_big_frame_on_a_slow_link_is_progress_not_a_timeout(tmp_path):
    """6 MB at an emulated 16 Mbit/s takes ~3 s, twice transport.timeout_s: neither side may time out."""
    with relay_process(tmp_path, "--no-store", "--emulate-mbps", "16") as r:
        c0, c1 = pair(r, "slow-big", timeout_s=1.5)
        try:
            payload = torch.arange(1_500_000, dtype=torch.int32)
            t, box = run_in_thread(c1.recv, "big")
            t0 = time.perf_counter()
            c0.send("big", x=payload)
            t.join(20)
            assert "error" not in box, box.get("error")
            assert torch.equal(box["value"].tensors["x"], payload)
            assert time.perf_counter() - t0 > 2.5
        finally:
            c0.close()
            c1.close()


# ---- notices: a refused claim is told to whoever waits in that session -------------------------
def wrong_secret_claim(relay: RelayProcess, session: str) -> None:
    with pytest.raises(auth.HandshakeError, match="token does not match"):
        auth.dial(relay.addr, b"not-the-secret", session, auth.ROLE_DATA, 0, 2, 3)


def frames_until_quiet(sock: socket.socket, quiet_s: float) -> list:
    """The link frames that arrive until none has for `quiet_s`."""
    frames = []
    try:
        while (frame := read_link(sock, timeout_s=quiet_s)) is not None:
            frames.append(frame)
    except socket.timeout:
        pass
    return frames


@pytest.mark.slow  # waits out a claim's grace (~4 s), twice (asyncio, uvloop): the default suite read 4:47
def test_a_rank_waiting_for_its_peer_hears_of_a_wrong_secret_claim(relay, caplog):
    """RelayChannel.connect waiting for PAIRED: a wrong-secret claim for its session is warned about within
    seconds, once, the wait goes on, and the timeout names the refusal instead of a bare 'did not join'."""
    waiter, box = run_in_thread(lambda: RelayChannel.connect(relay.addr, "told", 1, TOKEN, PAIRING, timeout_s=10, join_timeout_s=4))
    time.sleep(0.5)  # rank 1 is waiting at the relay
    t0 = time.monotonic()
    wrong_secret_claim(relay, "told")
    warned = []
    while not warned and time.monotonic() - t0 < 3:
        warned = [r.getMessage() for r in caplog.records if "claiming session 'told' was refused" in r.getMessage()]
        time.sleep(0.05)
    assert warned, "no warning within 3 s of the refused claim"
    assert time.monotonic() - t0 < 2
    assert "a connection from 127.0.0.1 claiming session 'told' was refused at the relay for a wrong token" in warned[0]
    assert "TANDEM_RELAY_TOKEN_FILE" in warned[0]
    time.sleep(1.1)  # past the relay's notice interval: the same notice again is not printed again
    wrong_secret_claim(relay, "told")
    waiter.join(10)
    assert not waiter.is_alive() and "value" not in box
    assert len([r for r in caplog.records if "claiming session 'told'" in r.getMessage()]) == 1
    message = str(box["error"])
    assert re.search(r"rank 0 did not join session 'told' at the relay .* within 4 s; a connection from 127\.0\.0\.1 "
                     r"claiming session 'told' was refused at the relay for a wrong token: check TANDEM_RELAY_TOKEN_FILE", message), message


def test_notices_are_rate_limited_bounded_and_only_for_waiting_members(relay):
    from netbridge.link import MAX_NOTICE_BYTES, NOTICE
    waiting = dial_raw(relay, "flooded", 0)
    c0, c1 = pair(relay, "running")
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        for session in ["flooded"] * 12 + ["running"] * 3:  # a stranger hammering both sessions
            wrong_secret_claim(relay, session)
        flood_s = time.monotonic() - t0
        frames = frames_until_quiet(waiting, quiet_s=0.7)
        notices = [body for kind, body in frames if kind == NOTICE]
        assert 1 <= len(notices) <= 1 + int(flood_s), (flood_s, frames)  # one notice per second at most
        assert all(0 < len(body) <= MAX_NOTICE_BYTES for body in notices)
        c0.send("still", x=torch.ones(1))  # a paired session's stream carries no notice
        assert c1.recv("still").tensors["x"].tolist() == [1.0]
    finally:
        waiting.close()
        c0.close()
        c1.close()


def test_notice_text_is_cut_at_a_word_and_made_printable():
    from netbridge.link import MAX_NOTICE_BYTES, NOTICE, clip_words, notice_frame, notice_text
    long = "wörd " * 200
    clipped = clip_words(long, MAX_NOTICE_BYTES)
    assert len(clipped.encode()) <= MAX_NOTICE_BYTES and clipped.endswith("wörd ...")
    assert notice_text("bell\x07 and\nnewline \x1b[31m".encode()) == "bell  and newline  [31m"
    kind, n = HEADER.unpack(notice_frame(long)[:HEADER.size])
    assert kind == NOTICE and n <= MAX_NOTICE_BYTES
    with link_pair() as (link, relay_end):
        relay_end.sendall(HEADER.pack(NOTICE, MAX_NOTICE_BYTES + 1))  # a notice beyond its bound: garbage, no body read
        with pytest.raises(LinkGarbage):
            link.recv(time.monotonic() + 5)


def test_an_authenticated_refusal_is_told_too(tmp_path):
    """Not only a wrong secret: the other rank refused for another reason (here: the relay is full) is news
    to the rank waiting for it."""
    from netbridge.link import NOTICE
    with relay_process(tmp_path, "--no-store", "--max-connections", "1") as r:
        waiting = dial_raw(r, "crowded", 0)
        with pytest.raises(auth.HandshakeError, match="is full"):
            dial_raw(r, "crowded", 1)
        kind, body = read_link(waiting)
        waiting.close()
    assert kind == NOTICE
    assert body.decode().startswith("a node from 127.0.0.1 was refused at the relay for session 'crowded': the relay is full")
