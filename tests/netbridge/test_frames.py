"""The wire format: every dtype round-trips exactly; anything malformed is a FrameError."""
import json
import struct

import pytest
import torch

from netbridge.frames import DTYPES, MAGIC, FrameError, Message, decode, encode


def test_every_dtype_round_trips():
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(3, 5, generator=g) * 100).to(dtype) for name, dtype in DTYPES.items()}
    tensors["empty"] = torch.zeros(0, 7)
    msg = decode(encode(Message("round", {"start": 12, "x": [1, 2]}, tensors)))
    assert msg.kind == "round" and msg.meta == {"start": 12, "x": [1, 2]}
    for name, t in tensors.items():
        assert msg.tensors[name].dtype == t.dtype and torch.equal(msg.tensors[name], t)


def frame(header: dict, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + body


@pytest.mark.parametrize("bad", [
    b"", b"TDM", b"XXXX\x00\x00\x00\x00", MAGIC + struct.pack("<I", 99) + b"{}",
    frame({"kind": "x"}), frame({"kind": 1, "meta": {}, "tensors": []}),
    frame({"kind": "x", "meta": {}, "tensors": [["t", "complex64", [1]]]}),
    frame({"kind": "x", "meta": {}, "tensors": [["t", "float32", [-1]]]}),
    frame({"kind": "x", "meta": {}, "tensors": [["t", "float32", [4]]]}, b"\x00" * 15),  # truncated
    frame({"kind": "x", "meta": {}, "tensors": []}, b"extra"),  # trailing bytes
    # empty, yet its other dims overflow torch's stride computation (found by the relay fuzz test)
    frame({"kind": "", "meta": {}, "tensors": [["", "float32", [0, 57, 644, 1000, 1195, 8920, 23572]]]}),
])
def test_malformed_frames_are_frame_errors(bad):
    with pytest.raises(FrameError):
        decode(bad)
