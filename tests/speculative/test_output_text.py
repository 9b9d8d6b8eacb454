"""Output's text is decoded incrementally (speculative.output.Detokenizer): a streamed answer costs text work in
proportion to its length, and after every round the text is exactly tokenizer.decode(all tokens), with characters
split over byte tokens across rounds and stop strings split across rounds found where they are."""
from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from speculative.output import PARTIAL, Output
from tests.support.tiny_models import save_tiny_tokenizer

ANSWER = 4000  # tokens
WORK_PER_TOKEN = 8  # tokens decoded per answer token, at most
WORDS = ["def", "reverse(s):", "return", "s[::-1]", "héllo", "wörld,", "naïve", "café", "print('ok')",
         "x", "=", "42"]
WIDE = ["日", "本", "語", "の", "テ", "キ", "ス", "ト", "é", "ö", "🙂", "🚀", "👍🏽", "∑"]  # 2 to 8 bytes each


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def byte_tokens(tokenizer, text: str) -> list[int]:
    """`text` as one token per UTF-8 byte (the byte-level alphabet): each multi-byte character spans tokens."""
    mapped = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    return [tokenizer.convert_tokens_to_ids(ch) for piece, _ in mapped for ch in piece]


def answer_tokens(tokenizer, n: int, seed: int = 0) -> list[int]:
    """n tokens of mixed text: merged words, characters split over byte tokens, newlines, a skipped special."""
    rng, ids = random.Random(seed), []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.45:
            ids += tokenizer(" " + rng.choice(WORDS))["input_ids"]
        elif kind < 0.85:
            ids += byte_tokens(tokenizer, "".join(rng.choices(WIDE, k=rng.randint(1, 3))))
        elif kind < 0.95:
            ids += tokenizer("日本語のテキスト\n")["input_ids"]
        else:
            ids.append(tokenizer.eos_token_id)  # not an EOS here: decode skips it
    return ids[:n]


def count_decoded(tokenizer, monkeypatch):
    """Wrap every way to turn ids into text: a counter of the tokens passed to them, and decode uncounted."""
    count, depth = [0], [0]

    def uncounted(ids: list[int]) -> str:
        depth[0] += 1
        try:
            return tokenizer.decode(ids, skip_special_tokens=True)
        finally:
            depth[0] -= 1
    for name in ("decode", "batch_decode", "convert_ids_to_tokens", "_decode"):
        method = getattr(tokenizer, name)

        def counted(*args, _method=method, **kwargs):
            ids = args[0] if args else next(iter(kwargs.values()))  # token_ids=, ids=
            if not depth[0]:  # decode calls _decode: counted once
                count[0] += len(ids) if isinstance(ids, list) else 1
            depth[0] += 1
            try:
                return _method(*args, **kwargs)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(tokenizer, name, counted)
    return count, uncounted


def rounds(ids: list[int], seed: int = 1):
    """ids in rounds of 1 to 5 tokens, as the Session commits them."""
    rng, at = random.Random(seed), 0
    while at < len(ids):
        size = rng.randint(1, 5)
        yield ids[at:at + size]
        at += size


def test_a_long_answer_decodes_in_linear_work_exactly_every_round(tokenizer, monkeypatch):
    stop = "本語 END"  # its first character split over two rounds, its last token in a third
    ids = answer_tokens(tokenizer, ANSWER - 5)
    body = tokenizer.decode(ids, skip_special_tokens=True)
    assert "END" not in body and not body.endswith(PARTIAL)
    ids += byte_tokens(tokenizer, "本") + tokenizer("語 END and after")["input_ids"]
    count, decode = count_decoded(tokenizer, monkeypatch)
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=10 * ANSWER, stop=[stop])
    plan = list(rounds(ids[:ANSWER - 4])) + [ids[ANSWER - 4:ANSWER - 2], ids[ANSWER - 2:]]  # 本's bytes split
    midway = 0
    for chunk in plan:
        out.commit(chunk)
        text, whole = out.text(), decode(out.tokens)
        assert text == whole, len(out.tokens)
        midway += text.endswith(PARTIAL)  # a round that ended within a character
        if out.done:
            break
    assert midway > 50  # many rounds ended within a character and the next one finished it
    assert out.stop_reason == "stop_string"
    assert out.text().index(stop) == len(body)  # found where it is ...
    assert stop not in decode(out.tokens[:-1])  # ... on the token that completed it
    assert len(out.tokens) >= ANSWER - 2
    assert count[0] <= WORK_PER_TOKEN * len(out.tokens), count[0]


def test_text_end_is_each_prefix_decoded(tokenizer):
    """What the server's streamed logprobs cut at whole tokens (Running.whole_tokens) uses."""
    ids = answer_tokens(tokenizer, 400, seed=3)
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=1000, stop=[])
    for chunk in rounds(ids, seed=4):
        out.commit(chunk)
    text = out.text()
    assert out.text_end(0) == 0
    for n in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:n], skip_special_tokens=True)
        expected = None if prefix.endswith(PARTIAL) else len(prefix)
        assert out.text_end(n) == expected, n
        if expected is not None:
            assert text[:expected] == prefix


def test_a_sentencepiece_tokenizer_keeps_its_spaces():
    """Metaspace strips the space of the first token it decodes: a token decoded without the one before it
    would lose the space between words."""
    from tokenizers import SentencePieceBPETokenizer
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator([" ".join(WORDS)] * 10, vocab_size=120, special_tokens=["<eos>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=sp._tokenizer, eos_token="<eos>")
    rng, ids = random.Random(5), []
    for _ in range(150):
        ids += tokenizer(" ".join(rng.choices(WORDS[:-3], k=3)))["input_ids"]
        ids += [tokenizer.eos_token_id] * (rng.random() < 0.1)  # skipped by decode
    body = tokenizer.decode(ids, skip_special_tokens=True)
    ids += tokenizer("x = 42 naïve café")["input_ids"]
    out = Output(tokenizer, eos_ids=set(), max_new_tokens=10_000, stop=["x = 42 naïve"])
    for chunk in rounds(ids, seed=6):
        out.commit(chunk)
        assert out.text() == tokenizer.decode(out.tokens, skip_special_tokens=True)
        if out.done:
            break
    assert out.stop_reason == "stop_string" and out.text() == body + " x = 42 naïve"
