"""Issue 16: no request can crash the server. Every field is checked before it reaches the engine (a 4xx
in OpenAI's error JSON otherwise), big bodies are refused before they are read, parsing and tokenizing
never hold up /health, and a fuzz of random JSON and random field values leaves the server serving.
In process (tests.support.serve_harness): the real entry's rank 0 and rank 1 as threads, real HTTP on loopback."""
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.support.serve_harness import SERVED_MAX_NEW, is_openai_error, served, served_args
from tests.support.tiny_models import reference_greedy

MAX_NEW = SERVED_MAX_NEW  # the server's gen.max_new_tokens
STATUSES = {200, 400, 404, 413}


@pytest.fixture(scope="module")
def server(models):
    with served(*served_args(*models)) as s:
        yield s
    assert s.outcome == {0: None, 1: None}  # both ranks ended cleanly when the server was stopped


def still_serving(server, target) -> None:
    assert server.health()["status"] == "ok"
    status, answer = server.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4})
    assert status == 200 and answer["tandem"]["token_ids"] == reference_greedy(target, [5, 6, 7], 4)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field,value", [
    ("seed", 10**30),  # the crash: both ranks died in manual_seed
    ("seed", 2**63), ("seed", -2**63 - 1), ("seed", 1.5), ("seed", "7"),
    ("temperature", "NaN"), ("temperature", "Infinity"), ("temperature", "-Infinity"), ("temperature", -0.5),
    ("temperature", 1e300), ("temperature", 10**400), ("temperature", True),
    ("top_p", "NaN"), ("top_p", 0), ("top_p", 1.5), ("top_p", [0.5]),
    ("max_tokens", "1e400"), ("max_tokens", "NaN"), ("max_tokens", 0), ("max_tokens", MAX_NEW + 1), ("max_tokens", 10**30),
    ("max_completion_tokens", MAX_NEW + 1), ("max_tokens", 2.5), ("max_tokens", "8"),
    ("n", "1e400"), ("n", "NaN"), ("best_of", 10**30), ("stream", "yes"), ("stream", 1),
    ("stop", [""]), ("stop", {"a": 1}), ("stop", ["a", "b", "c", "d", "e"]),
])
def test_every_field_is_checked_before_the_engine(field, value, server, models):
    """`value` as a string is spliced in raw (NaN, Infinity and 1e400 are what Python's JSON parser takes)."""
    literal = value if isinstance(value, str) and value[0] in "N-I1" else json.dumps(value)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
        raw = json.dumps(body)[:-1] + f', "temperature": 1.0, "{field}": {literal}}}' if field != "temperature" \
            else json.dumps(body)[:-1] + f', "{field}": {literal}}}'
        status, answer = server.post(path, raw.encode())
        assert status == 400, (path, raw, answer)
        assert is_openai_error(answer) and answer["error"]["param"] == field, answer
    still_serving(server, models[0])


NUMERIC_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "n", "best_of", "logprobs"]
HOSTILE_NUMBERS = ["-1", "-0.5", "0", "5e-324", "1e300", "1" + "0" * 30, "-1" + "0" * 30, "NaN", "Infinity", "-Infinity",
                   "1e400", "-1e400"]  # spliced in raw: NaN, Infinity and 1e400 are what Python's JSON parser takes
# the valid values among them: a 200 (top_p=5e-324 found by the fuzz: 0 in float32, rank 1 died on a NaN distribution)
SERVED = {("temperature", "0"), ("temperature", "5e-324"), ("top_p", "5e-324"), ("seed", "-1"), ("seed", "0"),
          ("logprobs", "0")}


@pytest.mark.parametrize("literal", HOSTILE_NUMBERS)
@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_one_hostile_number_in_a_sampled_request(field, literal, server):
    """A valid, sampled request (temperature 0.7) with one numeric field negative, zero, huge or not finite: refused
    with a 400 naming the field, or (a valid value) served; never a 503 from a rank that took it and died."""
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0.7}
    body.pop(field, None)
    if field == "max_completion_tokens":
        body.pop("max_tokens")
    raw = json.dumps(body)[:-1] + f', "{field}": {literal}}}'
    status, answer = server.post("/v1/completions", raw.encode())
    if (field, literal) in SERVED:
        assert status == 200 and answer["usage"]["completion_tokens"] >= 1, (raw, answer)
    else:
        assert status == 400, (raw, status, answer)
        assert is_openai_error(answer) and answer["error"]["param"] == field, answer
    assert server.health()["status"] == "ok"


