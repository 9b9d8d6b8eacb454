"""Issue 39 (items 4, 5, 8): the one-shot prompt is checked before anything loads, as one line naming the key
and the fix: text that is not UTF-8 (bytes the command line could not decode), an empty prompt (an unset
variable, an empty pipe) unless allow_empty_prompt=true, keys of which the run would use one and drop the other
(prompt= with serve.port, text with ids, system= with ids or chat=false), and a chat template that refuses the
system role (rank 0, from the tokenizer, before the ranks meet). In process: the config is pure, the ranks are
threads."""
from __future__ import annotations

import io
import sys
import time

import pytest

import train_free_infer
from launch import config
from launch import ranks as lives
from launch.config import ConfigError, config_from_argv, load_config
from tests.support.one_line import assert_one_line_error
from tests.support.tiny_models import run_entry_pair, run_pair, save_tiny, save_tiny_tokenizer

CHAT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def refused(*argv: str) -> ConfigError:
    """The one line a command line is refused with, at parse: before anything loads or is timed."""
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        config_from_argv(list(argv))
    assert time.monotonic() - started < 1
    return e.value


# --- item 4: text that is not UTF-8 -----------------------------------------------------------------

# what `prompt=$'abc \xff\xfe def'` is in sys.argv: Python decodes the command line with surrogateescape
NOT_UTF8 = "abc \udcff\udcfe def"


@pytest.mark.parametrize("argv, needles", [
    ([f"prompt={NOT_UTF8}"], ["prompt= is not UTF-8 text (byte 4 is 0xff)", "iconv", "prompt_ids=[...]"]),
    (["prompt=héllo \udcc3"], ["prompt= is not UTF-8 text (byte 7 is 0xc3)"]),  # the byte's place, not the character's
    (["prompt=hi", f"system={NOT_UTF8}"], ["system= is not UTF-8 text (byte 4 is 0xff)", "leave it out"]),
])
def test_text_that_is_not_utf8_is_one_line_at_parse(argv, needles):
    assert_one_line_error(refused(*argv), ConfigError, *needles)


def test_the_tokenizer_would_raise_a_traceback_on_it(tmp_path):
    """Why the check is at parse: what the tokenizer does with such text (a TypeError, after the weights load)."""
    save_tiny_tokenizer(tmp_path)
    from transformers import AutoTokenizer
    with pytest.raises(TypeError):
        AutoTokenizer.from_pretrained(tmp_path)(NOT_UTF8)


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "run.yaml").write_bytes(b'prompt: "abc \xff def"\n')
    assert_one_line_error(refused(f"config={tmp_path / 'run.yaml'}"), ConfigError,
                          "run.yaml is not UTF-8 text (byte 13 is 0xff)", "save it as UTF-8")


# --- item 8: empty prompts and keys that conflict ---------------------------------------------------

@pytest.mark.parametrize("argv, needle", [
    (["prompt="], "prompt= is empty: there is nothing to answer"),
    (["prompt= \n\t"], "prompt= is all whitespace"),
    (["prompt_file={empty}"], "prompt_file={empty} is empty"),
    (["prompt=hi", "system="], "system= is empty"),
    (["prompt=hi", "system_file={empty}"], "system_file={empty} is empty"),
])
def test_an_empty_prompt_is_one_line_unless_allowed(tmp_path, argv, needle):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = [a.format(empty=empty) for a in argv]
    assert_one_line_error(refused(*argv), ConfigError, needle.format(empty=empty), "allow_empty_prompt=true")
    cfg = config_from_argv([*argv, "allow_empty_prompt=true"])
    assert not cfg.prompt.strip() or not cfg.system.strip()


def test_empty_token_ids_are_one_line():
    assert_one_line_error(refused("prompt_ids=[]"), ConfigError, "prompt_ids=[] holds no token id")


@pytest.mark.parametrize("argv, needles", [
    (["prompt=hi", "serve.port=8000"], ["serve.port=8000", "prompt=...", "give one or the other"]),
    (["prompt_file={text}", "serve.port=0"], ["serve.port=0", "prompt_file={text}"]),
    (["prompt_ids=[1]", "serve.port=0"], ["serve.port=0", "prompt_ids=[...]"]),
    (["system=be brief", "serve.port=0"], ["serve.port=0", "system=..."]),
    (["output.json=out.json", "serve.port=0"], ["serve.port=0", "output.json=out.json"]),
    (["prompt=hi", "prompt_ids=[1]"], ["give prompt=... (text) or prompt_ids=[...] (token ids), not both"]),
    (["prompt_file={text}", "prompt_ids=[1]"], ["prompt_file={text} (text) or prompt_ids=[...]"]),
    (["prompt_ids=[1]", "system=be brief"], ["without the chat template, so system=... would be dropped"]),
    (["prompt=hi", "system=be brief", "chat=false"], ["system=...", "chat=false leaves the template out"]),
    (["prompt=hi", "prompt_file={text}"], ["give prompt=... or prompt_file=PATH, not both"]),
])
def test_keys_of_which_the_run_would_drop_one_are_one_line(tmp_path, argv, needles):
    text = tmp_path / "p.txt"
    text.write_text("hi")
    argv = [a.format(text=text) for a in argv]
    assert_one_line_error(refused(*argv), ConfigError, *(n.format(text=text) for n in needles))


