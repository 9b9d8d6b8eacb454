"""launch/ and the entry (train_free_infer.py): the config (defaults, configs/default.yaml, typos and bad
values), what the build refuses (missing model, split out of range, prompt too long for the caches,
tokenizer/config mismatch, a drafter with another tokenizer), the entry's error handling (one line per
rank, a non-zero exit, the peer told the cause), and telemetry: TensorBoard event files and the
merged two-rank trace read back from a run.

All in process: both ranks as two threads over local_pair (tests.support.tiny_models.run_pair and
run_entry_pair). What needs real processes (torchrun's report, a peer that never joins or dies) is
tests/e2e/test_e2e.py."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
import re
import shutil
import time

import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train_free_infer
from launch.build import CapacityError
from launch.config import ConfigError, TandemConfig, load_config
from launch.timeline import align_clocks
from model_parallel.loader import ModelLoadError
from tests.support.one_line import assert_one_line_error
from tests.support.tiny_models import REPO, ids_arg, run_entry_pair, run_pair, save_tiny, save_tiny_tokenizer


def pair_error(*overrides: str) -> BaseException:
    """The exception the two ranks end with (rank 0's if it failed, else rank 1's)."""
    with pytest.raises(BaseException) as info:
        run_pair(*overrides, timeout_s=20)
    return info.value


# --- the config ----------------------------------------------------------------------------------

def config_exit(capsys, *argv: str) -> str:
    """The entry's one line for a bad command line: printed once, tagged, exit status 1, before any rank work."""
    with pytest.raises(SystemExit) as info:
        train_free_infer.main(list(argv))
    assert info.value.code == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem: "), err  # not under torchrun: no rank to name
    return lines[0]


def test_unknown_key_lists_valid_keys(capsys):
    message = config_exit(capsys, "prompt=hi", "gen.max_tokens=5")
    assert "gen.max_tokens" in message and "max_new_tokens" in message
    with pytest.raises(ConfigError, match=r"valid keys in model: target, split, dtype"):
        load_config(["prompt=hi", "model.splt=3"])


def test_bad_value_type(capsys):
    assert "gen.temperature" in config_exit(capsys, "prompt=hi", "gen.temperature=hot")


@pytest.mark.parametrize("argv,needles", [
    (["prompt=hi", "model.dtype=fp8"], ["model.dtype='fp8'", "float32, bfloat16, float16"]),
    (["prompt=hi", "model.quant_compute_dtype=fp8"], ["model.quant_compute_dtype='fp8'", "float32, bfloat16, float16"]),
    (["prompt=hi", "gen.top_p=0"], ["gen.top_p", "(0, 1]"]),
    (["gen.max_new_tokens=5"], ["give a prompt", "prompt=", "serve.port"]),
    (["prompt=hi", "config=/nonexistent.yaml"], ["/nonexistent.yaml not found", "config=PATH"]),
    (["prompt=hi", "--k=3"], ["'--k=3'", "key=value"]),
])
def test_bad_values_name_the_key_and_the_fix(argv, needles, capsys):
    message = config_exit(capsys, *argv)
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("cache", [None, "/srv/tandem-cache"])
def test_default_yaml_is_exactly_the_defaults(cache, monkeypatch):
    """configs/default.yaml, loaded as config=configs/default.yaml, changes nothing: the documented
    example and the dataclasses agree, with or without TANDEM_CACHE."""
    if cache is None:
        monkeypatch.delenv("TANDEM_CACHE", raising=False)
    else:
        monkeypatch.setenv("TANDEM_CACHE", cache)
    from_file = load_config(["prompt=hi", f"config={REPO / 'configs' / 'default.yaml'}"])
    defaults = load_config(["prompt=hi"])
    assert dataclasses.asdict(from_file) == dataclasses.asdict(defaults)
    assert from_file == defaults
    if cache is not None:
        assert from_file.model.target.startswith(cache + "/models/")


def test_default_yaml_documents_every_key():
    def keys(tree, prefix=""):
        out = set()
        for key, value in tree.items():
            out |= keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
        return out
    documented = keys(OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "default.yaml"), resolve=False))
    schema = keys(OmegaConf.to_container(OmegaConf.structured(TandemConfig), resolve=False))
    assert documented == schema, (sorted(schema - documented), sorted(documented - schema))


