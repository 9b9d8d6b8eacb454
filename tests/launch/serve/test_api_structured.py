"""Issue 30: logprobs and structured outputs through the real `openai` client against the real server in process
(tests.support.serve_harness: both ranks, the last one masking and computing the log-probabilities):

- chat logprobs (top_logprobs 3) and completions logprobs (2) equal transformers' log_softmax of the same model
  within 1e-4, streamed and not, and so do a sampled request's (T 0.7, top_p 0.9: raw, not scaled);
- a json_schema answer parses, fits the schema, and is token for token generate's with the same grammar as a
  logits processor (tests.support.grammar_reference); json_object parses as an object;
- a response_format or logprobs the server cannot honour is a 400 naming the field.
"""
import json

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.support.grammar_reference import BOMB, constrained_greedy, late_bomb
from tests.support.serve_harness import CHAT_TEMPLATE, chat_folder, launch_served, served, served_args, wait_healthy
from tests.support.tiny_models import free_port, kill_launch, load_reference, reference_greedy, save_tiny, save_tiny_tokenizer

EOS = 0  # the tiny tokenizer's <eos>
MAX_NEW = 48
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "héllo wörld"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny qwen2 with a tokenizer, a chat template and an end token; its head unscaled (logits within ~10, where
    fp32 rounding moves a log-probability by ~2e-5)."""
    folder = save_tiny(tmp_path_factory.mktemp("structured") / "qwen2", "qwen2", seed=5, eos=EOS, head_scale=1.0)
    save_tiny_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    draft = save_tiny(tmp_path_factory.mktemp("structured-draft") / "qwen2", "qwen2", seed=7, layers=2)
    save_tiny_tokenizer(draft)  # the target's (the drafter must share it)
    with served(*served_args(model, draft, f"gen.max_new_tokens={MAX_NEW}", "spec.k=3")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model):
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    return load_reference(model), tokenizer, list(prompt["input_ids"])


def logprobs_of(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """transformers' forward over prompt + answer: log_softmax at the rows that chose each answer token."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].float(), -1)


def assert_raw_logprobs(answer, reference) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The answer's 12 logprobs and top-3 equal log_softmax of an independent transformers forward at its tokens;
    returns (tokens, every position's reference logprobs, the chosen ones as served, the reference top-3)."""
    model, tokenizer, prompt = reference
    tokens = answer.model_extra["tandem"]["token_ids"]
    content = answer.choices[0].logprobs.content
    assert len(content) == len(tokens) == 12
    ref = logprobs_of(model, prompt, tokens)
    chosen = torch.tensor([c.logprob for c in content])
    torch.testing.assert_close(chosen, ref.gather(-1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-4, rtol=0)
    values, ids = ref.topk(3, -1)
    assert [[t.token for t in c.top_logprobs] for c in content] == [[tokenizer.decode([i]) for i in row] for row in ids.tolist()]
    torch.testing.assert_close(torch.tensor([[t.logprob for t in c.top_logprobs] for c in content]), values, atol=1e-4, rtol=0)
    return tokens, ref, chosen, values


def test_chat_logprobs_equal_transformers(client, reference):
    answer = client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert_raw_logprobs(answer, reference)
    # each token's own bytes (half a character, some of them): together, the answer's text
    assert bytes(b for c in content for b in c.bytes).decode(errors="replace") == answer.choices[0].message.content

    stream = client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, [t.token for t in c.top_logprobs]) for c in streamed] == \
        [(c.token, [t.token for t in c.top_logprobs]) for c in content]
    # the second request reuses the first's cached prompt (other block shapes): fp32 rounding apart, the same
    torch.testing.assert_close(torch.tensor([[c.logprob] + [t.logprob for t in c.top_logprobs] for c in streamed]),
                               torch.tensor([[c.logprob] + [t.logprob for t in c.top_logprobs] for c in content]),
                               atol=1e-5, rtol=0)


def test_completion_logprobs_equal_transformers(client, reference):
    model, tokenizer, _ = reference
    prompt = tokenizer("print('ok')")["input_ids"]
    answer = client.completions.create(model="qwen2", prompt="print('ok')", max_tokens=12, temperature=0, logprobs=2)
    tokens = answer.model_extra["tandem"]["token_ids"]
    lp = answer.choices[0].logprobs
    ref = logprobs_of(model, prompt, tokens)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), ref.gather(-1, torch.tensor(tokens)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    values, ids = ref.topk(2, -1)
    for top, row_ids, row_values in zip(lp.top_logprobs, ids.tolist(), values.tolist()):
        assert top == pytest.approx({tokenizer.decode([i]): v for i, v in zip(row_ids, row_values)}, abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(tokens))]
    assert max(map(len, lp.tokens)) > 1  # (else any offsets counting one a token would pass)


