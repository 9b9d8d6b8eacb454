"""plan_only=true: the ranks meet, probe their links and time themselves, rank 0 prints the split, memory and the
cost model's prediction, and every rank leaves with status 0 before any weight loads."""
from __future__ import annotations

import pytest

import launch.build
from tests.support.tiny_models import run_entry_pair, run_tandem

ARGS = ("model.dtype=float32", "draft.dtype=float32", "draft.quant=none", "model.max_len=64", "draft.max_len=64",
        "gen.max_new_tokens=8")


def test_plan_only_meets_times_predicts_and_loads_no_weight(monkeypatch, capsys, tiny_qwen):
    loaded = []
    monkeypatch.setattr(launch.build, "load_stage", lambda *a, **k: loaded.append(a) or pytest.fail("a weight loaded"))
    outcome = run_entry_pair(monkeypatch, f"model.target={tiny_qwen}", f"draft.model={tiny_qwen}", "plan_only=true",
                             "model.split=2", *ARGS)
    err = capsys.readouterr().err
    assert outcome == {0: None, 1: None}, err
    assert not loaded
    assert "[rank 0: layers 0-1 (2 of 4)" in err and "[rank 1: layers 2-3 (2 of 4) + norm + head" in err
    # timed although the split was given: the prediction needs every rank's figures
    assert "ms per round not timed" not in err
    assert "[predicted: " in err and "tokens/s for one stream" in err and "TTFT of a 2048-token prompt" in err
    assert "plan only (plan_only=true)" in err


def test_plan_only_needs_no_prompt():
    from launch.config import load_config
    assert load_config(["plan_only=true"]).plan_only
    with pytest.raises(Exception, match="give a prompt"):
        load_config([])


@pytest.mark.slow
def test_plan_only_two_rank_launch_prints_the_plan_and_exits_0(tmp_path, tiny_qwen):
    """The real entry under torchrun: both ranks exit 0 within seconds, no output JSON (nothing was generated)."""
    result, proc = run_tandem(tmp_path, f"model.target={tiny_qwen}", f"draft.model={tiny_qwen}", "plan_only=true",
                              *ARGS, timeout=120, expect_ok=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result is None
    assert "[predicted: " in proc.stderr and "plan only (plan_only=true)" in proc.stderr
    assert "[rank 0: layers " in proc.stderr and "[rank 1: layers " in proc.stderr
    assert "Traceback" not in proc.stderr