# --- what the build refuses, in process ---------------------------------------------------------

def test_missing_model_folder(tmp_path):
    error = pair_error(f"model.target={tmp_path / 'nope'}", "prompt_ids=[1,2]")
    assert_one_line_error(error, ModelLoadError, "no config.json", "missing folder")
    assert "pass a local Hugging Face folder" in str(error) or "model_parallel.fetch_weights" in str(error)


@pytest.mark.parametrize("extra,model,command", [
    ([], "qwen2.5-coder-1.5b-instruct", "`python -m model_parallel.fetch_weights` first"),
    (["config=configs/smollm2.yaml"], "smollm2-135m-instruct", "`python -m model_parallel.fetch_weights --models smollm2-135m` first"),
])
def test_a_missing_embedded_model_names_the_fetch_command_wherever_the_cache_is(extra, model, command, tmp_path, monkeypatch):
    """The default models live under $TANDEM_CACHE/models (a path with no "tandem" in it here): missing,
    the error names the command that fetches them there."""
    cache = tmp_path / "weights-cache"
    monkeypatch.setenv("TANDEM_CACHE", str(cache))
    monkeypatch.chdir(REPO)
    cfg = load_config(["prompt=hi", *extra])
    assert cfg.model.target == str(cache / "models" / model)
    error = pair_error("prompt_ids=[1,2]", *extra)
    assert_one_line_error(error, ModelLoadError, f"{cache / 'models' / model} has no config.json", command)
    # fetched into another cache than this run's: the command names it
    other = tmp_path / "elsewhere" / "models" / model
    error = pair_error("prompt_ids=[1,2]", *extra, f"model.target={other}")
    assert_one_line_error(error, ModelLoadError, f"--cache {tmp_path / 'elsewhere'}` first")


def test_the_drafter_runs_where_the_target_runs_by_default(tiny_qwen, tiny_qwen_draft, monkeypatch):
    """draft.device=auto (the default): rank 0's target device, its GPU on a GPU host, where the CUDA
    graph is then captured (draft.graph=auto); a device given explicitly is kept."""
    import torch
    from launch.build import build_draft_stage, build_stage, use_graph
    from launch.plan import draft_device, plan_here
    cfg = load_config(["prompt=hi", f"model.target={tiny_qwen}", f"draft.model={tiny_qwen_draft}", "model.split=2"])
    assert cfg.draft.device == "auto"
    plan = plan_here(cfg, 0)
    target, drafter = build_stage(plan), build_draft_stage(plan)
    devices = {p.device for p in target.parameters()} | {p.device for p in drafter.parameters()}
    assert len(devices) == 1, devices  # here: the CPU, for both
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a host with two GPUs, rank 0 on the second
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert draft_device(cfg) == "cuda:1" and use_graph(cfg.draft, draft_device(cfg))
    cfg.draft.device = "cpu"
    assert draft_device(cfg) == "cpu" and not use_graph(cfg.draft, draft_device(cfg))


def test_split_out_of_range(tiny_qwen):
    error = pair_error(f"model.target={tiny_qwen}", "model.split=4", "draft.kind=none", "prompt_ids=[1,2]")
    assert_one_line_error(error, ConfigError, "model.split=4 is out of range", "has 4 layers", "1..3")


def test_prompt_longer_than_cache(tiny_qwen):
    error = pair_error(f"model.target={tiny_qwen}", "model.max_len=16", "draft.kind=none", "gen.max_new_tokens=10",
                       f"prompt_ids={ids_arg(list(range(1, 10)))}")
    assert_one_line_error(error, CapacityError, "model.max_len=16", "prompt (9 tokens)", "max_new_tokens (10)",
                          "raise model.max_len or shorten")


def test_drafter_cache_too_small(tiny_qwen):
    error = pair_error(f"model.target={tiny_qwen}", "draft.kind=model", f"draft.model={tiny_qwen}", "draft.max_len=16",
                       "spec.k=4", "gen.max_new_tokens=10", f"prompt_ids={ids_arg(list(range(1, 5)))}")
    assert_one_line_error(error, CapacityError, "draft.max_len=16", "raise draft.max_len")


