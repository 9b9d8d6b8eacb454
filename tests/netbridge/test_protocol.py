"""netbridge.protocol over netbridge.channel's in-process pair (local_pair): every message kind makes
the round trip through real frames (tensors, None fields, defaults); what the receiver did not expect
(an Error from the peer, another kind, a missing or extra field) is one PeerError line, never a
traceback; the LocalChannel's timeout and close. The relay transport has its own tests (test_relay*)."""
from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from netbridge import protocol
from netbridge.channel import PeerError, local_pair
from netbridge.protocol import (MESSAGES, Bye, Error, Hello, Hellos, Idle, Lookup, Prefill, Reply, Request, Restore, Round,
                                SamplingParams)


def same(a, b) -> bool:
    """Field-by-field equality; tensors by dtype, shape and value."""
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


def round_trip(msg, *expect):
    a, b = local_pair(timeout_s=5)
    protocol.send(a, msg)
    return protocol.recv(b, *(expect or (type(msg),)))


MESSAGES_OF_EVERY_KIND = [
    Hellos([Hello(cuts=[14], num_layers=28, dtype="bfloat16", quant="nf4")]),
    Hellos([Hello(cuts=[1], num_layers=2, dtype="float32", quant="none", version=99),
            Hello(cuts=None, num_layers=2, dtype="float32", quant="none", budget=10**9, layer_ms=1.5)]),
    Request(),
    Request(SamplingParams(temperature=0.7, top_p=0.9, seed=12345, grammar="start: \"x\"", logprobs=2), slot=3),
    Lookup(["a" * 64, "b" * 64], ["c" * 64], 2, 256),  # cache.dir: a long prompt's saved blocks
    Restore(["a" * 64], ["c" * 64, "d" * 64], 256, 5, 256),
    Prefill(0, torch.randn(1, 64, 16)),  # a long prompt's leading chunk
    Round(0, torch.randn(1, 9, 16), torch.zeros(0, dtype=torch.long)),  # the prefill: no drafts, no q
    Round(17, torch.randn(1, 5, 16, dtype=torch.bfloat16), torch.tensor([3, 1, 4, 1])),  # greedy: q fields None
    Round(23, torch.randn(1, 4, 8), torch.tensor([5, 9, 2]), torch.randint(0, 300, (3, 32)),
          torch.softmax(torch.randn(3, 32), -1)),
    Reply(accepted=3, token=255, last_ms=1.25, marks=[1.5, 2.25, 3.0, 4.125]),
    Reply(accepted=0, token=0, last_ms=0.0),
    Idle(),
    Bye(),
]


