"""TensorBoard event files and the merged two-rank trace, read back from a real torchrun run."""
from __future__ import annotations

import json
import random
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from launch.timeline import align_clocks
from tests.tiny_models import ids_arg, run_tandem

K = 3
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
DELAY_MS = 3  # emulated one-way: the alignment may use it as the least time a message takes


@pytest.fixture(scope="module")
def logged_run(tiny_qwen, tmp_path_factory):
    """One real run, K=3, the profiler on, a 3 ms emulated delay. The drafter is the target itself in
    bf16 against the fp32 target: right most of the time, wrong now and then, so both accepted and
    rejected drafts occur."""
    tmp = tmp_path_factory.mktemp("telemetry")
    out, proc = run_tandem(tmp, f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=model",
                           f"draft.model={tiny_qwen}", "draft.dtype=bfloat16", f"spec.k={K}", "gen.max_new_tokens=40",
                           f"prompt_ids={ids_arg(PROMPT)}", f"log.dir={tmp / 'logs'}", "log.profile=true",
                           f"transport.emulate_delay_ms={DELAY_MS}")
    runs = list((tmp / "logs").iterdir())
    assert len(runs) == 1, runs
    return out, runs[0], proc


def scalars(accumulator, tag):
    return {e.step: e.value for e in accumulator.Scalars(tag)}


def test_event_files_agree_with_output_json(logged_run):
    out, run_dir, _ = logged_run
    stats = out["stats"]
    assert re.fullmatch(r"\d{8}-\d{6}-model-k3-model", run_dir.name), run_dir.name
    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    per_round = ["draft_ms", "stage0_ms", "stage1_ms", "network_ms", "round_ms", "drafted", "accepted", "tokens"]
    per_run = ["ttft_ms", "tokens_per_s", "tokens_per_round", "acceptance_rate", "full_hit_rate", "tokens",
               "clock_offset_ms", "clock_uncertainty_ms"]
    for tag in [f"round/{t}" for t in per_round] + [f"run/{t}" for t in per_run] + ["position/acceptance"]:
        assert tag in tags["scalars"], tag
    assert "run/accepted_per_round" in tags["histograms"]
    for text in ("run/prompt", "run/output", "run/config"):
        assert f"{text}/text_summary" in tags["tensors"]
    assert "_hparams_/experiment" in ea.PluginTagToContent("hparams")

    tokens, accepted, drafted = (scalars(ea, f"round/{t}") for t in ("tokens", "accepted", "drafted"))
    assert sorted(tokens) == list(range(stats["rounds"]))  # one step per round, the prefill is step 0
    assert sum(tokens.values()) == len(out["token_ids"]) == stats["tokens"]
    decode = [s for s in tokens if s >= 1]
    assert sum(accepted[s] for s in decode) / sum(drafted[s] for s in decode) == pytest.approx(stats["acceptance_rate"])
    assert 0 < stats["acceptance_rate"] < 1, "the run should exercise both accepted and rejected drafts"
    assert sum(tokens[s] for s in decode) / len(decode) == pytest.approx(stats["tokens_per_round"])
    for tag, key in (("draft_ms", "draft"), ("stage0_ms", "stage0"), ("stage1_ms", "stage1"),
                     ("network_ms", "network"), ("round_ms", "round")):
        values = scalars(ea, f"round/{tag}")
        assert sum(values[s] for s in decode) / len(decode) == pytest.approx(stats["mean_ms"][key], rel=1e-4, abs=1e-3)
    for tag in ("tokens_per_s", "tokens_per_round", "acceptance_rate", "full_hit_rate"):
        assert scalars(ea, f"run/{tag}")[0] == pytest.approx(stats[tag], rel=1e-5)
    assert scalars(ea, "run/ttft_ms")[0] == pytest.approx(stats["ttft_s"] * 1000, rel=1e-5)
    by_position = scalars(ea, "position/acceptance")
    assert [by_position[p] for p in range(1, K + 1)] == pytest.approx(stats["acceptance_per_position"], rel=1e-5)
    assert list(run_dir.glob("rank0*.pt.trace.json*")), "log.profile=true wrote no torch.profiler trace"


def test_merged_trace_orders_both_ranks(logged_run):
    out, run_dir, proc = logged_run
    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for e in spans:
        assert {"name", "ts", "dur", "pid", "tid"} <= e.keys() and e["dur"] >= 0
    names = {(e["pid"], e["name"]) for e in spans}
    assert {(0, n) for n in ("round", "draft", "stage0", "send", "wait", "commit")} <= names
    assert {(1, n) for n in ("wait", "stage1", "verify", "send")} <= names
    rounds = {e["args"]["round"]: e for e in spans if e["pid"] == 0 and e["name"] == "round"}
    verifies = {e["args"]["round"]: e for e in spans if e["pid"] == 1 and e["name"] == "verify"}
    assert sorted(rounds) == sorted(verifies) == list(range(out["stats"]["rounds"]))
    for i, v in verifies.items():  # after alignment, rank 1 verifies round i while rank 0 is in round i
        r = rounds[i]
        assert r["ts"] <= v["ts"] and v["ts"] + v["dur"] <= r["ts"] + r["dur"], (i, r, v)
    clock = trace["otherData"]
    assert clock["clock_consistent"] and clock["clock_rounds"] == out["stats"]["rounds"]
    # Both ranks read one host's monotonic clock: the true offset, 0, must lie in the reported interval,
    # and the emulated delay is no part of the uncertainty (it is a known least time on the wire).
    assert abs(clock["clock_offset_ms"]) <= clock["clock_uncertainty_ms"] + 0.05
    assert clock["clock_uncertainty_ms"] < DELAY_MS
    assert "rank 1's clock" in proc.stderr


def test_clock_alignment_recovers_a_known_offset():
    """Synthetic round trips with rank 1's clock 1234.5 ms ahead and random wire times."""
    rng, theta = random.Random(0), 1.2345
    windows, marks, wires, t = [], [], [], 100.0
    for _ in range(30):
        out, hold, back = rng.uniform(2e-4, 5e-3), rng.uniform(1e-3, 2e-2), rng.uniform(2e-4, 5e-3)
        wires.append(out + back)
        windows.append((t, t + out + hold + back))
        recv = t + out + theta
        marks.append([recv - 1e-3, recv, recv + hold / 2, recv + hold])
        t += out + hold + back + rng.uniform(0, 0.05)
    a = align_clocks(windows, marks)
    assert a.consistent and a.rounds == 30
    assert abs(a.offset_ms - theta * 1000) <= a.uncertainty_ms <= min(wires) / 2 * 1000 + 1e-6
    tight = align_clocks(windows, marks, min_one_way_s=2e-4)  # every message took at least 0.2 ms
    assert abs(tight.offset_ms - theta * 1000) <= tight.uncertainty_ms <= a.uncertainty_ms - 0.2 + 1e-6
    broken = align_clocks(windows, [[m[0], m[1] + 1, m[2] + 1, m[3] + 1] if i == 5 else m for i, m in enumerate(marks)])
    assert not broken.consistent  # one reading a second late contradicts the others; reported, not hidden
    assert align_clocks([], []).rounds == 0
