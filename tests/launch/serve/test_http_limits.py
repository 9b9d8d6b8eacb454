"""HTTP at the edges, from a client's seat: a body far over serve.max_body_bytes still gets its readable 413
(not a connection reset), a half-sent request is closed (headers) or answered 408 (body) instead of holding a
socket forever, and the Authorization scheme is case-insensitive while the key is not."""
import http.client
import json
import socket
import time

import pytest

from tests.support.serve_harness import served

KEY = "k3y-for-the-http-limits"


@pytest.fixture(scope="module")
def server(tiny_qwen, tmp_path_factory):
    import launch.serve.app as srv
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY)
    saved = srv.HEADER_TIMEOUT_S, srv.BODY_TIMEOUT_S
    srv.HEADER_TIMEOUT_S, srv.BODY_TIMEOUT_S = 1.0, 1.0  # read when the server starts and on each request
    try:
        with served(f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=none", "spec.k=0",
                    "gen.max_new_tokens=4", f"serve.api_key_file={key_file}") as s:
            yield s
    finally:
        srv.HEADER_TIMEOUT_S, srv.BODY_TIMEOUT_S = saved


def auth(scheme="Bearer", key=KEY):
    return {"Authorization": f"{scheme} {key}"}


def test_a_huge_body_gets_a_readable_413(server):
    """urllib, as clients send: the whole body, then the answer. A server that answers from Content-Length and
    stops reading leaves this client a connection reset (seen with the old server), not the 413."""
    import urllib.error
    import urllib.request
    body = json.dumps({"prompt": "w " * 3_750_000}).encode()  # 7.5 MB against the default 1 MiB
    request = urllib.request.Request(server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json", **auth()})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=20)
    assert refused.value.code == 413 and b"serve.max_body_bytes" in refused.value.read()


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_scheme_is_case_insensitive_and_the_key_is_not(server, scheme):
    status, _ = server.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6], "max_tokens": 2}).encode(),
                               headers=auth(scheme))
    assert status == 200
    for wrong in (KEY.upper(), KEY[:-1], KEY + "x"):
        status, _ = server.request("GET", "/v1/models", headers=auth(scheme, wrong))
        assert status == 401


def test_half_sent_headers_are_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < 5


def test_a_half_sent_body_is_answered_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        answer = b""
        while b"did not arrive" not in answer and (chunk := s.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within" in answer
    assert server.health()["status"] == "ok"