@pytest.mark.parametrize("msg", MESSAGES_OF_EVERY_KIND, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_round_trip(msg):
    got = round_trip(msg)
    assert same(got, msg), (got, msg)


def test_every_kind_is_covered_above():
    assert {type(m) for m in MESSAGES_OF_EVERY_KIND} | {Error} == set(MESSAGES.values())


def test_none_fields_stay_none_and_tensors_stay_tensors():
    got = round_trip(Round(4, torch.ones(1, 2, 3), torch.tensor([7, 8])))
    assert got.q_ids is None and got.q_probs is None
    assert isinstance(got.hidden, torch.Tensor) and got.drafts.tolist() == [7, 8] and got.drafts.dtype == torch.long
    assert type(got.start) is int


def test_an_expected_error_is_a_message():
    assert same(round_trip(Error("out of memory"), Reply, Error), Error("out of memory"))


def test_one_recv_accepts_any_of_the_expected_kinds():
    a, b = local_pair(timeout_s=5)
    for msg in (Request(SamplingParams(seed=3)), Idle(), Prefill(0, torch.zeros(1, 3, 2)), Round(3, torch.zeros(1, 1, 2), torch.tensor([1])),
                Bye()):
        protocol.send(a, msg)
    kinds = [type(protocol.recv(b, Request, Prefill, Round, Idle, Bye)) for _ in range(5)]
    assert kinds == [Request, Idle, Prefill, Round, Bye]


def test_a_bundle_is_one_frame_whose_messages_come_one_by_one():
    """A batch's Rounds (and their Replies) cross as one frame: each frame costs both ends a fixed amount."""
    a, b = local_pair(timeout_s=5)
    sent = [Round(3, torch.randn(1, 2, 4), torch.tensor([5]), slot=1, batch=2),
            Round(9, torch.randn(1, 3, 4, dtype=torch.bfloat16), torch.tensor([6, 7]), slot=2, batch=2),
            Reply(accepted=1, token=8, last_ms=0.5, marks=[1.0])]
    protocol.send_all(a, sent)
    protocol.send(a, Bye())
    assert b.inbox.qsize() == 2  # the bundle, then the Bye
    assert all(same(protocol.recv(b, type(msg)), msg) for msg in sent)
    assert b.inbox.qsize() == 1 and isinstance(protocol.recv(b, Bye), Bye)
    protocol.send_all(a, sent[:2])
    with pytest.raises(PeerError) as info:  # each message of a bundle is checked as it is read
        protocol.recv(b, Reply)
    assert_one_line_peer_error(info, "expected reply", "'round'")


def test_a_message_too_big_to_share_a_frame_goes_alone():
    """A first round carrying a prompt's last chunk (over BUNDLE_BYTES) is a frame of its own, as it was before
    bundles: no frame outlasts a single message's transfer; the small ones around it still share frames."""
    from netbridge.channel import BUNDLE_BYTES
    a, b = local_pair(timeout_s=5)
    big = Round(0, torch.zeros(1, BUNDLE_BYTES // 4 + 1, 1), torch.zeros(0, dtype=torch.long), slot=1, batch=4)
    sent = [Round(5, torch.zeros(1, 2, 4), torch.tensor([1]), slot=0, batch=4), big,
            *(Round(7, torch.zeros(1, 2, 4), torch.tensor([1]), slot=s, batch=4) for s in (2, 3))]
    protocol.send_all(a, sent)
    assert b.inbox.qsize() == 3  # the small one, the big one, the two small ones after it
    assert all(same(protocol.recv(b, Round), msg) for msg in sent)


@pytest.mark.parametrize("parts,tensors", [
    ("garbage", {}),
    ([], {}),
    ([["round", {"start": 1}, ["hidden"]]], {}),  # a tensor the frame does not carry
    ([["idle", {}, []]], {"0/hidden": torch.zeros(1)}),  # a tensor no part names
    ([["bundle", {"parts": []}, []]], {}),  # a bundle in a bundle
    ([["round", "start", []]], {}),
    ([["round", {}]], {}),
], ids=["not-a-list", "empty", "missing-tensor", "stray-tensor", "nested", "meta-not-a-dict", "short-part"])
def test_a_malformed_bundle_is_one_peer_error_line(parts, tensors):
    a, b = local_pair(timeout_s=5)
    a.send("bundle", {"parts": parts}, **tensors)
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Round, protocol.Idle)
    assert_one_line_peer_error(info, "malformed bundle", "same Tandem version")


def assert_one_line_peer_error(info, *needles):
    error = info.value
    assert isinstance(error, PeerError)  # (PeerSilent too: a silent peer)
    assert "\n" not in str(error)
    assert error.__cause__ is None and (error.__suppress_context__ or error.__context__ is None)  # no chained traceback
    for needle in needles:
        assert needle in str(error), (needle, str(error))


def test_an_error_from_the_peer_becomes_a_peer_error_naming_it():
    a, b = local_pair(timeout_s=5)
    protocol.send(a, Error("rank 1: CUDA out of memory in layer 7"))
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Reply)
    assert_one_line_peer_error(info, "the other rank failed", "rank 1: CUDA out of memory in layer 7")


def test_an_unexpected_kind_is_a_peer_error():
    a, b = local_pair(timeout_s=5)
    protocol.send(a, Bye())
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Reply)
    assert_one_line_peer_error(info, "protocol error", "expected reply", "'bye'", "same Tandem version")
    a.send("gossip", {"x": 1})  # a kind no version of the protocol has
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Request, Round)
    assert_one_line_peer_error(info, "expected request or round", "'gossip'")


def test_a_missing_field_is_a_peer_error():
    a, b = local_pair(timeout_s=5)
    a.send("hellos", {"hellos": [{"cuts": [2], "num_layers": 4, "dtype": "float32"}]})  # a Hello without quant
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Hellos)
    assert_one_line_peer_error(info, "protocol error", "'hellos'", "['hellos']", "same Tandem version")
    a.send("round", {"start": 3}, drafts=torch.tensor([1, 2]))  # no hidden tensor
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Round)
    assert_one_line_peer_error(info, "'round'", "['drafts', 'start']")


