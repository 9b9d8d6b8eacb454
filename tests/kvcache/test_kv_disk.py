"""kvcache.disk: one rank's KV slice of a token prefix saved in blocks and read back (in-process, fast)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import threading

import pytest
import torch

import kvcache.disk as disk
from kvcache.disk import KVDiskStore, SliceKey, prefix_hashes
from kvcache.static_cache import StaticKVCache

B = 8  # tokens a block
LAYERS = range(2, 5)  # a middle rank's layers


def filled_cache(seed: int, dtype=torch.float32, layers=LAYERS) -> StaticKVCache:
    cache = StaticKVCache(layers, capacity=64, num_kv_heads=2, head_dim=4, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    for store in (cache.keys, cache.values):
        for t in store.values():
            t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def empty_like(cache: StaticKVCache) -> StaticKVCache:
    first = next(iter(cache.keys.values()))
    return StaticKVCache(list(cache.keys), cache.capacity, first.shape[1], first.shape[3], first.dtype, "cpu")


def store(folder, cache, model="weights-A", max_bytes=10 ** 9, warnings=None) -> KVDiskStore:
    return KVDiskStore(folder, SliceKey.of_cache(cache, model), max_bytes, block_tokens=B,
                       warn=(warnings.append if warnings is not None else None))


def saved(folder, cache, tokens, **kw) -> KVDiskStore:
    s = store(folder, cache, **kw)
    s.save(cache, tokens)
    s.flush()
    return s


def tokens(*blocks: int) -> list[int]:
    """One block of B token ids per argument, each block's ids derived from its argument."""
    return [blk * 100 + i for blk in blocks for i in range(B)]


def hashes(*blocks: int) -> list[str]:
    return prefix_hashes(tokens(*blocks), B)


def block_files(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(disk.SUFFIX))


def test_round_trip_restores_keys_and_values_at_their_positions(tmp_path):
    cache = filled_cache(0)
    prompt = prefix_hashes(tokens(1, 2) + [7, 7, 7], B)  # two whole blocks and a partial one, which is not saved
    assert len(prompt) == 2
    saved(tmp_path, cache, prompt)
    restarted = store(tmp_path, cache)  # a new store over the same folder: what a restart sees
    prefix = restarted.read(prompt)
    assert prefix.tokens == 2 * B
    into = empty_like(cache)
    prefix.load_into(into, 2 * B)
    assert int(into.length) == 2 * B
    for layer in LAYERS:
        assert torch.equal(into.keys[layer][:, :, :2 * B], cache.keys[layer][:, :, :2 * B])
        assert torch.equal(into.values[layer][:, :, :2 * B], cache.values[layer][:, :, :2 * B])
        assert not into.keys[layer][:, :, 2 * B:].any()  # nothing past the prefix written


def test_load_into_takes_a_prefix_shorter_than_what_was_read(tmp_path):
    cache = filled_cache(1)
    prefix = saved(tmp_path, cache, hashes(1, 2, 3)).read(hashes(1, 2, 3))
    into = empty_like(cache)
    prefix.load_into(into, B + 3)  # the ranks agreed on less than this rank holds
    assert int(into.length) == B + 3
    assert torch.equal(into.values[3][:, :, :B + 3], cache.values[3][:, :, :B + 3])
    assert not into.values[3][:, :, B + 3:].any()


def test_load_into_leaves_what_the_cache_already_holds(tmp_path):
    """A cache holding the first 5 tokens of the prefix (the last request's) takes [5, n) from disk."""
    cache = filled_cache(11)
    prefix = saved(tmp_path, cache, hashes(1, 2, 3)).read(hashes(1, 2, 3))
    into = empty_like(cache)
    into.keys[4][:, :, :5] = 7.0  # stands for what memory held: left as it is
    prefix.load_into(into, 2 * B + 2, start=5)
    assert int(into.length) == 2 * B + 2
    assert (into.keys[4][:, :, :5] == 7.0).all()
    assert torch.equal(into.keys[4][:, :, 5:2 * B + 2], cache.keys[4][:, :, 5:2 * B + 2])
    assert not into.keys[4][:, :, 2 * B + 2:].any()


def test_longest_saved_prefix_of_another_token_list(tmp_path):
    cache = filled_cache(2)
    s = saved(tmp_path, cache, hashes(1, 2, 3))
    assert s.held(hashes(1, 2, 9, 9)) == 2  # shares two blocks
    assert s.read(hashes(1, 2, 9, 9)).tokens == 2 * B
    assert s.held(prefix_hashes(tokens(1, 2, 3) + [5], B)) == 3
    assert s.held(hashes(9, 2, 3)) == 0  # a different first block: nothing after it is the same prefix


