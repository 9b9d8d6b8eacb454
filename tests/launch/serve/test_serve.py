"""Issue: serve.port — one launch, many requests, through the real `openai` package against a server
launched under torchrun (tiny fp32 models with a tokenizer and a chat template). Every answer's tokens
equal single-process transformers generate on the same (whole-conversation) prompt."""
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from transformers import AutoTokenizer

from tests.support.serve_harness import EIGHT_PROMPTS, MAX_LEN, launch_served, post_together, serve_args, wait_healthy
from tests.support.tiny_models import free_port, kill_launch, reference_greedy


@pytest.fixture(scope="module")
def server(models):
    target, draft = models
    port = free_port()
    proc = launch_served(target, draft, port, 2, "serve.max_concurrent=8")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield {"url": url, "proc": proc, "target": target}
    finally:
        kill_launch(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(models):
    return AutoTokenizer.from_pretrained(models[0])


def chat_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def health(server) -> dict:
    with urllib.request.urlopen(f"{server['url']}/health", timeout=5) as r:
        return json.load(r)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["target"]
    assert health(server)["status"] == "ok"


def test_chat_non_streamed_equals_generate(client, server, tokenizer):
    messages = [{"role": "user", "content": "def reverse(s):"}]
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=12)
    expected = reference_greedy(server["target"], chat_ids(tokenizer, messages), 12)
    assert r.tandem["token_ids"] == expected
    assert r.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(chat_ids(tokenizer, messages))


def test_chat_streamed_equals_non_streamed(client):
    messages = [{"role": "user", "content": "print('ok')"}]
    whole = client.chat.completions.create(model="target", messages=messages, max_tokens=20)
    chunks = list(client.chat.completions.create(model="target", messages=messages, max_tokens=20, stream=True))
    assert len(chunks) > 2  # several events: the text arrives as rounds commit, not at the end
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20