def test_an_unknown_field_is_a_peer_error():
    a, b = local_pair(timeout_s=5)
    a.send("reply", {"accepted": 1, "token": 2, "last_ms": 0.5, "marks": [], "tokens_per_joule": 3})
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Reply)
    assert_one_line_peer_error(info, "'reply'", "tokens_per_joule")


def test_messages_cross_between_threads_in_order():
    a, b = local_pair(timeout_s=5)
    got = []

    def rank1():
        while True:
            msg = protocol.recv(b, Round, Bye)
            if isinstance(msg, Bye):
                return
            protocol.send(b, Reply(accepted=msg.drafts.numel(), token=msg.start, last_ms=0.0))
    thread = threading.Thread(target=rank1, daemon=True)
    thread.start()
    for start in range(20):
        protocol.send(a, Round(start, torch.zeros(1, 1, 4), torch.arange(start % 5)))
        got.append(protocol.recv(a, Reply))
    protocol.send(a, Bye())
    thread.join(5)
    assert not thread.is_alive()
    assert [(r.accepted, r.token) for r in got] == [(s % 5, s) for s in range(20)]


def test_a_silent_peer_times_out_with_the_setting_named():
    a, _b = local_pair(timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(PeerError) as info:
        protocol.recv(a, Reply)
    assert 0.15 < time.monotonic() - t0 < 3
    assert_one_line_peer_error(info, "sent nothing for 0.2 s", "transport.timeout_s")


def test_a_closed_peer_fails_the_next_receive_at_once():
    a, b = local_pair(timeout_s=30)
    protocol.send(a, Idle())
    a.close()
    assert isinstance(protocol.recv(b, Idle), Idle)  # what was sent before the close still arrives
    t0 = time.monotonic()
    with pytest.raises(PeerError) as info:
        protocol.recv(b, Reply)
    assert time.monotonic() - t0 < 1
    assert_one_line_peer_error(info, "lost the other rank")


# ---- GlooChannel: gloo's error text as one readable line ---------------------------------------
GLOO_ERRORS = {  # as torch 2.x's gloo raises them (RuntimeError text), and the cause each line keeps
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:46209":
        "Connection closed by peer [127.0.0.1]:46209",
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:21938: Connection reset "
    "by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs of the remote "
    "worker before reporting an error. GLHF! \U0001f3d6\ufe0f":
        "Read error [127.0.0.1]:21938: Connection reset by peer",
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv "
    "operation to complete":
        "Timed out waiting 3000ms for recv operation to complete",
}


@pytest.mark.parametrize("raw", list(GLOO_ERRORS))
def test_gloo_errors_become_their_cause_without_the_source_location(raw):
    from netbridge.channel import gloo_cause
    assert gloo_cause(raw) == GLOO_ERRORS[raw]
    assert gloo_cause(raw + "\nException raised from ... (most recent call first):\nframe #0: ...") == GLOO_ERRORS[raw]


def test_a_long_gloo_cause_is_cut_at_a_word_boundary():
    from netbridge.channel import gloo_cause
    raw = "[/x/gloo/transport/tcp/pair.cc:1] " + " ".join(f"word{i}" for i in range(60))
    cause = gloo_cause(raw, max_chars=80)
    assert len(cause) <= 80 and cause.endswith("...")
    words = cause[:-3].split(" ")
    assert words == [f"word{i}" for i in range(len(words))]  # whole words only
    assert gloo_cause("") == ""


def test_a_lost_gloo_peer_is_one_readable_line():
    from netbridge.channel import GlooChannel

    def fails(text):
        def start_op():
            raise RuntimeError(text)
        return start_op
    channel = GlooChannel(peer=1, timeout_s=7)
    lost, timeout = list(GLOO_ERRORS)[1], list(GLOO_ERRORS)[2]
    with pytest.raises(PeerError) as info:
        channel._wait(fails(lost))
    assert str(info.value) == ("lost rank 1 (gloo: Read error [127.0.0.1]:21938: Connection reset by peer); the other "
                               "process died or its host dropped off the network")
    with pytest.raises(PeerError, match=r"^rank 1 sent nothing for 7 s \(transport.timeout_s\); is it still running\? "
                                        r"\(gloo: Timed out waiting 3000ms for recv operation to complete\)$"):
        channel._wait(fails(timeout))
