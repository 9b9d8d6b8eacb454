"""End to end with real processes: what the in-process tests (run_pair: two threads over local_pair)
cannot show. Four torchrun launches: greedy parity on both architectures (gloo, two processes),
one sampled run equal to the in-process run of the same config, one config error reported as one
`tandem[rank N]:` line per rank with a non-zero exit. And plain processes for bad starts: not under
torchrun, a peer that never joins, a peer killed mid-generation."""
import os
import socket
import re
import signal
import subprocess
import sys
import threading
import time

from tests.tiny_models import REPO, free_port, ids_arg, reference_greedy, run_pair, run_tandem, save_tiny_tokenizer

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
MAX_NEW = 23

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
    return lines


# --- torchrun: two processes over gloo -----------------------------------------------------------

def test_torchrun_qwen2_model_drafter_matches_generate(tiny_qwen, tiny_qwen_draft, tmp_path):
    """GQA, untied head, the default split (half), a neural drafter with adaptive K (the defaults)."""
    out, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=model",
                           f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "spec.k=4",
                           f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}")
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert out["stats"]["stop_reason"] == "max_new_tokens" and out["stats"]["drafted_tokens"] > 0
    assert "tokens/round" in proc.stderr  # rank 0's summary line


def test_torchrun_llama_ngram_drafter_matches_generate(tiny_llama, tmp_path):
    """Tied embeddings (rank 1's head is its own copy), split after the first layer, prompt lookup."""
    out, _ = run_tandem(tmp_path, f"model.target={tiny_llama}", "model.dtype=float32", "model.split=1",
                        "draft.kind=ngram", "spec.k=3", f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}")
    assert out["token_ids"] == reference_greedy(tiny_llama, PROMPT, MAX_NEW)
    assert out["stats"]["decode_rounds"] > 0


def test_torchrun_sampling_equals_the_in_process_run(tiny_qwen, tiny_qwen_draft, tmp_path):
    """Seeded speculative sampling across two processes draws exactly what the two-thread run draws,
    so the in-process tests of sampling speak for torchrun too."""
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=model", f"draft.model={tiny_qwen_draft}",
            "draft.dtype=float32", "spec.k=4", f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}",
            "gen.temperature=1.0", "gen.top_p=0.9", "gen.seed=5"]
    out, _ = run_tandem(tmp_path, *args)
    assert len(out["token_ids"]) == MAX_NEW
    assert out["token_ids"] != reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert out["token_ids"] == run_pair(*args)["token_ids"]


def test_torchrun_config_error_is_one_line_per_rank(tiny_qwen, tmp_path):
    _, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", "model.split=4", "prompt_ids=[1,2]", expect_ok=False,
                         timeout=120)
    assert_one_line_error(proc, "model.split=4 is out of range", "1..3")
    for rank in (0, 1):  # both ranks share torchrun's stderr: their lines may interleave, so no line split here
        assert f"tandem[rank {rank}]: model.split=4 is out of range" in proc.stderr, proc.stderr[-3000:]


# --- plain processes: started the wrong way, a peer absent or killed -----------------------------

def run_plain(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, str(REPO / "train_free_infer.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))


def test_not_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(REPO / "train_free_infer.py"), "prompt=hi", "model.target=/nonexistent"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)))
    assert_one_line_error(proc, "torchrun --nproc_per_node=2")


def test_peer_never_joins():
    t0 = time.monotonic()
    proc = run_plain("prompt_ids=[1]", "transport.timeout_s=3", timeout=60,
                     env=dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    assert time.monotonic() - t0 < 45
    assert_one_line_error(proc, "could not form the gloo group", "127.0.0.1")


def test_a_serve_port_in_use_is_found_before_the_group_forms():
    """Rank 0 binds serve.port first (the process group then opens ephemeral ports of its own, which
    could take it): taken, it stops at once with one line, not after waiting for its peer."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = run_plain(f"serve.port={port}", "model.target=/nonexistent", "transport.timeout_s=120", timeout=45,
                         env=dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(free_port())))
    assert_one_line_error(proc, f"cannot serve on 127.0.0.1:{port}", "pick another serve.port")


def wait_for_output(proc, seconds: float) -> bool:
    """True once the process printed something on stdout (rank 0 streams text as tokens commit)."""
    got = threading.Event()
    threading.Thread(target=lambda: (proc.stdout.read(1), got.set()), daemon=True).start()
    return got.wait(seconds)


def test_peer_dies_mid_generation(tiny_qwen, tmp_path):
    import shutil
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