def test_prompt_ids_outside_the_vocabulary(tiny_qwen):
    error = pair_error(f"model.target={tiny_qwen}", "draft.kind=none", "prompt_ids=[1,320]")
    assert_one_line_error(error, ConfigError, "prompt_ids holds 320", "vocabulary of 320")


def test_text_prompt_without_a_tokenizer(tiny_qwen):
    error = pair_error(f"model.target={tiny_qwen}", "draft.kind=none", "prompt=hello")
    assert_one_line_error(error, ConfigError, "has no tokenizer", "prompt_ids=[...]")


def test_tokenizer_config_mismatch(tmp_path):
    folder = save_tiny(tmp_path / "m", "qwen2", seed_vocab=200)
    save_tiny_tokenizer(folder, vocab_size=320)  # 319 tokens for a 200-row embedding
    error = pair_error(f"model.target={folder}", "prompt=hello", "draft.kind=none")
    assert_one_line_error(error, ModelLoadError, "the tokenizer has", "vocab_size is 200", "different checkpoints")


@pytest.mark.parametrize("content", ["garbage", '{"model": 5}', ""])
def test_unreadable_tokenizer_file(content, tmp_path):
    folder = save_tiny(tmp_path / "m", "qwen2", seed=1)
    save_tiny_tokenizer(folder)
    (folder / "tokenizer.json").write_text(content)
    error = pair_error(f"model.target={folder}", "prompt=hello", "draft.kind=none")
    assert_one_line_error(error, ModelLoadError, "tokenizer files", str(folder), "re-download")


def test_drafter_with_another_tokenizer_is_refused(tiny_qwen, tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(tiny_qwen, target)
    shutil.copytree(tiny_qwen, draft)
    save_tiny_tokenizer(target, vocab_size=320)
    save_tiny_tokenizer(draft, vocab_size=300)
    error = pair_error(f"model.target={target}", "draft.kind=model", f"draft.model={draft}", "prompt=hello")
    assert_one_line_error(error, ConfigError, "the drafter's tokenizer", "differs from the target's",
                          "draft.model must share the target's tokenizer")


def test_drafter_with_another_vocabulary_size_is_refused(tiny_qwen, tmp_path):
    draft = save_tiny(tmp_path / "draft", "qwen2", seed_vocab=300, layers=2)
    error = pair_error(f"model.target={tiny_qwen}", "draft.kind=model", f"draft.model={draft}", "prompt_ids=[1,2]")
    assert_one_line_error(error, ConfigError, "draft vocab_size 300 != target vocab_size 320",
                          "draft.model must share the target's tokenizer")


# --- the entry's error handling: one line per rank, exit 1, the peer told ----------------------

def entry_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return re.findall(r"tandem\[rank [^\]]*\]: [^\r\n]*", err)  # progress bars end in \r, not \n


def test_entry_reports_a_config_error_on_both_ranks(tiny_qwen, monkeypatch, capsys):
    outcome = run_entry_pair(monkeypatch, f"model.target={tiny_qwen}", "model.split=4", "draft.kind=none",
                             "prompt_ids=[1,2]")
    assert outcome == {0: 1, 1: 1}  # sys.exit(1) on both ranks
    lines = entry_lines(capsys)
    assert len(lines) == 2, lines
    assert all("model.split=4 is out of range" in line and "1..3" in line for line in lines), lines


def test_entry_tells_the_peer_why_it_stopped(tiny_qwen, monkeypatch, capsys):
    """Rank 0 alone finds the prompt too long; rank 1, waiting for the handshake, exits at once with
    rank 0's reason instead of a bare 'lost the peer' (or waiting out transport.timeout_s)."""
    t0 = time.monotonic()
    outcome = run_entry_pair(monkeypatch, f"model.target={tiny_qwen}", "model.max_len=16", "draft.kind=none",
                             "gen.max_new_tokens=10", f"prompt_ids={ids_arg(list(range(1, 10)))}", timeout_s=30)
    assert time.monotonic() - t0 < 20
    assert outcome == {0: 1, 1: 1}
    lines = entry_lines(capsys)
    assert len(lines) == 2, lines
    ours = [line for line in lines if "the other rank failed" not in line]
    theirs = [line for line in lines if "the other rank failed" in line]
    assert len(ours) == 1 and "model.max_len=16" in ours[0], lines
    assert len(theirs) == 1 and "model.max_len=16" in theirs[0], lines


def test_entry_runs_clean(tiny_qwen, monkeypatch, capsys, tmp_path):
    out = tmp_path / "out.json"
    outcome = run_entry_pair(monkeypatch, f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=ngram",
                             "prompt_ids=[5,6,7,5,6]", "gen.max_new_tokens=12", f"output.json={out}")
    assert outcome == {0: None, 1: None}
    assert entry_lines(capsys) == []
    assert len(json.loads(out.read_text())["token_ids"]) == 12


# --- telemetry: event files and the merged trace of one run -------------------------------------

K = 3
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
DELAY_MS = 3  # emulated one-way: the alignment may use it as the least time a message takes


@pytest.fixture(scope="module")
def logged_run(tiny_qwen, tmp_path_factory):
    """One run, K=3, the profiler on, a 3 ms emulated delay. The drafter is the target itself in bf16
    against the fp32 target: right most of the time, wrong now and then, so both accepted and rejected
    drafts occur."""
    tmp = tmp_path_factory.mktemp("telemetry")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        out = run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=model",
                       f"draft.model={tiny_qwen}", "draft.dtype=bfloat16", f"spec.k={K}", "gen.max_new_tokens=40",
                       f"prompt_ids={ids_arg(PROMPT)}", f"log.dir={tmp / 'logs'}", "log.profile=true",
                       f"transport.emulate_delay_ms={DELAY_MS}")
    runs = list((tmp / "logs").iterdir())
    assert len(runs) == 1, runs
    return out, runs[0], stderr.getvalue()


