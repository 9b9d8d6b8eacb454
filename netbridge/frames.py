"""One wire format for every transport: a small JSON header plus raw tensor bytes.

    b"TDM1" | u32 header length | header JSON | tensor bytes, in header order

The header names the message kind, carries small control fields (`meta`), and lists each tensor's
name, dtype and shape. Decoding checks every length against the frame before touching it, so a
garbage or truncated frame is a `FrameError`, never a wrong tensor.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import torch

from netbridge.link import MAX_FRAME_BYTES  # one bound for the message and the link frame carrying it

MAGIC = b"TDM1"
DTYPES = {str(d).removeprefix("torch."): d for d in
          (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8)}


class FrameError(ValueError):
    """A frame that is not a valid Tandem message."""


@dataclass
class Message:
    kind: str
    meta: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def encode(msg: Message) -> bytes:
    specs, blobs = [], []
    for name, t in msg.tensors.items():
        t = t.detach().contiguous().cpu()
        specs.append([name, str(t.dtype).removeprefix("torch."), list(t.shape)])
        blobs.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    header = json.dumps({"kind": msg.kind, "meta": msg.meta, "tensors": specs}, separators=(",", ":")).encode()
    frame = b"".join([MAGIC, struct.pack("<I", len(header)), header, *blobs])
    if len(frame) > MAX_FRAME_BYTES:
        raise FrameError(f"message of {len(frame)} bytes exceeds the frame bound {MAX_FRAME_BYTES}")
    return frame


def decode(frame: bytes | bytearray | memoryview) -> Message:
    frame = memoryview(frame)
    if len(frame) < 8 or bytes(frame[:4]) != MAGIC:
        raise FrameError("not a Tandem frame (bad magic): is the peer a Tandem of the same version?")
    (header_len,) = struct.unpack("<I", frame[4:8])
    if 8 + header_len > len(frame):
        raise FrameError(f"truncated frame: header of {header_len} bytes in a frame of {len(frame)}")
    try:
        header = json.loads(bytes(frame[8:8 + header_len]))
        kind, meta, specs = header["kind"], header["meta"], header["tensors"]
        if not isinstance(kind, str) or not isinstance(meta, dict) or not isinstance(specs, list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise FrameError("frame header is not valid Tandem JSON") from None
    offset, tensors = 8 + header_len, {}
    for spec in specs:
        name, dtype, shape = _check_spec(spec)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > len(frame):
            raise FrameError(f"truncated frame: tensor {name!r} needs {nbytes} bytes, {len(frame) - offset} left")
        raw = bytearray(frame[offset:offset + nbytes])  # owned copy: the frame buffer may be reused
        tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
        offset += nbytes
    if offset != len(frame):
        raise FrameError(f"frame has {len(frame) - offset} trailing bytes")
    return Message(kind, meta, tensors)


def _check_spec(spec):
    try:
        name, dtype_name, shape = spec
        dtype = DTYPES[dtype_name]
        if not isinstance(name, str) or not all(isinstance(s, int) and 0 <= s < 2**31 for s in shape) or len(shape) > 8:
            raise TypeError
        # bound the shape even where a 0 makes it empty: torch computes strides from the other dims
        if math.prod(max(s, 1) for s in shape) * dtype.itemsize > MAX_FRAME_BYTES:
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise FrameError(f"bad tensor spec in frame header: {spec!r}"[:200]) from None
    return name, dtype, shape
