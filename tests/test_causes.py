"""Issue 16: causes travel. A rank that stops for a reason of its own (non-finite logits, a tampered or
replayed frame it refused) sends the reason (protocol.Error) before it leaves, so rank 0's one line and
output.json's `error` name the real cause, not "lost rank 1". In process: the real entry on two threads."""
import json

import pytest

import torch
from safetensors.torch import load_file, save_file

from netbridge.channel import PeerError
from netbridge.relay_channel import RefusedFrame
from tests.tiny_models import ids_arg, run_entry_pair, save_tiny


def overflowing_head(folder):
    """A model whose LM head (rank 1's alone) overflows float32: rank 1's logits are not finite."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    weights["lm_head.weight"][3] = 3e38
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def one_shot(folder, out):
    return [f"model.target={folder}", "model.dtype=float32", "model.split=2", "draft.kind=ngram",
            f"prompt_ids={ids_arg([5, 6, 7])}", "gen.max_new_tokens=8", f"output.json={out}"]


def rank_lines(reports) -> list[str]:
    """The one-line reports the entry made, as (rank, line): recorded at the call, since two threads'
    lines in one captured stderr can run together."""
    return [line for _, line in sorted(reports)]


@pytest.fixture
def reports(monkeypatch):
    import train_free_infer
    made, real = [], train_free_infer.report

    def recording(message, rank=None, echo=True):
        if echo:
            made.append((rank, f"tandem[rank {rank}]: {message}"))
        return real(message, rank, echo)
    monkeypatch.setattr(train_free_infer, "report", recording)
    return made


def test_non_finite_logits_on_rank1_reach_rank0s_line_and_output_json(tmp_path, monkeypatch, reports):
    folder = overflowing_head(save_tiny(tmp_path / "target", "qwen2", seed=1))
    outcome = run_entry_pair(monkeypatch, *one_shot(folder, tmp_path / "out.json"))
    assert outcome == {0: 1, 1: 1}
    lines = rank_lines(reports)
    assert len(lines) == 2 and all("not finite" in line for line in lines), lines
    assert "not finite" in json.loads((tmp_path / "out.json").read_text())["error"]


def test_a_refused_frame_on_rank1_reaches_rank0(tmp_path, monkeypatch, reports):
    """The relay channel refuses a tampered frame with a RefusedFrame (a PeerError, though the peer is
    fine): the refusing rank must still tell the other why it stops."""
    from netbridge.channel import LocalChannel
    real_recv = LocalChannel.recv_frame
    calls = {"n": 0}

    def tampered(self):
        frame = real_recv(self)
        calls["n"] += 1
        if self is channels[1] and calls["n"] > 4:
            raise RefusedFrame("refused a frame from rank 0 through the relay r:1: the tag does not match; someone on "
                               "the path altered or replayed it")
        return frame
    channels = []
    import netbridge.channel as channel_module
    real_pair = channel_module.local_pair
    monkeypatch.setattr(channel_module, "local_pair", lambda *a, **k: channels.extend(real_pair(*a, **k)) or tuple(channels))
    monkeypatch.setattr(LocalChannel, "recv_frame", tampered)
    folder = save_tiny(tmp_path / "target", "qwen2", seed=1)
    outcome = run_entry_pair(monkeypatch, *one_shot(folder, tmp_path / "out.json"))
    assert outcome == {0: 1, 1: 1}
    lines = rank_lines(reports)
    assert len(lines) == 2 and all("altered or replayed" in line for line in lines), lines
    assert "altered or replayed" in json.loads((tmp_path / "out.json").read_text())["error"]
    assert issubclass(RefusedFrame, PeerError)
