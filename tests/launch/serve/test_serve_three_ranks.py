"""Issue 28 through three ranks over gloo: the torchrun launch serving 8 requests at once, the target's layers
split over the three ranks, each answer token-identical to transformers generate of its own prompt. A launch of
its own (~20 s): slow."""
import os
import signal

import pytest

from tests.support.serve_harness import EIGHT_PROMPTS, launch_served, post_together, wait_healthy
from tests.support.tiny_models import free_port, kill_launch, reference_greedy

pytestmark = pytest.mark.slow


def test_eight_concurrent_clients_through_three_ranks_each_equal_generate(models):
    target, draft = models
    port = free_port()
    proc = launch_served(target, draft, port, 3, "model.split=auto", "serve.max_concurrent=8")
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
        kill_launch(proc)