def test_a_block_is_keyed_by_every_token_before_it(tmp_path):
    """Block 1 of (b0 a1) is not block 1 of (a0 a1): its KV was computed after other tokens."""
    cache = filled_cache(3)
    s = saved(tmp_path, cache, hashes(1, 2))
    s.save(cache, hashes(5, 6))
    s.flush()
    assert s.held(hashes(5, 2)) == 1


def test_a_shared_prefix_is_stored_once(tmp_path):
    cache = filled_cache(4)
    s = saved(tmp_path, cache, hashes(1, 2, 3))
    s.save(cache, hashes(1, 2, 4))
    s.flush()
    assert len(block_files(tmp_path)) == 4


@pytest.mark.parametrize("change", [dict(first=3, last=6), dict(dtype="bfloat16"), dict(model="weights-B"),
                                    dict(device="cuda"), dict(role="drafter")])
def test_another_key_never_reaches_the_old_files(tmp_path, change):
    cache = filled_cache(5)
    old = saved(tmp_path, cache, hashes(1, 2))
    other = KVDiskStore(tmp_path, dataclasses.replace(old.key, **change), 10 ** 9, block_tokens=B)
    assert not set(other.paths(hashes(1, 2))) & set(old.paths(hashes(1, 2)))
    assert other.held(hashes(1, 2)) == 0 and other.read(hashes(1, 2)).tokens == 0


def test_a_file_under_another_keys_name_is_refused_by_its_header(tmp_path):
    cache = filled_cache(6)
    old = saved(tmp_path, cache, hashes(1))
    warnings = []
    new = store(tmp_path, cache, model="weights-B", warnings=warnings)
    shutil.copy(old.paths(hashes(1))[0], new.paths(hashes(1))[0])  # a foreign file where the new key looks
    assert new.read(hashes(1)).tokens == 0
    assert len(warnings) == 1 and "refused" in warnings[0] and "\n" not in warnings[0]
    assert not new.paths(hashes(1))[0].exists()  # removed: the next save writes it afresh


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "garbage", "foreign dtype"])
def test_a_damaged_block_is_refused_in_one_line_and_the_prefix_ends_before_it(tmp_path, damage):
    cache = filled_cache(7)
    s = saved(tmp_path, cache, hashes(1, 2, 3))
    second = s.paths(hashes(1, 2, 3))[1]
    if damage == "corrupt":  # a flipped bit in the tensor data, the header intact
        flip_last_byte(second)
    elif damage == "truncated":
        second.write_bytes(second.read_bytes()[:-10])
    elif damage == "garbage":  # not a block file at all: its "header length" is absurd
        second.write_bytes(bytes(range(256)) * 4)
    else:  # a header naming something of torch's that is not a dtype
        second.write_bytes(second.read_bytes().replace(b'"dtype": "float32"', b'"dtype": "load"   ', 1))
    warnings = []
    restarted = store(tmp_path, cache, warnings=warnings)
    assert restarted.read(hashes(1, 2, 3)).tokens == B
    assert len(warnings) == 1 and str(second) in warnings[0] and "\n" not in warnings[0]
    assert not second.exists()
    restarted.save(cache, hashes(1, 2, 3))  # recomputed KV saved again
    restarted.flush()
    assert restarted.read(hashes(1, 2, 3)).tokens == 3 * B and len(warnings) == 1


def test_save_copies_the_slice_before_the_cache_moves_on(tmp_path, monkeypatch):
    """The round after a save may overwrite the slots while the writer thread has yet to write."""
    go = threading.Event()
    real_pack = disk.pack
    monkeypatch.setattr(disk, "pack", lambda *a, **kw: (go.wait(5), real_pack(*a, **kw))[1])
    cache = filled_cache(8)
    expected = cache.keys[2][:, :, :B].clone()
    s = store(tmp_path, cache)
    assert s.save(cache, hashes(1)) == 1
    cache.keys[2].zero_()  # the next rounds write here while the block waits for the disk
    go.set()
    s.flush()
    into = empty_like(cache)
    s.read(hashes(1)).load_into(into, B)
    assert torch.equal(into.keys[2][:, :, :B], expected)


def block_bytes(folder) -> int:
    return max(os.path.getsize(os.path.join(folder, n)) for n in block_files(folder))


def test_eviction_bounds_the_folder_and_takes_least_recently_used_first(tmp_path):
    cache = filled_cache(9)
    size = block_bytes(saved(tmp_path / "probe", cache, hashes(1)).folder)
    s = saved(tmp_path, cache, hashes(1, 2), max_bytes=int(4.5 * size))
    s.save(cache, hashes(3, 4))
    s.flush()
    s.read(hashes(1, 2))  # (1 2) is now used more recently than (3 4)
    s.save(cache, hashes(5, 6))
    s.flush()
    assert sum(os.path.getsize(tmp_path / n) for n in block_files(tmp_path)) <= 4.5 * size
    assert s.held(hashes(1, 2)) == 2 and s.held(hashes(5, 6)) == 2 and s.held(hashes(3, 4)) == 0