def test_completions_streamed_and_not_equal_generate(client, server, tokenizer):
    prompt = "héllo wörld"
    expected = reference_greedy(server["target"], tokenizer(prompt)["input_ids"], 10)
    r = client.completions.create(model="target", prompt=prompt, max_tokens=10)
    assert r.tandem["token_ids"] == expected and r.choices[0].finish_reason == "length"
    streamed = list(client.completions.create(model="target", prompt=prompt, max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].tandem["token_ids"] == expected


def test_three_turn_conversation_reuses_the_prefix_and_equals_generate(client, server, tokenizer):
    messages, previous_prompt = [], None
    for turn, question in enumerate(["def reverse(s):", "naïve café", "日本語のテキスト"]):
        messages.append({"role": "user", "content": question})
        ids = chat_ids(tokenizer, messages)
        r = client.chat.completions.create(model="target", messages=messages, max_tokens=8)
        assert r.tandem["token_ids"] == reference_greedy(server["target"], ids, 8), f"turn {turn + 1}"
        reused, prefilled = r.tandem["prompt_tokens_reused"], r.tandem["prefilled_tokens"]
        assert reused + prefilled == len(ids) == r.usage.prompt_tokens
        if previous_prompt is not None:
            # the last turn's prompt (and its answer, as far as it re-tokenizes the same) is not prefilled again
            assert ids[:len(previous_prompt)] == previous_prompt and reused >= len(previous_prompt)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        previous_prompt = ids


def test_eight_concurrent_clients_each_equal_generate_of_their_own_prompt(server):
    """Issue 28 over gloo: 8 requests at once through the torchrun launch, each in its own slot, each answer
    token-identical to transformers generate of its own prompt."""
    assert health(server)["slots"] == 8
    answers, most_live = post_together(server["url"], [{"prompt": ids, "max_tokens": n} for ids, n in EIGHT_PROMPTS])
    for (ids, n), (status, answer) in zip(EIGHT_PROMPTS, answers):
        assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(server["target"], ids, n), ids
    assert 2 <= most_live <= 8  # served together, never more than the slots


def test_seeded_sampling_travels_with_the_request(client):
    messages = [{"role": "user", "content": "print('ok')"}]

    def sample(seed, temperature=1.5):
        r = client.chat.completions.create(model="target", messages=messages, max_tokens=16, temperature=temperature,
                                           top_p=0.95, seed=seed)
        return r.tandem["token_ids"]
    greedy = client.chat.completions.create(model="target", messages=messages, max_tokens=16).tandem["token_ids"]
    first = sample(3)
    assert sample(3) == first  # the same seed again, now over a reused prefix: the same answer
    assert sample(4) != first and first != greedy
    assert client.chat.completions.create(model="target", messages=messages, max_tokens=16).tandem["token_ids"] == greedy


def test_stop_string_is_cut_and_reported(client, tokenizer):
    messages = [{"role": "user", "content": "def reverse(s):"}]
    full = client.chat.completions.create(model="target", messages=messages, max_tokens=16).choices[0].message.content
    stop = full[5:7]
    assert stop and stop not in full[:5]
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=16, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[:full.index(stop)]
    streamed = client.chat.completions.create(model="target", messages=messages, max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[:full.index(stop)]


def test_disconnect_mid_stream_cancels_and_the_next_request_is_right(client, server, tokenizer):
    before = health(server)
    stream = client.completions.create(model="target", prompt="print('ok')", max_tokens=MAX_LEN - 64, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while health(server)["served"] == before["served"] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = health(server)
    assert after["served"] == before["served"] + 1 and after["cancelled"] == before["cancelled"] + 1
    messages = [{"role": "user", "content": "naïve"}]
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=10)
    assert r.tandem["token_ids"] == reference_greedy(server["target"], chat_ids(tokenizer, messages), 10)


def post(server, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server['url']}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    ("/v1/completions", json.dumps({"prompt": "x" * 3000}).encode(), 400, "prompt"),  # context_length_exceeded
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 100000}', 400, "max_tokens"),  # > gen.max_new_tokens
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, "tools"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(path, body, status, param, server, client):
    code, answer = post(server, path, body)
    assert code == status
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert answer["error"]["param"] == param
    assert health(server)["status"] == "ok"
    assert client.completions.create(model="target", prompt="ok", max_tokens=3).usage.completion_tokens == 3


def test_openai_client_raises_its_own_error_types(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="model.max_len"):
        client.completions.create(model="target", prompt=[5] * (MAX_LEN - 10), max_tokens=16)


def test_sigterm_mid_stream_ends_the_stream_and_both_ranks_with_the_cause(server):
    """Last in this file: SIGTERM to the whole process group (as `kill -TERM -PGID` or a terminal's Ctrl-C,
    SIGINT, would) while a stream is in flight: the stream ends with an error event and [DONE], each rank
    prints one line naming the signal, no traceback from either, nor from torchrun, signalled too: it ends 143
    (128 + SIGTERM), quietly (issue 34: Tandem's torchrun.handlers entry point runs in its process)."""
    proc = server["proc"]
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = iter(client.completions.create(model="target", prompt="print('ok')", max_tokens=MAX_LEN - 64, stream=True))
    next(stream)
    os.killpg(proc.pid, signal.SIGTERM)
    with pytest.raises(openai.APIError, match="stopped by SIGTERM"):
        for _ in stream:
            pass
    _, stderr = proc.communicate(timeout=30)
    assert "tandem[rank 0]: stopped by SIGTERM" in stderr and "tandem[rank 1]: stopped by SIGTERM" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-3000:]
    assert stderr.count("tandem[rank") == 2, stderr[-3000:]
    assert proc.returncode == 128 + signal.SIGTERM


def test_losing_rank1_fails_the_request_in_flight_and_stops_the_server(models):
    """In process (two threads over local_pair): rank 1 vanishes mid-stream; the client gets an error
    naming the cause, and rank 0's serve() raises the PeerError the entry turns into one line."""
    import train_free_infer as entry
    from launch import ranks as lives
    from launch.config import load_config
    from netbridge.channel import PeerError, local_pair

    port = free_port()
    cfg = load_config(serve_args(*models, port) + ["output.stream=false", "transport.timeout_s=20"])
    ch0, ch1 = local_pair(20)
    outcome = {}

    def run(rank):
        try:
            (entry.rank_zero if rank == 0 else lives.last_rank)(cfg, (ch0, ch1)[rank])
        except BaseException as e:  # noqa: BLE001 - examined below
            outcome[rank] = e
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    wait_healthy(f"http://127.0.0.1:{port}", None, 60)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="target", prompt="print('ok')", max_tokens=MAX_LEN - 64, stream=True)
    next(iter(stream))
    ch1.close()  # rank 1's end goes away: rank 0's next receive fails
    ch1.inbox.put(None)  # and rank 1's own thread ends
    with pytest.raises(openai.APIError, match="lost the other rank"):
        for _ in stream:
            pass
    threads[0].join(30)
    assert not threads[0].is_alive()
    assert isinstance(outcome.get(0), PeerError) and "lost the other rank" in str(outcome[0])
