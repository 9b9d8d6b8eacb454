"""Rank 0's output: stop strings across token boundaries, and streaming that never prints half a
multi-byte character (a real byte-level BPE tokenizer, trained offline)."""
import pytest
from transformers import AutoTokenizer

from speculative.output import Output
from tests.tiny_models import save_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_stop_string_across_tokens_keeps_the_completing_token(tokenizer):
    text = "print('ok')\n\ndef reverse(s): return s"
    ids = tokenizer(text)["input_ids"]
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=100, stop=["\n\n"], stream=False)
    out.commit(ids[:3])
    kept = out.commit(ids[3:])
    assert out.done and out.stop_reason == "stop_string"
    assert out.text().endswith("\n\n") and out.text().count("\n\n") == 1
    assert 3 + kept < len(ids)  # the rest of the round was dropped
    assert "\n\n" not in tokenizer.decode(out.tokens[:-1])  # the last kept token completed it


def test_eos_and_max_new_tokens_cut_a_round(tokenizer):
    ids = tokenizer("héllo wörld, naïve café")["input_ids"]
    out = Output(tokenizer, eos_ids={ids[4]}, max_new_tokens=100, stop=[], stream=False)
    assert out.commit(ids) == 5 and out.stop_reason == "eos"
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=3, stop=[], stream=False)
    assert out.commit(ids) == 3 and out.stop_reason == "max_new_tokens" and len(out.tokens) == 3


def test_streaming_never_prints_half_a_character(tokenizer, capsys):
    text = "日本語のテキスト héllo"
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(text)]
    # split multi-byte characters across tokens: re-tokenize byte by byte with the byte-level alphabet
    byte_ids = [i for piece in (tokenizer.tokenize(ch) for ch in text) for i in tokenizer.convert_tokens_to_ids(piece)]
    assert tokenizer.decode(byte_ids) == text and tokenizer.decode(ids) == text
    # some character really spans tokens: a naive streamer would print a replacement character
    assert any(tokenizer.decode(byte_ids[:n]).endswith("\ufffd") for n in range(1, len(byte_ids)))
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=1000, stop=[], stream=True)
    chunks = []
    for token in byte_ids:
        out.commit([token])
        chunks.append(capsys.readouterr().out)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