def test_eviction_takes_a_chains_later_blocks_first(tmp_path):
    """Block k is useless without blocks 0..k-1: a bound that fits two blocks keeps the first two."""
    cache = filled_cache(10)
    size = block_bytes(saved(tmp_path / "probe", cache, hashes(1)).folder)
    s = saved(tmp_path, cache, hashes(1, 2, 3), max_bytes=int(2.5 * size))
    assert len(block_files(tmp_path)) == 2 and s.held(hashes(1, 2, 3)) == 2


def test_stage_identity_follows_the_weights_a_rank_loads(tmp_path):
    from speculative.prefixes import pipeline_identity
    from model_parallel.identity import stage_identity
    from tests.support.tiny_models import save_tiny
    folder = save_tiny(tmp_path / "m", "llama", seed=0)
    first = stage_identity(folder, 0, 2, embed=True, head=False)
    assert stage_identity(folder, 0, 2, embed=True, head=False) == first  # stable across starts
    assert stage_identity(folder, 0, 2, embed=True, head=False, extra={"quant": "nf4"}) != first
    save_tiny(folder, "llama", seed=1)  # other weights in the same folder
    assert stage_identity(folder, 0, 2, embed=True, head=False) != first
    assert pipeline_identity(["a", "b"]) != pipeline_identity(["b", "a"])


def test_a_failing_disk_is_one_warning_and_never_an_error(tmp_path, monkeypatch):
    def full(*_, **__):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk, "pack", full)
    warnings = []
    cache = filled_cache(12)
    s = store(tmp_path, cache, warnings=warnings)
    s.save(cache, hashes(1))
    s.save(cache, hashes(2))
    s.flush()
    assert len(warnings) == 1 and "No space left" in warnings[0] and "\n" not in warnings[0]
    assert s.held(hashes(1)) == 0 and not s.pending  # nothing half-written, nothing left queued


def unreadable(path, how: str, monkeypatch) -> None:
    """Make one block file fail to read: a folder in its place (fails for root too), no permission (chmod 000
    as an ordinary user; as root, whom chmod does not stop, the read raises what it would), or an I/O error."""
    import errno
    import pathlib
    if how == "folder":
        path.unlink()
        path.mkdir()
        return
    if how == "chmod" and os.geteuid() != 0:
        path.chmod(0)
        return
    code = errno.EACCES if how == "chmod" else errno.EIO
    real = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes",
                        lambda self: (_ for _ in ()).throw(OSError(code, os.strerror(code), str(self)))
                        if self == path else real(self))


@pytest.mark.parametrize("how", ["folder", "chmod", "eio"])
def test_a_block_that_cannot_be_read_is_a_warning_and_a_shorter_prefix(tmp_path, monkeypatch, how):
    cache, warnings = filled_cache(13), []
    s = saved(tmp_path, cache, hashes(1, 2, 3), warnings=warnings)
    victim = s.paths(hashes(1, 2, 3))[1]
    unreadable(victim, how, monkeypatch)
    assert s.read(hashes(1, 2, 3)).tokens == B  # block 0 only: the rest is prefilled again
    assert len(warnings) == 1 and str(victim) in warnings[0] and "\n" not in warnings[0]
    assert ("IsADirectoryError" if how == "folder" else "PermissionError" if how == "chmod" else "OSError") in warnings[0]
    assert s.read(hashes(1, 2, 3)).tokens == B and len(warnings) == 1  # once, not at every request
    if how != "folder":  # removed where it can be: the next save writes it anew
        monkeypatch.undo()
        s.save(cache, hashes(1, 2, 3))
        s.flush()
        assert s.read(hashes(1, 2, 3)).tokens == 3 * B


def test_a_chain_that_cannot_be_stamped_or_evicted_is_no_error(tmp_path, monkeypatch):
    """utime and unlink refused (files of another user in a shared folder): reads and writes go on."""
    cache, warnings = filled_cache(14), []
    s = saved(tmp_path, cache, hashes(1, 2), warnings=warnings)
    s.max_bytes = 1  # every write now evicts

    def refused(*_, **__):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(disk.os, "utime", refused)
    monkeypatch.setattr(disk.os, "unlink", refused)
    assert s.read(hashes(1, 2)).tokens == 2 * B
    s.save(cache, hashes(3, 4))
    s.flush()
    assert s.held(hashes(3, 4)) == 2 and not warnings