def scalars(accumulator, tag):
    return {e.step: e.value for e in accumulator.Scalars(tag)}


def test_event_files_agree_with_output_json(logged_run):
    out, run_dir, _ = logged_run
    stats = out["stats"]
    assert re.fullmatch(r"\d{8}-\d{6}-model-k3-model", run_dir.name), run_dir.name
    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    per_round = ["draft_ms", "stage0_ms", "last_ms", "stage1_ms", "network_ms", "round_ms", "drafted", "accepted",
                 "tokens"]  # stage1_ms: last_ms's name before N ranks, still written
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
    for tag, key in (("draft_ms", "draft"), ("stage0_ms", "stage0"), ("last_ms", "last"), ("stage1_ms", "stage1"),
                     ("network_ms", "network"), ("round_ms", "round")):
        values = scalars(ea, f"round/{tag}")
        assert sum(values[s] for s in decode) / len(decode) == pytest.approx(stats["mean_ms"][key], rel=1e-4, abs=1e-3)
    for tag in ("tokens_per_s", "tokens_per_round", "acceptance_rate", "full_hit_rate"):
        assert scalars(ea, f"run/{tag}")[0] == pytest.approx(stats[tag], rel=1e-5)
    assert scalars(ea, "run/ttft_ms")[0] == pytest.approx(stats["ttft_s"] * 1000, rel=1e-5)
    by_position = scalars(ea, "position/acceptance")
    assert [by_position[p] for p in range(1, K + 1)] == pytest.approx(stats["acceptance_per_position"], rel=1e-5)
    assert list(run_dir.glob("rank0*.pt.trace.json*")), "log.profile=true wrote no torch.profiler trace"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stats"] == stats
    assert len(summary["rounds"]) == len(summary["rank1_marks"]) == stats["rounds"]
    assert summary["last_marks"] == summary["rank1_marks"]


def test_merged_trace_orders_both_ranks(logged_run):
    out, run_dir, stderr = logged_run
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
    # Both ranks read one clock: the true offset, 0, must lie in the reported interval, and the
    # emulated delay is no part of the uncertainty (it is a known least time on the wire).
    assert abs(clock["clock_offset_ms"]) <= clock["clock_uncertainty_ms"] + 0.05
    assert clock["clock_uncertainty_ms"] < DELAY_MS
    assert "rank 1's clock" in stderr


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