@pytest.fixture
def reports(monkeypatch):
    """The one-line reports the entry made, as (rank, line)."""
    made, real = [], train_free_infer.report

    def recording(message, rank=None, echo=True):
        made.append((rank, message))
        return real(message, rank, echo)
    monkeypatch.setattr(train_free_infer, "report", recording)
    return made


def test_an_empty_stdin_on_rank_0_reaches_every_rank_at_once(monkeypatch, reports, tiny_qwen):
    """`git diff | ... prompt_file=-` with nothing to diff: stdin is rank 0's alone, so rank 0 refuses it and tells
    the rank that parsed the command line without it (rather than leave it waiting to meet rank 0)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    monkeypatch.setattr(config, "reads_stdin", lambda: train_free_infer.torchrun_rank()[0] == 0)  # each thread its rank
    started = time.monotonic()
    outcome = run_entry_pair(monkeypatch, f"model.target={tiny_qwen}", "model.dtype=float32", "model.split=2",
                             "draft.kind=none", "prompt_file=-", timeout_s=20)
    assert outcome == {0: 1, 1: 1} and time.monotonic() - started < 10
    assert sorted(rank for rank, _ in reports) == [0, 1], reports
    assert all("prompt_file=- (stdin) is empty" in line for _, line in reports), reports


# --- item 5: the chat template refuses what it is given ---------------------------------------------

@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """Two tiny chat models: one whose template takes a system message, one that refuses it (as Gemma's does)."""
    from transformers import AutoTokenizer
    folders = {}
    for name, template in (("chat", CHAT), ("no-system", NO_SYSTEM)):
        folder = save_tiny(tmp_path_factory.mktemp(name) / "model", "qwen2", seed=3)
        save_tiny_tokenizer(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        tok.chat_template = template
        tok.save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.fixture
def loads(monkeypatch):
    """The ranks whose stage build_stage was asked for."""
    ranks, real = [], lives.build_stage
    monkeypatch.setattr(lives, "build_stage", lambda plan: ranks.append(plan.rank) or real(plan))
    return ranks


def one_answer(folder, *extra):
    return run_pair(f"model.target={folder}", "model.dtype=float32", "model.split=2", "draft.kind=none", "chat=true",
                    "gen.max_new_tokens=2", *extra, timeout_s=20)


def test_a_template_that_refuses_the_system_role_is_one_line_before_any_rank_loads(templated, loads):
    with pytest.raises(ConfigError) as e:
        one_answer(templated["no-system"], "prompt=hi", "system=be brief")
    assert_one_line_error(e.value, ConfigError, "the chat template refused", "System role not supported",
                          "leave system= out")
    assert loads == []  # rank 0 read the prompt before the ranks met: the other rank heard it there


def test_system_for_a_model_without_a_template_is_one_line(tiny_qwen, loads, tmp_path):
    folder = save_tiny(tmp_path / "model", "qwen2", seed=1)
    save_tiny_tokenizer(folder)  # a tokenizer, no chat template
    with pytest.raises(ConfigError) as e:
        one_answer(folder, "prompt=hi", "system=be brief")
    assert_one_line_error(e.value, ConfigError, "system= goes in through the chat template", "has none")
    assert loads == []


def test_allow_empty_prompt_sends_the_empty_messages_as_given(templated, monkeypatch):
    """The opt-in: an empty user message (and an empty system message, not dropped) through the template."""
    from transformers import AutoTokenizer
    seen = []
    monkeypatch.setattr(lives, "prompt_ids", lambda *a, real=lives.prompt_ids: seen.append(real(*a)) or seen[-1])
    out = one_answer(templated["chat"], "prompt=", "system=", "allow_empty_prompt=true")
    tok = AutoTokenizer.from_pretrained(templated["chat"])
    expected = tok.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": ""}],
                                       add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert seen == [list(expected)] and len(out["token_ids"]) == 2


def test_the_server_and_the_entry_read_a_refusing_template_alike(templated):
    """One logic (launch.serve.prompts.template_ids) for both: the server's 400 and the entry's line name the same cause."""
    from transformers import AutoTokenizer
    from launch.serve.errors import ApiError
    from launch.serve.prompts import template_ids
    from launch.build import chat_ids
    tok = AutoTokenizer.from_pretrained(templated["no-system"])
    with pytest.raises(ApiError) as api:
        template_ids(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError) as entry:
        chat_ids(load_config(["prompt=hi", "system=be brief"]), tok)
    assert api.value.status == 400 and api.value.message in str(entry.value)
