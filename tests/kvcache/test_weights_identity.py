"""model_parallel.identity: the KV disk cache's key follows the weights' bytes, not their names, sizes, headers
or times (in-process, fast), and a real launch over two such folders sharing cache.dir (slow)."""
from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import model_parallel.identity as identity
from model_parallel.identity import stage_identity
from tests.support.tiny_models import save_tiny

WEIGHTS = "model.safetensors"


def same_times(*folders) -> None:
    """Every file's atime and mtime set to 1 s past the epoch (as a Nix store or `touch -d @1` leaves them)."""
    for folder in folders:
        for file in folder.iterdir():
            os.utime(file, ns=(10 ** 9, 10 ** 9))


def scaled_copy(folder, dest, name: str, factor: float):
    """A copy of `folder` whose tensor `name` is multiplied by `factor`: the same file names, sizes, safetensors
    header and config.json, other bytes."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, dest)
    tensors = load_file(folder / WEIGHTS)
    tensors[name] = tensors[name] * factor
    save_file(tensors, dest / WEIGHTS, metadata={"format": "pt"})
    return dest


def header(file) -> bytes:
    data = file.read_bytes()
    return data[:8 + int.from_bytes(data[:8], "little")]


@pytest.fixture
def twins(tmp_path):
    """Two folders alike in everything but layer 0's k_proj bytes, with equal mtimes."""
    a = save_tiny(tmp_path / "a", "llama", seed=0)
    b = scaled_copy(a, tmp_path / "b", "model.layers.0.self_attn.k_proj.weight", 1.3)
    same_times(a, b)
    assert header(a / WEIGHTS) == header(b / WEIGHTS) and (a / WEIGHTS).read_bytes() != (b / WEIGHTS).read_bytes()
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert os.stat(a / WEIGHTS).st_mtime_ns == os.stat(b / WEIGHTS).st_mtime_ns
    return a, b


def test_weights_of_one_shape_with_equal_times_have_other_identities(twins, tmp_path):
    a, b = twins
    assert stage_identity(a, 0, 1, True, False) != stage_identity(b, 0, 1, True, False)
    cache = tmp_path / "cache"  # with the digests remembered in one cache.dir, in either order
    first = stage_identity(a, 0, 1, True, False, cache_dir=cache)
    assert stage_identity(b, 0, 1, True, False, cache_dir=cache) != first
    assert stage_identity(a, 0, 1, True, False, cache_dir=cache) == first


def test_a_copy_elsewhere_keeps_its_identity(twins, tmp_path):
    """The key is the bytes: a copied or touched folder finds its saved prefixes again (after one hashing)."""
    a, _ = twins
    copy = shutil.copytree(a, tmp_path / "copy")
    os.utime(copy / WEIGHTS)
    assert stage_identity(copy, 0, 1, True, False) == stage_identity(a, 0, 1, True, False)


def test_a_digest_is_remembered_until_the_file_changes(twins, tmp_path, monkeypatch):
    a, _ = twins
    monkeypatch.setattr(identity, "RACY_NS", 0)  # the files were written just now
    hashed = []
    real = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda path, kind: hashed.append(path) or real(path, kind))
    cache = tmp_path / "cache"
    first = stage_identity(a, 0, 1, True, False, cache_dir=cache)
    assert stage_identity(a, 0, 1, True, False, cache_dir=cache) == first
    assert len(hashed) == 1 and len(list((cache / identity.MEMO).iterdir())) == 1  # read once, one record
    time.sleep(0.05)  # past the kernel's timestamp tick: the rewrite gets another ctime
    data = bytearray((a / WEIGHTS).read_bytes())
    data[-1] ^= 0x01  # rewritten in place: same size and header, and the mtime set back
    (a / WEIGHTS).write_bytes(bytes(data))
    same_times(a)
    assert stage_identity(a, 0, 1, True, False, cache_dir=cache) != first
    assert len(hashed) == 2


def test_a_file_changed_within_the_timestamp_tick_is_not_remembered(twins, tmp_path, monkeypatch):
    a, _ = twins  # written just now: a rewrite within the same tick would leave its stat as it is
    hashed = []
    real = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda path, kind: hashed.append(path) or real(path, kind))
    stage_identity(a, 0, 1, True, False, cache_dir=tmp_path / "cache")
    stage_identity(a, 0, 1, True, False, cache_dir=tmp_path / "cache")
    assert len(hashed) == 2


def test_an_unwritable_memo_costs_a_hashing_not_the_run(twins, tmp_path, monkeypatch):
    a, b = twins
    monkeypatch.setattr(identity, "RACY_NS", 0)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the records' folder would go")
    assert stage_identity(a, 0, 1, True, False, cache_dir=blocked) == stage_identity(a, 0, 1, True, False)
    garbled = tmp_path / "garbled"
    stage_identity(a, 0, 1, True, False, cache_dir=garbled)
    for record in (garbled / identity.MEMO).iterdir():
        record.write_text("{not json")
    assert stage_identity(a, 0, 1, True, False, cache_dir=garbled) == stage_identity(a, 0, 1, True, False)


@pytest.mark.slow
def test_a_launch_over_other_weights_of_one_shape_never_restores_the_first_ones_prefix(tiny_qwen, tiny_qwen_draft,
                                                                                        tmp_path):
    """Two torchrun launches share cache.dir: the first over a model, the second over a copy whose layer 0 k/v
    weights are x1.3, every file of both with the same mtime. The second answers what it answers without the
    cache (generate's tokens), restoring nothing."""
    from tests.support.tiny_models import ids_arg, reference_greedy, run_tandem
    a = shutil.copytree(tiny_qwen, tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    from safetensors.torch import load_file, save_file
    tensors = load_file(a / WEIGHTS)
    for kind in "kv":
        name = f"model.layers.0.self_attn.{kind}_proj.weight"
        tensors[name] = tensors[name] * 1.3
    save_file(tensors, b / WEIGHTS, metadata={"format": "pt"})
    same_times(a, b)
    assert header(a / WEIGHTS) == header(b / WEIGHTS)
    prompt = [(i * 37 + 11) % 300 for i in range(50)]
    assert reference_greedy(a, prompt, 12) != reference_greedy(b, prompt, 12)  # else a restore could not show

    def launch(model):
        out, _ = run_tandem(tmp_path, f"model.target={model}", "model.dtype=float32", "draft.kind=model",
                            f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "spec.k=3", "gen.max_new_tokens=12",
                            f"prompt_ids={ids_arg(prompt)}", f"cache.dir={tmp_path / 'cache'}", "cache.min_tokens=16",
                            "cache.block_tokens=8", "model.split=2")
        return out
    first = launch(a)
    assert first["token_ids"] == reference_greedy(a, prompt, 12) and list((tmp_path / "cache").glob("*.kv"))
    second = launch(b)
    assert second["token_ids"] == reference_greedy(b, prompt, 12)
    assert second["stats"]["prompt_tokens_reused"] == 0  # (the drafter's blocks may be: its weights are the same)