def test_the_widest_seeds_sample(server):
    for seed in (2**63 - 1, -2**63, 0):
        status, answer = server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "temperature": 1.0, "seed": seed})
        assert status == 200 and len(answer["tandem"]["token_ids"]) == 4


def test_the_smallest_temperatures_sample(server, models):
    """Found by the fuzz: T=1e-300 is a valid request, and logits / T overflowed to NaN probabilities on
    rank 1 (both ranks died). A sampler that small is the argmax."""
    greedy = reference_greedy(models[0], [5, 6, 7], 4)
    for temperature in (5e-324, 1e-300, 1e-30):
        status, answer = server.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": temperature,
                                                         "seed": 1})
        assert status == 200 and answer["tandem"]["token_ids"] == greedy, (temperature, answer)


def test_max_tokens_up_to_gen_max_new_tokens(server):
    status, answer = server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": MAX_NEW})
    assert status == 200 and answer["usage"]["completion_tokens"] == MAX_NEW
    status, answer = server.post("/v1/completions", {"prompt": [5, 6], "max_tokens": MAX_NEW + 1})
    assert status == 400 and "gen.max_new_tokens" in answer["error"]["message"]


def test_a_body_over_max_body_bytes_is_refused_before_it_is_read(server):
    big = json.dumps({"prompt": "w " * 600_000}).encode()  # 1.2 MB > the default 1 MiB
    status, answer = server.post("/v1/completions", big)
    assert status == 413 and is_openai_error(answer) and "serve.max_body_bytes" in answer["error"]["message"]
    # chunked (no Content-Length): counted as it arrives
    conn_status, data = server.request("POST", "/v1/completions", iter([big[:600_000], big[600_000:]]),
                                       headers={"Transfer-Encoding": "chunked"})
    assert conn_status == 413


def test_health_answers_while_a_long_prompt_is_tokenized(models):
    """Tokenizing runs in a worker thread: /health (and every other client) answers meanwhile."""
    with served(*served_args(*models), "serve.max_body_bytes=2000000") as server:
        body = json.dumps({"prompt": "w1 w2 " * 200_000, "max_tokens": 4}).encode()  # 1.2 MB, 400k words: seconds to tokenize
        done = {}

        def post():
            done["post"] = server.post("/v1/completions", body)
            done["post_at"] = time.monotonic()
        thread = threading.Thread(target=post)
        thread.start()
        time.sleep(0.5)  # the body is in; tokenizing has begun
        assert server.health()["status"] == "ok"
        health_at = time.monotonic()
        thread.join(120)
        assert done["post"][0] == 400 and done["post"][1]["error"]["code"] == "context_length_exceeded"
        assert health_at < done["post_at"], "/health waited for the tokenizer"


# --- the fuzz: random JSON, and random values for every field the server reads ---------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
raw_literals = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 40, "[[[[[[[[]]]]]]]]", "{}"])
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
          "stream", "n", "best_of", "logprobs", "echo", "tools"]
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", 3]),
                                           "content": st.text(max_size=30) | json_values}), min_size=0, max_size=3)
field_values = st.fixed_dictionaries({}, optional={
    "messages": messages | json_values, "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 400), max_size=5) | json_values,
    "max_tokens": st.integers(-3, MAX_NEW + 3) | json_values, "temperature": st.floats() | json_values,
    "top_p": st.floats() | json_values, "seed": st.integers(-2**65, 2**65) | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | json_values,
    "stream": st.booleans() | json_values, "n": st.integers(0, 2) | json_values, "model": st.sampled_from(["target", "x"]) | json_values,
    "logprobs": json_values, "echo": json_values, "tools": json_values, "best_of": json_values})


valid_values = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "seed": st.integers(-2**63, 2**63 - 1), "stop": st.text(min_size=1, max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=4),
    "stream": st.booleans(), "model": st.just("target"), "n": st.just(1)})


