"""Issue 28 through three ranks over gloo: the torchrun launch serving 8 requests at once, the target's layers
split over the three ranks, each answer token-identical to transformers generate of its own prompt. A launch of
its own (~20 s): slow."""
import os
import signal
import subprocess
import sys

import pytest

from tests.support.serve_harness import EIGHT_PROMPTS, post_together, serve_args, wait_healthy
from tests.support.tiny_models import REPO, free_port, reference_greedy

pytestmark = pytest.mark.slow


def test_eight_concurrent_clients_through_three_ranks_each_equal_generate(models):
    target, draft = models
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), *serve_args(target, draft, port),
           "model.split=auto", "serve.max_concurrent=8"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        answers, most_live = post_together(url, [{"prompt": ids, "max_tokens": n} for ids, n in EIGHT_PROMPTS])
        for (ids, n), (status, answer) in zip(EIGHT_PROMPTS, answers):
            assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(target, ids, n), ids
        assert 2 <= most_live <= 8
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert stderr.count("stopped by SIGTERM") == 3, stderr[-3000:]  # each rank's one line
        assert "[rank 2: layers " in stderr, stderr[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
