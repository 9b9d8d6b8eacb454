"""End to end with real processes: what the in-process tests (run_pair: two threads over local_pair)
cannot show. torchrun launches: greedy parity (gloo, two processes; llama's tied head, split=1 and the
n-gram drafter are covered in process: test_model_parallel, test_speculative), one sampled run equal
to the in-process run of the same config, one config error and one lost peer (two
torchruns, as on two hosts), each ending the terminal with its cause, not torchrun's link. And plain
processes for bad starts: not under torchrun, a peer that never joins, --help."""
import json
import os
import socket
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.one_line import assert_one_line_process_error
from tests.support.tiny_models import REPO, free_port, ids_arg, reference_greedy, run_pair, run_tandem, save_tiny_tokenizer

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
MAX_NEW = 23

# --- torchrun: two processes over gloo -----------------------------------------------------------

def test_torchrun_qwen2_model_drafter_matches_generate(tiny_qwen, tiny_qwen_draft, tmp_path):
    """GQA, untied head, the default split (half), a neural drafter with adaptive K (the defaults), and three
    rounds in flight over gloo (whose send completes only when the peer receives: both ranks send before they
    receive, so a channel that sent in line would hold both until transport.timeout_s)."""
    out, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=model",
                           f"draft.model={tiny_qwen_draft}", "draft.dtype=float32", "spec.k=4",
                           f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}", "spec.in_flight=3",
                           "transport.timeout_s=30")
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, MAX_NEW)
    assert out["stats"]["in_flight_mean"] > 1.5
    assert out["stats"]["stop_reason"] == "max_new_tokens" and out["stats"]["drafted_tokens"] > 0
    assert "tokens/round" in proc.stderr  # rank 0's summary line


@pytest.mark.slow  # a torchrun launch of ~6 s (the default suite read 5:04)
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


def last_lines(text: str, n: int = 3) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


@pytest.mark.slow  # a torchrun launch of ~5 s: the default suite is kept under 5 minutes
def test_torchrun_config_errors_end_the_terminal_with_their_cause(tiny_qwen, tmp_path):
    """A command-line mistake is printed once per host (every rank read the same command line), tagged,
    and the last lines on the terminal, after torchrun's own report, carry it (through the workers' error
    files, which `report` writes for every failure; a mistake found per rank, one line from each rank:
    test_launch's test_entry_reports_a_config_error_on_both_ranks, in process)."""
    _, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", "model.splt=2", "prompt_ids=[1,2]", expect_ok=False,
                         timeout=120)
    assert proc.stdout.strip() == ""  # so stderr's end is the terminal's end
    assert proc.returncode == 1
    lines = assert_one_line_process_error(proc, "unknown config key 'model.splt'", "valid keys in model: target, split")
    assert lines == [lines[0]] and lines[0].startswith("tandem[rank 0]: "), lines
    assert "unknown config key 'model.splt'" in last_lines(proc.stderr), proc.stderr[-3000:]


