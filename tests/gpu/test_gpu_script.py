"""The prepared GPU check (bench/gpu) must not rot between GPUs: its --dry-run runs the same parts on the CPU
with tiny shapes, and every part must end "ok" with parity true and a projection computed from the timings."""
import json
import subprocess
import sys

import pytest

from tests.support.tiny_models import REPO


@pytest.mark.slow  # ~16 s of a whole launch and every part's timing: CI runs it with -m slow
def test_the_gpu_check_dry_run_runs_every_part(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(tmp_path), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert [p for p in report["parts"] if p["status"] != "ok"] == []
    ran = [c for c in report["parity"] if c["identical"] is not None]
    assert len(ran) == 3 and all(c["identical"] is True for c in ran), report["parity"]
    assert "model drafter" in ran[0]["name"]  # the dry run's one launch takes the path with the most code
    assert "requests at once" in ran[2]["name"] and "batches up to" in ran[2]["name"]
    timings = report["timings"]
    assert timings["drafter_k_loop"]["eager_ms"] > 0 and timings["rounds"][0]["mean_ms"]["round"] > 0
    for shape in ("qwen2.5-7b", "qwen2.5-32b"):
        assert all(timings[shape][f"per_layer_ms_{t}"] > 0 for t in (1, 5, 16))
    projection = report["projection"]
    assert projection["tokens_per_s_this_device"] > 0 and projection["inputs"]["rtt_ms"] == 86.0
    assert "Projection for the seed's setting" in (tmp_path / "gpu.md").read_text()
