"""python -m launch.project (tandem-plan): a projection from config.json and published device figures, checked by
hand on Qwen2.5-7B over two T4s (its config.json as published, in bench/projection_models)."""
from __future__ import annotations

from pathlib import Path

import pytest

from launch import project

QWEN7B = str(Path(__file__).resolve().parents[2] / "bench/projection_models/qwen2.5-7b-instruct")
GB = 1e9


def qwen7b_layer_params() -> int:
    """One Qwen2.5-7B decoder layer, from its config.json by hand: hidden 3584, 28 heads, 4 KV heads of 128,
    MLP 18944; q, k, v carry biases; two norms."""
    h, kv, mlp = 3584, 4 * 128, 18944
    return h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * mlp + 2 * h


def test_two_t4s_without_drafting_is_the_weights_read_plus_the_round_trip(capsys):
    assert project.main([QWEN7B, "--hosts", "T4", "T4", "--rtt-ms", "86", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    # a token: every layer reads its weights (fp16) and 1025 tokens of keys and values at 320 GB/s x 0.6, plus the
    # launches; the last rank its head (152064 x 3584); then the 86 ms round trip. Nothing else.
    read = 2 * qwen7b_layer_params() + 1025 * 2 * 4 * 128 * 2
    layer_ms = 1000 * read / (320 * GB * 0.6) + 0.2
    head_ms = 1000 * 152064 * 3584 * 2 / (320 * GB * 0.6)
    expected = 1000 / (28 * layer_ms + head_ms + 86.0 + 2 * 0.0)
    assert expected == pytest.approx(6.04, abs=0.01)
    assert f"K=0 {expected:.1f} (1.00 tokens/round)" in out
    assert out.startswith("PROJECTION (from published device figures, not measured)")
    assert "fit: yes; split rank 0 layers 0-" in out and "the largest single part: link latency" in out


def test_a_model_that_does_not_fit_says_so_and_exits_1(capsys):
    # 8 KV slots of 65536 tokens: 8 x 28 layers x 2 x 4 x 128 x 2 bytes x 65536 = 30 GB of cache besides the 15.2 GB
    # of weights, against two T4 budgets of (16 - 0.5) GiB x 0.9 = 13.95 GiB
    assert project.main([f"{QWEN7B}/config.json", "--hosts", "T4", "T4", "--dtype", "float16", "--streams", "8",
                         "--max-len", "65536"]) == 1  # a config.json path is a model too
    out = capsys.readouterr().out
    assert "fit: NO." in out and "the budgets add up to 27.90 GiB" in out
    assert "tokens/s" not in out  # nothing projected for a model that does not load


def test_hosts_and_their_crossings():
    assert project.hosts_ranks(["2xT4", "T4,L4"]) == [(0, "T4"), (0, "T4"), (1, "T4"), (1, "L4")]
    links = project.ring_links(project.hosts_ranks(["2xT4", "2xT4"]), [86.0], [100.0])
    assert [link.one_way_ms for link in links] == [project.LOCAL_ONE_WAY_MS, 43.0, project.LOCAL_ONE_WAY_MS, 43.0]
    six = project.ring_links(project.hosts_ranks(["T4"] * 6), [22, 30, 40, 55, 60, 75], [float("inf")])
    assert [link.one_way_ms for link in six] == [11, 15, 20, 27.5, 30, 37.5]
    with pytest.raises(ValueError, match="2 host crossings"):
        project.ring_links(project.hosts_ranks(["T4", "T4"]), [1.0, 2.0, 3.0], [1.0])
    with pytest.raises(ValueError, match="unknown device kind 'V100'"):
        project.device("V100")


def test_nf4_blocks_read_the_weights_dequantized():
    """bitsandbytes' 4-bit matmul over more than one position dequantizes each weight to 16 bits first."""
    s = project.Shape(1, layer_bytes=500, layer_linear=1000, kv_token_bytes=0, attention_width=1, hidden=1, vocab=1,
                      embed_bytes=0, head_bytes=0, quant="nf4")
    assert s.weight_traffic(1, gpu=True) == 500
    assert s.weight_traffic(5, gpu=True) == 500 + 4 * 1000


def test_arguments_a_projection_cannot_use_are_one_line(capsys):
    assert project.main([QWEN7B, "--hosts", "T4"]) == 2
    assert capsys.readouterr().err == "tandem-plan: --hosts T4 gives 1 rank(s); Tandem runs on 2 or more\n"
    assert project.main([QWEN7B, "--hosts", "T4", "T4", "--acceptance", "1.5"]) == 2
    assert "--acceptance 1.5 must be in (0, 1]" in capsys.readouterr().err


def test_workload_plans_the_split_for_long_prompts_at_once(capsys):
    """Four 4,000-token prompts at once and a token each are their prefill: pipelined over the two T4s its pace is
    the busier rank's, so the split that ends them soonest shares the layers about evenly (15 of 28 on rank 0),
    where one stream's split leaves rank 0 only 9 beside its drafter's steps. The fit line and the figures after it
    are of the planned split."""
    base = [QWEN7B, "--hosts", "T4", "T4", "--rtt-ms", "86", "--dtype", "float16", "--drafter",
            str(Path(QWEN7B).parent / "qwen2.5-0.5b-instruct"), "--streams", "4", "--prompt-tokens", "4000"]
    assert project.main(base) == 0
    assert "split rank 0 layers 0-8:" in capsys.readouterr().out  # one stream's
    assert project.main([*base, "--answer-tokens", "1", "--workload"]) == 0
    out = capsys.readouterr().out
    assert ("planned for 4 stream(s) at once, 4000-token prompts and 1-token answers: split 15 ends them in 3.6 s (K=0); "
            "one stream's split (9): 4.7 s") in out
    assert "split rank 0 layers 0-14:" in out
    assert project.main([*base, "--answer-tokens", "0", "--workload"]) == 2
    assert "--answer-tokens 0 must be at least 1" in capsys.readouterr().err