hostile_numbers = (st.sampled_from([-1, -0.5, 0, 1e300, 10**30, -10**30, float("nan"), float("inf"), float("-inf")])
                   | st.floats() | st.integers(-2**70, 2**70))


def for_path(body: dict, path: str) -> dict:
    """A valid body as the endpoint at `path` takes it: its own prompt field only (another endpoint's is a 400)."""
    if path == "/v1/completions":
        body.pop("messages")
    elif path == "/v1/chat/completions":
        body.pop("prompt")
    else:  # the Responses API: input and max_output_tokens; seed, stop and n are not its fields
        body["input"], body["max_output_tokens"] = body.pop("messages"), body.pop("max_tokens")
        for key in ("prompt", "seed", "stop", "n"):
            body.pop(key, None)
    return body


@st.composite
def mostly_valid(draw, path: str) -> dict:
    """A request the engine runs (any valid value of every field, sampling on: temperature > 0, so top_p and seed
    reach rank 1) with exactly one field made hostile: a hostile number for a numeric field, or any value."""
    body = {"prompt": draw(st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 319), min_size=1, max_size=5)),
            "messages": draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                             "content": st.text(max_size=30)}), min_size=1, max_size=3)),
            "max_tokens": 2, **draw(valid_values), "temperature": draw(st.floats(0.05, 2.0))}  # few tokens: many examples
    body = for_path(body, path)
    if draw(st.integers(0, 3)):  # mostly a numeric field with a hostile number
        field = draw(st.sampled_from(NUMERIC_FIELDS))
        body[field] = draw(hostile_numbers)
    else:
        field = draw(st.sampled_from(FIELDS))
        body[field] = draw(field_values.map(lambda d: d.get(field)) | json_values)
    return body


@st.composite
def bodies(draw, path: str) -> bytes:
    kind = draw(st.sampled_from(["valid"] * 7 + ["fields", "json", "raw", "bytes"]))
    if kind == "valid":
        return json.dumps(draw(mostly_valid(path))).encode()
    if kind == "fields":
        return json.dumps(draw(field_values)).encode()
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "raw":  # a field whose value Python's parser takes but JSON has no such number
        return f'{{"prompt": "hi", "{draw(st.sampled_from(FIELDS))}": {draw(raw_literals)}}}'.encode()
    return draw(st.binary(max_size=64))


PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses"])
REQUESTS = PATHS.flatmap(lambda path: st.tuples(st.just(path), bodies(path)))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=REQUESTS)
def test_fuzz_the_api_answers_and_stays_up(server, request):
    answers_and_stays_up(server, *request)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=REQUESTS)
def test_a_longer_fuzz_of_the_api(server, request):
    """The default suite runs 300 examples (with the top_p bounds removed they found the rank-1 crash in 5 runs of 6)."""
    answers_and_stays_up(server, *request)


def answers_and_stays_up(server, path: str, body: bytes) -> None:
    status, data = server.request("POST", path, body)
    assert status in STATUSES, (status, body, data[:300])
    if status == 200:
        text = data.decode()
        if text.startswith("event:"):  # the Responses API's typed events: the last one ends the response
            assert text.rstrip().rsplit("\n", 1)[-1].startswith(('data: {"type": "response.completed"',
                                                                  'data: {"type": "response.incomplete"')), text[-300:]
        else:
            assert text.rstrip().endswith("data: [DONE]") if text.startswith("data:") else \
                ("choices" in json.loads(text) or json.loads(text)["object"] == "response")
    else:
        assert is_openai_error(json.loads(data)), data[:300]
    assert server.health()["status"] == "ok"


def test_after_the_fuzz_the_answers_are_still_right(server, models):
    still_serving(server, models[0])


@pytest.mark.parametrize("override", ["gen.temperature=nan", "gen.temperature=inf", "gen.seed=100000000000000000000000",
                                      "gen.seed=-9223372036854775809", "gen.top_p=nan"])
def test_the_launchs_own_sampling_settings_are_bounded_too(override):
    """gen.* are what a request without those fields gets: the same bounds, at start, as one line."""
    from launch.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(["prompt=x", override])
