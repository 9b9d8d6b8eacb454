"""Issue 16: causes travel. A rank that stops for a reason of its own (non-finite logits, a tampered or
replayed frame it refused) sends the reason (protocol.Error) before it leaves, so rank 0's one line and
output.json's `error` name the real cause, not "lost rank 1". In process: the real entry on two threads."""
import json

import pytest

import torch
from safetensors.torch import load_file, save_file

from netbridge.channel import PeerError
from netbridge.relay_channel import RefusedFrame
from tests.support.tiny_models import free_port, ids_arg, run_entry_pair, save_tiny


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
    from netbridge.link_probe import BURST, BURSTS, PINGS
    # the frames both ranks receive in the two link probes (calls counts both): the answering end's pings, bulk and
    # bursts, the probing end's pongs, got, bulk back and the bursts' answers
    PROBE_FRAMES = 2 * ((PINGS + 1 + BURSTS * BURST) + (PINGS + 2 + BURSTS))
    from netbridge.channel import LocalChannel
    real_recv = LocalChannel.recv_frame
    calls = {"n": 0}

    def tampered(self):
        frame = real_recv(self)
        calls["n"] += 1
        if self is channels[1] and calls["n"] > 4 + PROBE_FRAMES:  # past the handshake, mid-generation
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


@pytest.mark.parametrize("problem", ["empty key file", "port in use"])
def test_a_check_only_rank_0_makes_reaches_every_rank_at_once(tmp_path, monkeypatch, reports, tiny_qwen, problem):
    """serve.api_key_file and serve.port are rank 0's alone: a failure there ends every rank with its line,
    at once (not rank 1 waiting to meet a rank 0 that has gone, until torchrun kills it)."""
    import socket
    import time
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=none", "spec.k=0"]
    if problem == "empty key file":
        (tmp_path / "key").write_text("")
        args += [f"serve.api_key_file={tmp_path / 'key'}", "serve.port=0"]
        needle = "is empty"
    else:
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args += [f"serve.port={busy.getsockname()[1]}"]
        needle = "cannot serve on"
    t0 = time.monotonic()
    outcome = run_entry_pair(monkeypatch, *args, timeout_s=20)
    assert time.monotonic() - t0 < 5
    assert outcome == {0: 1, 1: 1}
    lines = rank_lines(reports)
    assert len(lines) == 2 and all(needle in line for line in lines), lines


@pytest.mark.slow  # a torchrun launch of 6-10 s: the default suite keeps under 5 minutes
@pytest.mark.parametrize("links", ["auto", "transport"])
def test_a_rank_that_fails_while_its_peer_sends_is_named_by_its_cause(tmp_path, links):
    """Rank 0 sends its prompt while rank 1 fails to load. Over gloo (`transport`) a send completes only when the
    peer receives, so rank 0 never reads rank 1's Error frame; rank 1's cause reaches it through torchrun's store.
    Over the direct link of one host (`auto`) the send breaks on the closed socket; the cause is the Error frame
    rank 1 left in it."""
    import subprocess
    import sys
    from tests.support.tiny_models import REPO
    broken = save_tiny(tmp_path / "target", "qwen2", seed=1)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.3.mlp.down_proj.weight"]  # rank 1's layer: rank 0 loads and sends, rank 1 fails
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                           f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), *one_shot(broken, out),
                           "model.split=2", "transport.timeout_s=20", f"transport.local_links={links}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    rank0 = [line for line in proc.stderr.splitlines() if line.startswith("tandem[rank 0]")]
    assert proc.returncode != 0 and rank0, proc.stderr[-3000:]
    assert "down_proj" in rank0[0] and "lost rank 1" not in rank0[0], rank0
