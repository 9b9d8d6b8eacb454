"""Issue 39 (7): the shapes OpenAI's API promises, from a client's seat (the `openai` client and raw HTTP against the
real server in process, tests.support.serve_harness):

- GET /v1/models/{id} answers the model object /v1/models lists; an unknown id is OpenAI's 404 (model_not_found);
- an unknown route or a wrong method is OpenAI's error object, never FastAPI's {"detail": ...};
- stream_options.include_usage: the usage comes in a last chunk of its own with `choices: []`, `usage: null` before;
- streamed logprobs come in the chunk of the text they belong to (a chunk's text is its tokens' bytes);
- context_length_exceeded names the prompt's field (messages, prompt, input), as OpenAI does.
"""
import json

import openai
import pytest

from tests.support.serve_harness import chat_folder, is_openai_error, served, served_args

MODEL = "tandem/tiny-qwen2"  # serve.model_name: a Hub-style id, its slash sent as %2F by the openai client
MESSAGES = [{"role": "user", "content": "héllo wörld"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The target drafting for itself: every draft accepted, so each round commits several tokens at once."""
    target = chat_folder(tmp_path_factory.mktemp("shapes") / "target", seed=1)
    with served(*served_args(target, target, "spec.k=3", f"serve.model_name={MODEL}")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_model_is_retrieved_by_its_id_and_an_unknown_id_is_a_404(client):
    listed = client.models.list().data
    assert [client.models.retrieve(m.id) for m in listed] == listed and [m.id for m in listed] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert (e.value.type, e.value.param, e.value.code) == ("invalid_request_error", None, "model_not_found")
    assert "gpt-4o" in e.value.message and MODEL in e.value.message


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/nope", 404), ("POST", "/v1/chat/completion", 404), ("GET", "/", 404),
    ("GET", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405), ("POST", f"/v1/models/{MODEL}", 405),
])
def test_unknown_routes_and_wrong_methods_answer_openai_errors(server, method, path, status):
    code, raw = server.request(method, path)
    answer = json.loads(raw)
    assert code == status and is_openai_error(answer), answer
    assert answer["error"]["type"] == "invalid_request_error" and f"{method} {path}" in answer["error"]["message"]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                       ("/v1/completions", {"prompt": "print('ok')"})])
def test_include_usage_comes_in_a_last_chunk_of_its_own(server, path, body):
    body = {**body, "model": MODEL, "max_tokens": 9, "temperature": 0}
    status, whole = server.post(path, body)
    assert status == 200, whole
    conn, events = server.stream(path, {**body, "stream_options": {"include_usage": True}})
    data = list(events)
    conn.close()
    assert data[-1] == "[DONE]"
    *chunks, last = [json.loads(d) for d in data[:-1]]
    assert last["choices"] == [] and last["usage"] == whole["usage"] and last["id"] == chunks[0]["id"]
    assert all(c["choices"] and "usage" in c and c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stop", [None, ["zzzz"]])  # a stop string holds back a tail of the text: still whole tokens
def test_streamed_logprobs_come_with_their_text(client, stop):
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2, stop=stop)
    whole = client.chat.completions.create(**body).choices[0].logprobs.content
    scored = [c.choices[0] for c in client.chat.completions.create(**body, stream=True)
              if c.choices and c.choices[0].logprobs is not None]
    for choice in scored:  # each chunk's text is exactly its tokens' bytes
        assert choice.delta.content, choice
        assert bytes(b for t in choice.logprobs.content for b in t.bytes).decode(errors="replace") == choice.delta.content
    assert [t.token for c in scored for t in c.logprobs.content] == [t.token for t in whole]

    text = dict(model=MODEL, prompt="héllo", max_tokens=16, temperature=0, logprobs=1, stop=stop)
    whole = client.completions.create(**text).choices[0].logprobs.tokens
    scored = [c.choices[0] for c in client.completions.create(**text, stream=True) if c.choices[0].logprobs is not None]
    assert all(c.text for c in scored)
    assert [t for c in scored for t in c.logprobs.tokens] == whole


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "héllo wörld " * 300}]}, "messages"),
    ("/v1/completions", {"prompt": [5] * 600}, "prompt"),
    ("/v1/responses", {"input": "héllo wörld " * 300}, "input"),
])
def test_a_prompt_too_long_names_its_field(server, path, body, param):
    status, answer = server.post(path, {**body, "model": MODEL})
    assert status == 400 and is_openai_error(answer), answer
    assert (answer["error"]["code"], answer["error"]["param"]) == ("context_length_exceeded", param)
