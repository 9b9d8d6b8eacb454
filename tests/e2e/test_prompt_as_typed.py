"""Issue 34: the main job as a command-line tool. Text a person writes (prompt=, system=, secrets) reaches
the model as typed, never through YAML; long prompts come from a file (or stdin on rank 0); token ids from
JSON (no alias limit); a reader that closes stdout (`| head`) is a normal end; every numeric key is bounded
before anything loads (issue 25)."""
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import train_free_infer
from launch.config import ConfigError, config_from_argv
from launch.torchrun.relay_rendezvous import launcher_exit_status
from tests.support.tiny_models import REPO, free_port, kill_launch, reference_greedy, run_entry_pair, save_tiny, save_tiny_tokenizer

# each of these, from the command line, came to the model as something else (or failed) through omegaconf
PROMPTS = ["Explain this Python error: KeyError: 'name'", "a: b", "{a: 1}", "[1, 2]", "- item", "yes", "no", "on", "off",
           "null", "~", "3.0", "Use ${HOME} here", "He said \"hi\" and 'bye' # not a comment", "#", "line one\nkey: two\n",
           "héllo wörld, naïve café 日本語 ✓", " padded ", "=", "x=y"]


@pytest.mark.parametrize("text", PROMPTS, ids=range(len(PROMPTS)))
def test_free_text_keys_are_taken_as_typed(text):
    cfg = config_from_argv([f"prompt={text}", f"system={text}", f"serve.api_key={text}", "model.max_len=64",
                            "gen.max_new_tokens=8"])
    assert (cfg.prompt, cfg.system, cfg.serve.api_key) == (text, text, text)


def test_structured_keys_keep_yaml_and_name_the_key():
    cfg = config_from_argv(["prompt=x", "gen.stop=[\"a: b\", '#']", "spec.overlap=no", "model.split=[10,19]"])
    assert cfg.gen.stop == ["a: b", "#"] and cfg.spec.overlap is False and cfg.model.split == [10, 19]
    with pytest.raises(ConfigError, match=r"^model\.split='\[1,' is not a value YAML can read") as e:
        config_from_argv(["prompt=x", "model.split=[1,"])
    assert "\n" not in str(e.value)


def test_prompt_file_of_100_kb_reaches_the_config_byte_identical(tmp_path):
    text = ("".join(PROMPTS) + "\r\n\t\u2028") * 1 + "ß" * 50_000  # > 100 KB of UTF-8, a trailing newline kept
    path = tmp_path / "prompt.txt"
    path.write_bytes(text.encode() + b"\n")
    (tmp_path / "system.txt").write_text("Answer: briefly\n", encoding="utf-8")
    cfg = config_from_argv([f"prompt_file={path}", f"system_file={tmp_path / 'system.txt'}"])
    assert len(path.read_bytes()) > 100_000 and cfg.prompt == text + "\n" and cfg.system == "Answer: briefly\n"


def test_prompt_from_stdin_is_read_by_rank_0_only(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("a: b\n# c".encode())))
    monkeypatch.setenv("RANK", "1")
    assert config_from_argv(["prompt_file=-"]).prompt == ""  # never tokenized there; stdin left to rank 0
    monkeypatch.setenv("RANK", "0")
    assert config_from_argv(["prompt_file=-"]).prompt == "a: b\n# c"


@pytest.mark.parametrize("argv, needle", [
    (["prompt_file=/nonexistent/p.txt"], "prompt_file=/nonexistent/p.txt: cannot read it (No such file or directory)"),
    (["prompt_file={bad}"], "not UTF-8 text (byte 1 is 0xff)"),
    (["prompt=x", "prompt_file={good}"], "give prompt=... or prompt_file=PATH, not both"),
    (["prompt_ids=[1, 2.5]"], "prompt_ids: expected a JSON list of token ids"),
    (["prompt_ids=[true]"], "prompt_ids: expected a JSON list of token ids"),
    (["prompt_ids_file={good}"], "prompt_ids_file="),
    (["prompt=x", "model.max_memory=1e400"], "model.max_memory=inf is not a size between 1 byte and 1 PiB"),
    (["prompt=x", "model.max_len=-5"], "model.max_len=-5 must be between 1 and"),
    (["prompt=x", "draft.max_len=0"], "draft.max_len=0 must be between 1 and"),
    (["prompt=x", "spec.k=10000"], "spec.k=10000 must be between 0 and 1024"),
    (["prompt=x", "spec.k=1000", "model.max_len=1024"], "exceed model.max_len=1024"),
    (["prompt=x", "transport.timeout_s=nan"], "transport.timeout_s=nan must be between"),
    (["prompt=x", "transport.emulate_delay_ms=inf"], "transport.emulate_delay_ms=inf must be between"),
    (["prompt=x", "draft.top_k=0"], "draft.top_k=0 must be between"),
    (["prompt=x", "draft.ngram_min=4"], "draft.ngram_min=4 must be <= draft.ngram_max=3"),
    (["prompt=x", "model.prefill_chunk=0"], "model.prefill_chunk=0 must be between"),
])
def test_bad_values_are_one_line_naming_the_key(tmp_path, argv, needle):
    (tmp_path / "bad.txt").write_bytes(b"a\xff")
    (tmp_path / "good.txt").write_text("not ids")
    argv = [a.format(bad=tmp_path / "bad.txt", good=tmp_path / "good.txt") for a in argv]
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        config_from_argv(argv)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert time.monotonic() - started < 1  # before anything is loaded or timed


