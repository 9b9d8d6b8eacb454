"""Issue 16: serve.api_key_file / serve.api_key. Every route but /health needs Authorization: Bearer KEY
(401 in OpenAI's error JSON otherwise); tandem-chat sends the key; an open host without a key is warned of.
In process (tests.support.serve_harness): real HTTP on loopback against the real entry's two ranks."""
import io
import urllib.error

import openai
import pytest

from launch.serve import chat
from launch.config import ConfigError, load_config
from launch.serve.server import load_api_key, open_host_warning
from tests.support.serve_harness import served
from tests.support.serve_harness import is_openai_error, served_args

KEY = "k3y-for-tests_0123456789"


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api.key"
    key_file.write_text(KEY + "\n")
    with served(*served_args(*models), f"serve.api_key_file={key_file}") as s:
        yield s


BODY = {"prompt": [5, 6, 7], "max_tokens": 3}


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "},
                                     {"Authorization": f"bearer {KEY[:-1]}"},
                                     # a check that compares prefixes (or stops at the shorter string) takes these:
                                     {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"Bearer {KEY[:1]}"},
                                     {"Authorization": f"Bearer {KEY}{KEY}"}, {"Authorization": f"Bearer {KEY.upper()}"}])
def test_without_the_key_every_route_but_health_is_refused(server, headers):
    for method, path, body in (("POST", "/v1/completions", BODY), ("POST", "/v1/chat/completions", BODY),
                               ("GET", "/v1/models", None), ("POST", "/v1/completions", b"{not json")):
        status, answer = server.post(path, body, headers) if method == "POST" else server.request(method, path, None, headers)
        assert status == 401, (path, headers)
        if isinstance(answer, dict):
            assert is_openai_error(answer) and answer["error"]["code"] == "invalid_api_key"
    assert server.health()["http_status"] == 200  # load balancers probe without a key


def test_with_the_key_it_serves_and_the_openai_client_sends_it(server):
    status, answer = server.post("/v1/completions", BODY, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)
    assert client.completions.create(model="target", prompt=[5, 6], max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_tandem_chat_sends_the_key_from_flag_or_environment(server, monkeypatch):
    messages = [{"role": "user", "content": "hi"}]
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    answer, final = chat.turn(f"{server.url}/v1", messages, chat.parse_args(["--max-tokens", "4"]), out=io.StringIO())
    assert final["usage"]["completion_tokens"] == 4
    monkeypatch.delenv("OPENAI_API_KEY")
    answer, final = chat.turn(f"{server.url}/v1", messages, chat.parse_args(["--max-tokens", "4", "--api-key", KEY]),
                              out=io.StringIO())
    assert final["usage"]["completion_tokens"] == 4
    with pytest.raises(urllib.error.HTTPError) as e:
        chat.turn(f"{server.url}/v1", messages, chat.parse_args(["--max-tokens", "4"]), out=io.StringIO())
    assert e.value.code == 401 and "API key" in chat.error_message(e.value)


def test_the_key_comes_from_the_file_or_the_setting(tmp_path):
    def cfg(*extra):
        return load_config(["serve.port=0", *extra])
    assert load_api_key(cfg()) is None
    assert load_api_key(cfg("serve.api_key=abc")) == "abc"
    (tmp_path / "k").write_text("from-file\nignored\n")
    assert load_api_key(cfg(f"serve.api_key_file={tmp_path / 'k'}")) == "from-file"
    (tmp_path / "empty").write_text("\n")
    for bad in (f"serve.api_key_file={tmp_path / 'missing'}", f"serve.api_key_file={tmp_path / 'empty'}"):
        with pytest.raises(ConfigError, match="serve.api_key"):
            load_api_key(cfg(bad))
    with pytest.raises(ConfigError, match="not both"):
        cfg("serve.api_key=a", f"serve.api_key_file={tmp_path / 'k'}")


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("192.168.1.5", None, True), ("::", None, True),
                                             ("myhost.example", None, True), ("0.0.0.0", "k", False),
                                             ("127.0.0.1", None, False), ("::1", None, False), ("localhost", None, False)])
def test_an_open_host_without_a_key_is_warned_of(host, key, warned):
    line = open_host_warning(host, key)
    assert (line is not None) == warned
    if warned:
        assert host in line and "serve.api_key_file" in line and "\n" not in line


def test_tandem_chat_by_default_asks_for_no_more_than_the_server_allows(server):
    """max_tokens above gen.max_new_tokens is refused: tandem-chat's default leaves it to the server."""
    args = chat.parse_args(["--api-key", KEY])
    answer, final = chat.turn(f"{server.url}/v1", [{"role": "user", "content": "hi"}], args, out=io.StringIO())
    assert final["choices"][0]["finish_reason"] in ("length", "stop") and final["usage"]["completion_tokens"] >= 1
