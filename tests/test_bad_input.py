"""Bad input gets one line naming the cause and the fix, and a non-zero exit; never a hang."""
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.tiny_models import REPO, free_port, ids_arg, run_tandem, save_tiny, save_tiny_tokenizer


# A frame of our own code in a traceback (torchrun prints its own agent's ChildFailedError report
# after a worker exits non-zero; that one is torchrun's, and comes after our line).
OUR_FRAME = re.compile(r'File "[^"]*(/launch/|/model_parallel/|/kvcache/|/speculative/|/netbridge/|train_free_infer\.py)')


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    assert not OUR_FRAME.search(proc.stderr), proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tandem")]
    assert lines, proc.stderr[-3000:]
    for needle in needles:
        assert any(needle in line for line in lines), (needle, lines)


def run_plain(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, str(REPO / "train_free_infer.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))


def test_unknown_key_lists_valid_keys():
    proc = run_plain("prompt=hi", "gen.max_tokens=5")
    assert_one_line_error(proc, "gen.max_tokens", "max_new_tokens")


def test_bad_value_type():
    proc = run_plain("prompt=hi", "gen.temperature=hot")
    assert_one_line_error(proc, "gen.temperature")


def test_not_under_torchrun():
    proc = run_plain("prompt=hi", "model.target=/nonexistent")
    assert_one_line_error(proc, "torchrun --nproc_per_node=2")


def test_missing_model_folder(tmp_path):
    _, proc = run_tandem(tmp_path, f"model.target={tmp_path / 'nope'}", "prompt_ids=[1,2]", expect_ok=False, timeout=120)
    assert_one_line_error(proc, "no config.json")


def test_split_out_of_range(tiny_qwen, tmp_path):
    _, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", "model.split=4", "prompt_ids=[1,2]", expect_ok=False, timeout=120)
    assert_one_line_error(proc, "model.split=4 is out of range", "1..3")


def test_prompt_longer_than_cache(tiny_qwen, tmp_path):
    _, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", "model.max_len=16", "draft.kind=none",
                         "gen.max_new_tokens=10", f"prompt_ids={ids_arg(list(range(1, 10)))}", expect_ok=False, timeout=120)
    assert_one_line_error(proc, "model.max_len=16")


def test_tokenizer_config_mismatch(tmp_path):
    folder = save_tiny(tmp_path / "m", "qwen2", seed_vocab=200)
    save_tiny_tokenizer(folder, vocab_size=320)  # 319 tokens for a 200-row embedding
    _, proc = run_tandem(tmp_path, f"model.target={folder}", "prompt=hello", "draft.kind=none", expect_ok=False, timeout=120)
    assert_one_line_error(proc, "the tokenizer has", "vocab_size is 200")


def test_peer_never_joins():
    t0 = time.monotonic()
    proc = run_plain("prompt_ids=[1]", "transport.timeout_s=3", timeout=60,
                     env=dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    assert time.monotonic() - t0 < 45
    assert_one_line_error(proc, "could not form the gloo group", "127.0.0.1")


def wait_for_output(proc, seconds: float) -> bool:
    """True once the process printed something on stdout (rank 0 streams text as tokens commit)."""
    got = threading.Event()
    threading.Thread(target=lambda: (proc.stdout.read(1), got.set()), daemon=True).start()
    return got.wait(seconds)


def test_peer_dies_mid_generation(tiny_qwen, tmp_path):
    folder = tmp_path / "with-tokenizer"
    shutil.copytree(tiny_qwen, folder)
    save_tiny_tokenizer(folder)
    port = free_port()
    args = [f"model.target={folder}", "output.stream=true", "model.dtype=float32", "draft.kind=none", "prompt_ids=[1,2,3]", "chat=false",
            "gen.max_new_tokens=900", "model.max_len=1024", "transport.emulate_delay_ms=20", "transport.timeout_s=20"]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(REPO / "train_free_infer.py"), *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        # generating once text streams (900 rounds at >= 40 ms each take > 36 s)
        assert wait_for_output(procs[0], 90), procs[0].communicate()[1][-2000:]
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=40)
        assert time.monotonic() - t0 < 30
        proc = subprocess.CompletedProcess(procs[0].args, procs[0].returncode, "", err)
        assert_one_line_error(proc, "rank 1")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