def test_ten_thousand_prompt_ids_from_the_command_line_and_a_file(tmp_path):
    ids = [i % 100 for i in range(10_518)]  # YAML's alias limit refused this many (node expansion exceeds 10000)
    assert config_from_argv([f"prompt_ids={json.dumps(ids)}"]).prompt_ids == ids
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    assert config_from_argv([f"prompt_ids_file={tmp_path / 'ids.json'}"]).prompt_ids == ids


class RecordingTokenizer:
    """The real tokenizer; what the entry hands it to encode is kept."""
    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, text, *args, **kwargs):
        self.seen.append(text)
        return self.inner(text, *args, **kwargs)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def talking_model(tmp_path_factory):
    folder = save_tiny(tmp_path_factory.mktemp("typed") / "model", "qwen2", seed=3)
    save_tiny_tokenizer(folder)
    return folder


@pytest.mark.parametrize("given", [*PROMPTS, "file"], ids=[*map(str, range(len(PROMPTS))), "file"])
def test_every_prompt_reaches_the_tokenizer_through_the_entry(monkeypatch, tmp_path, talking_model, given):
    """main(argv) on both ranks: each prompt above as typed, and all of them (100 KB) from a file."""
    seen = []
    from launch import ranks as lives
    monkeypatch.setattr(lives, "load_tokenizer",
                        lambda folder, real=lives.load_tokenizer: seen.append(RecordingTokenizer(real(folder))) or seen[-1])
    text, arg = given, f"prompt={given}"
    if given == "file":
        text = "\n".join(PROMPTS) * 500  # 100 KB, tokenized, then refused for room (the check after the tokenizer)
        (tmp_path / "p.txt").write_text(text, encoding="utf-8")
        arg = f"prompt_file={tmp_path / 'p.txt'}"
    outcome = run_entry_pair(monkeypatch, arg, f"model.target={talking_model}", "model.dtype=float32",
                             "model.max_len=1024", "draft.kind=ngram", "gen.max_new_tokens=1")
    assert len(text.encode()) > 100_000 if given == "file" else outcome == {0: None, 1: None}
    assert seen[-1].seen == [text]


@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_closed_stdout_and_every_prompt_through_torchrun(tmp_path, talking_model):
    """One launch: the prompts above as typed on the command line reach the model (its greedy answer is the one
    for their tokens), and a reader that stops after a few bytes (`| head -c 8`) ends the run: no traceback from
    any process, output.json written with what was generated, torchrun's exit 141 (a filter's closed pipe)."""
    from transformers import AutoTokenizer
    text = "\n".join(PROMPTS)
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), f"model.target={talking_model}",
           "model.dtype=float32", "model.max_len=1024", "draft.kind=ngram", "chat=false", f"prompt={text}",
           "gen.max_new_tokens=700", "transport.emulate_delay_ms=5", f"output.json={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false"))
    try:
        assert len(proc.stdout.read(8)) == 8
        proc.stdout.close()  # the reader leaves
        stderr = proc.stderr.read().decode()
        proc.wait(60)
    finally:
        kill_launch(proc)
    assert proc.returncode == 141 and "Traceback" not in stderr and "tandem[rank" not in stderr and "exitcode" not in stderr, stderr[-3000:]
    kept = json.loads(out.read_text())
    ids = AutoTokenizer.from_pretrained(talking_model)(text)["input_ids"]
    assert 0 < len(kept["token_ids"]) < 700 and kept["stats"]["stop_reason"] == "stdout_closed", kept.get("stats")
    assert kept["token_ids"] == reference_greedy(talking_model, ids, len(kept["token_ids"]))


def test_the_launcher_ends_quietly_on_a_signal_and_on_a_closed_pipe_only():
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    assert launcher_exit_status(SignalException("x", signal.SIGINT)) == 130
    assert launcher_exit_status(SignalException("x", signal.SIGTERM)) == 143

    def failed(*codes):
        return ChildFailedError("train_free_infer.py", {r: ProcessFailure(r, r, c, "") for r, c in enumerate(codes)})
    assert launcher_exit_status(failed(141)) == 141
    assert launcher_exit_status(failed(141, 1)) is None and launcher_exit_status(failed(1)) is None
    assert launcher_exit_status(ValueError()) is None


def test_each_status_line_reaches_stderr_in_one_write(monkeypatch):
    """The ranks share stderr: a line written in two parts (print() writes the newline apart) could have another
    rank's line between them ("[model.target: ...][draft.model: ...]")."""
    from launch.distributed import report
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass
    monkeypatch.setattr(sys, "stderr", Recorder())
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    from launch.ranks import announce, status
    announce(["model.target: x", "draft.model: y"])
    status("[prefill: 3 prompt tokens]")
    report("stopped by SIGINT", 1)
    assert writes == ["[model.target: x]\n", "[draft.model: y]\n", "[prefill: 3 prompt tokens]\n",
                      "tandem[rank 1]: stopped by SIGINT\n"]