@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_torchrun_peer_lost_mid_generation_ends_the_terminal_with_the_cause(tiny_qwen, tmp_path):
    """Two torchruns, as on two hosts (--nnodes=2); rank 1's process is killed (as the OOM killer would)
    while rank 0 generates. Rank 0 stops within the timeout, keeps what it generated, and the last lines
    of its host's terminal say it lost rank 1."""
    import shutil
    folder = tmp_path / "with-tokenizer"
    shutil.copytree(tiny_qwen, folder)
    save_tiny_tokenizer(folder)
    out = tmp_path / "out.json"
    port = free_port()
    args = [f"model.target={folder}", "output.stream=true", "model.dtype=float32", "draft.kind=none", "prompt_ids=[1,2,3]",
            "chat=false", "gen.max_new_tokens=900", "model.max_len=1024", "transport.emulate_delay_ms=20",
            "transport.timeout_s=20", f"output.json={out}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               str(REPO / "train_free_infer.py"), *args],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for node in (0, 1)]
    terminal = Terminal(nodes[0])
    try:
        # generating once text streams after rank 0's prefill line (900 rounds at >= 40 ms each take > 36 s)
        assert terminal.wait_for(lambda text: "[prefill:" in text and text.split("[prefill:")[-1].partition("\n")[2].strip(),
                             120), terminal.text()[-3000:]
        os.kill(worker_of(nodes[1].pid), signal.SIGKILL)
        t0 = time.monotonic()
        nodes[0].wait(timeout=60)
        assert time.monotonic() - t0 < 30
        terminal.thread.join(10)
        text = terminal.text()
        assert nodes[0].returncode == 1, text[-3000:]
        assert "tandem[rank 0]: lost rank 1" in last_lines(text), text[-3000:]
        kept = json.loads(out.read_text())
        assert kept["token_ids"] and "lost rank 1" in kept["error"]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
            p.wait()


class Terminal:
    """What a process shows on its terminal (stdout and stderr merged), read from a thread as it comes."""

    def __init__(self, proc):
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._read, args=(proc.stdout.fileno(),), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        while chunk := os.read(fd, 4096):
            self.chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, condition, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if condition(self.text()):
                return True
            time.sleep(0.1)
        return False


def worker_of(agent_pid: int) -> int:
    """The one process torchrun's agent started (its child, found through /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent_pid:
            return int(stat.parent.name)
    raise AssertionError(f"torchrun {agent_pid} has no worker")


# --- plain processes: started the wrong way, a peer absent or killed -----------------------------

def run_plain(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, str(REPO / "train_free_infer.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))


@pytest.mark.slow  # a process start of ~3 s
def test_not_under_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, str(REPO / "train_free_infer.py"), "prompt=hi", "model.target=/nonexistent"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)))
    assert_one_line_process_error(proc, "torchrun --nproc_per_node=2")


@pytest.mark.slow  # waits out a join timeout (~5 s)
def test_peer_never_joins():
    t0 = time.monotonic()
    proc = run_plain("prompt_ids=[1]", "transport.timeout_s=1", timeout=60,
                     env=dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))
    assert time.monotonic() - t0 < 45
    assert_one_line_process_error(proc, "could not form the gloo group", "127.0.0.1")


@pytest.mark.slow  # a torchrun launch of ~5 s: the default suite is kept under 5 minutes
def test_a_serve_port_in_use_is_found_before_the_group_forms():
    """Rank 0 binds serve.port first (the process group then opens ephemeral ports of its own, which
    could take it): taken, it says so at once with one line, then waits for its peer only to tell it
    (at most transport.timeout_s: here the peer never comes)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = run_plain(f"serve.port={port}", "model.target=/nonexistent", "transport.timeout_s=2", timeout=45,
                         env=dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(free_port())))
    assert_one_line_process_error(proc, f"cannot serve on 127.0.0.1:{port}", "pick another serve.port")


def test_help_prints_every_key_with_its_default_and_meaning():
    """`--help` / `-h` needs no torchrun and no model: every key of the config tree, as key=default
    (TANDEM_CACHE resolved, as a run would), each with a meaning, then exit 0."""
    from omegaconf import OmegaConf
    from launch.config import TandemConfig

    def leaves(tree, prefix=""):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]
    keys = dict(leaves(OmegaConf.to_container(OmegaConf.structured(TandemConfig), resolve=False)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    for flag in ("--help", "-h"):
        proc = subprocess.run([sys.executable, str(REPO / "train_free_infer.py"), flag], capture_output=True, text=True,
                              timeout=60, cwd=REPO, env=dict(env, PYTHONPATH=str(REPO), TANDEM_CACHE="/srv/models-here"))
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
        lines = proc.stdout.splitlines()
        assert "torchrun --nproc_per_node=2 train_free_infer.py" in lines[0]
        for key in keys:
            at = next((i for i, line in enumerate(lines) if line.strip().startswith(key + "=")), None)
            assert at is not None, (key, proc.stdout)
            setting, _, meaning = lines[at].strip().partition(" ")
            meaning = meaning.strip() or lines[at + 1].strip()  # a long key=default puts its meaning below
            assert meaning and not any(meaning.startswith(k + "=") for k in keys), (key, lines[at:at + 2])
        shown = {line.split()[0] for line in lines if line.startswith("  ") and "=" in line.split()[0]}
        assert len(shown) == len(keys), sorted(shown)
        for setting in ("spec.k=4", "gen.temperature=0.0", "draft.device=auto", "serve.port=null", "gen.stop=[]",
                        "model.target=/srv/models-here/models/qwen2.5-coder-1.5b-instruct"):
            assert setting in shown, (setting, sorted(shown))