def test_sampled_logprobs_are_the_raw_ones(client, reference):
    """Issue 39 (12): at temperature 0.7 and top_p 0.9 the logprobs are still log_softmax of the target's raw
    logits (as OpenAI's, and vLLM's default raw_logprobs), not of the logits over T or cut to the nucleus."""
    answer = client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=12, temperature=0.7,
                                            top_p=0.9, seed=5, logprobs=True, top_logprobs=3)
    tokens, ref, chosen, values = assert_raw_logprobs(answer, reference)
    assert (chosen < values[:, 0] - 1e-3).any()  # sampled: some token is not the most likely one
    scaled = torch.log_softmax(ref / 0.7, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert (chosen - scaled).abs().max() > 1e-2  # (else the check above could not tell raw from scaled)


def test_json_schema_answers_parse_and_equal_constrained_generate(client, reference):
    model, tokenizer, prompt = reference
    answer = client.chat.completions.create(
        model="qwen2", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA}})
    expected, _ = constrained_greedy(model, tokenizer, prompt, SCHEMA, MAX_NEW, EOS)
    assert answer.model_extra["tandem"]["token_ids"] == expected
    assert answer.choices[0].finish_reason == "stop"  # the grammar ended it, not max_tokens
    parsed = json.loads(answer.choices[0].message.content)
    assert set(parsed) == {"name", "ok"} and isinstance(parsed["name"], str) and len(parsed["name"]) <= 6
    assert type(parsed["ok"]) is bool
    plain = client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0)
    with pytest.raises(ValueError):  # without the grammar the same model writes no JSON
        json.loads(plain.choices[0].message.content)


@pytest.mark.parametrize("seed", [1, 2])
def test_sampled_json_schema_answers_parse_and_fit(client, seed):
    """At T > 0 the last rank samples from the masked target (rejection sampling against the drafter's q)."""
    answer = client.chat.completions.create(
        model="qwen2", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0.9, seed=seed, logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    parsed = json.loads(answer.choices[0].message.content)
    assert set(parsed) == {"name", "ok"} and len(parsed["name"]) <= 6 and type(parsed["ok"]) is bool
    assert len(answer.choices[0].logprobs.content) == len(answer.model_extra["tandem"]["token_ids"])


def test_json_object_answers_parse_as_an_object(client):
    answer = client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=MAX_NEW, temperature=0,
                                            response_format={"type": "json_object"})
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert answer.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=4, **extra)
    assert info.value.body["param"] == param


# ---- issue 39 (2): a schema llguidance gives up on never ends the server ------------------------------------------
def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_schema_that_fails_on_its_first_tokens_is_a_400_naming_response_format(client):
    """{"type": "string", "pattern": "^a{1000000}$"}: llguidance gives up on the answer's first token; the request
    checks try those tokens (speculative.grammar.Grammars.check), so it never reaches the last rank."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=4, response_format=json_schema(BOMB))
    assert info.value.body["param"] == "response_format"
    message = info.value.body["message"]  # refused up front, before the answer began (not: "failed while ...")
    assert "fails on its first tokens" in message and "too many expressions constructed" in message
    assert "simplify the schema" in message


def events(server, body: dict):
    conn, data = server.stream("/v1/chat/completions", {"model": "qwen2", "messages": MESSAGES, **body})
    return conn, (json.loads(d) for d in data if d != "[DONE]")


def test_a_schema_that_fails_while_verifying_ends_its_own_request_alone(server, client, model, monkeypatch):
    """A grammar failure the request checks did not foresee (here: the check patched out, so late_bomb reaches the
    last rank and fails there once its answer gets to the pattern): that stream ends with an error event naming
    response_format; a stream served at the same time gets its whole answer (transformers' generate); with the
    checks back, the same schema is a 400 up front, and the server goes on serving."""
    from speculative.grammar import Grammars
    with monkeypatch.context() as patched:
        patched.setattr(Grammars, "check", lambda *_: None)
        failing = events(server, {"max_tokens": MAX_NEW, "temperature": 0, "response_format": json_schema(late_bomb())})
        plain = events(server, {"max_tokens": 24, "temperature": 0})
        *_, error = failing[1]
        *_, last = plain[1]
    assert error["error"]["param"] == "response_format"
    assert "failed while the answer was written" in error["error"]["message"]
    assert "too many expressions constructed" in error["error"]["message"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert last["tandem"]["token_ids"] == reference_greedy(model, list(prompt["input_ids"]), 24, eos=EOS)
    for conn, _ in (failing, plain):
        conn.close()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=MAX_NEW,
                                       response_format=json_schema(late_bomb()))
    assert info.value.body["param"] == "response_format" and "pattern" in info.value.body["message"]
    assert server.health()["status"] == "ok"
    assert client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=4).choices[0].finish_reason == "length"


@pytest.mark.slow  # a torchrun launch (~1 min)
def test_a_launched_server_answers_after_schemas_llguidance_gives_up_on(tmp_path):
    """The same through torchrun (issue 39: the last rank died and torchrun exited): both schemas are 400s (the
    request checks find the pattern at the top and deep in the schema), and the next request is answered."""
    target, draft = chat_folder(tmp_path / "target", seed=1), chat_folder(tmp_path / "draft", seed=7, layers=2)
    port = free_port()
    proc = launch_served(target, draft, port, 2)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        launched = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        for schema in (BOMB, late_bomb()):
            with pytest.raises(openai.BadRequestError) as info:
                launched.chat.completions.create(model="target", messages=MESSAGES, max_tokens=MAX_NEW,
                                                 response_format=json_schema(schema))
            assert info.value.body["param"] == "response_format"
            assert "too many expressions constructed" in info.value.body["message"]
        answer = launched.chat.completions.create(model="target", messages=MESSAGES, max_tokens=8)
        assert answer.usage.completion_tokens == 8 and proc.poll() is None
    finally:
        kill_launch(proc)
