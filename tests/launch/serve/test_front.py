"""Issue 44: the front (launch/serve/front.py), which holds serve.port while torchrun restarts the ranks. In
process: the front on a loopback port, a stand-in for rank 0's server (a raw socket that answers as uvicorn does,
or dies half-way), registered through rank 0's own FrontLink; requests over real HTTP."""
import asyncio
import http.client
import json
import socket
import threading
import time
import uuid

import pytest

from launch.serve import front as fr
from tests.support.serve_harness import is_openai_error


class Running:
    """A Front on its own event loop thread, with its port and control socket."""

    def __init__(self, retry_window_s: float = 0.0):
        self.front = fr.Front(retry_window_s, max_body=1 << 20)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.name = f"\0tandem-front-test/{uuid.uuid4().hex}"
        control = socket.socket(socket.AF_UNIX)
        control.bind(self.name)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.front.listen(self.listener, control), self.loop).result(5)

    def rank_zero(self, server_port: int) -> fr.FrontLink:
        """A rank 0 registering its server (as launch/serve/server.py does once uvicorn listens)."""
        link = fr.FrontLink(fr._connect(self.name))
        link.register(server_port)
        self.wait(lambda: self.front.port == server_port)
        return link

    def wait(self, ready, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 10):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body) if body is not None else None,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def running():
    r = Running()
    yield r
    r.close()


class Backend:
    """A stand-in for rank 0's uvicorn on 127.0.0.1: each connection's request read, then `answer(conn, request)`."""

    def __init__(self, answer):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), b"0"))
            while len(body) < length:
                body += conn.recv(65536)
            self.requests.append(head + b"\r\n\r\n" + body)
            self.answer(conn)
            conn.close()

    def close(self) -> None:
        self.listener.close()


def json_answer(conn) -> None:
    body = b'{"ok": true}'
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_no_server_is_a_503_with_retry_after_and_health_says_restarting(running):
    status, headers, body = running.request("POST", "/v1/completions", {"prompt": "hi"})
    assert status == 503 and is_openai_error(json.loads(body)), body
    assert int(headers["retry-after"]) >= 1
    assert "restarting" in json.loads(body)["error"]["message"]
    status, headers, body = running.request("GET", "/health")
    assert status == 503 and json.loads(body)["status"] == "restarting"


def test_requests_pass_verbatim_to_the_registered_server(running):
    backend = Backend(json_answer)
    link = running.rank_zero(backend.port)
    status, _, body = running.request("POST", "/v1/completions?x=1", {"prompt": "hi"})
    assert (status, json.loads(body)) == (200, {"ok": True})
    head, _, sent = backend.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions?x=1 HTTP/1.1") and json.loads(sent) == {"prompt": "hi"}
    assert b"connection: close" in head.lower()
    link.sock.close()  # rank 0's process ends: its connection closes with it
    running.wait(lambda: running.front.port is None)
    status, _, body = running.request("GET", "/health")
    assert status == 503 and fr.NO_WORD in json.loads(body)["cause"]
    backend.close()


def test_a_request_is_held_within_retry_window_s():
    running = Running(retry_window_s=3.0)
    backend = Backend(json_answer)
    try:
        links = []  # held: a FrontLink dropped closes its socket, which tells the front that rank 0 died
        threading.Timer(0.5, lambda: links.append(running.rank_zero(backend.port))).start()
        started = time.monotonic()
        status, _, body = running.request("POST", "/v1/completions", {"prompt": "hi"})
        assert status == 200 and 0.4 < time.monotonic() - started < 3.0, body
    finally:
        running.close()
        backend.close()


def test_a_request_held_past_retry_window_s_is_a_503():
    running = Running(retry_window_s=0.5)
    try:
        started = time.monotonic()
        status, headers, _ = running.request("POST", "/v1/completions", {"prompt": "hi"})
        assert status == 503 and "retry-after" in headers and 0.4 < time.monotonic() - started < 3.0
    finally:
        running.close()


def test_a_stream_cut_by_rank_zero_ends_with_an_error_event(running):
    def half_a_stream(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     + chunk(b'data: {"choices": [{"text": "a"}]}\n\n') + b"40\r\ndata: {\"cho")  # dies mid-chunk
    backend = Backend(half_a_stream)
    link = running.rank_zero(backend.port)
    threading.Timer(0.3, link.sock.close).start()
    status, headers, body = running.request("POST", "/v1/completions", {"prompt": "hi", "stream": True})
    events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert status == 200 and events[0] == b'{"choices": [{"text": "a"}]}', body  # the whole chunk came, not the half
    assert is_openai_error(json.loads(events[1])) and "lost rank 0" in json.loads(events[1])["error"]["message"]
    assert events[2:] == [b"[DONE]"]
    backend.close()


def test_an_answer_cut_before_its_head_is_a_503_with_the_cause_rank_zero_gave(running):
    backend = Backend(lambda conn: None)  # reads the request, closes without a word
    link = running.rank_zero(backend.port)

    def dies():  # rank 0 says why only after its server stopped answering: the front waits for that word
        link.tell("lost rank 1 (gloo: Connection reset by peer)")
        link.sock.close()
    threading.Timer(0.3, dies).start()
    status, _, body = running.request("POST", "/v1/chat/completions", {"messages": []})
    assert status == 503 and "lost rank 1" in json.loads(body)["error"]["message"], body
    backend.close()


def test_a_rank_zero_that_stops_on_the_last_attempt_ends_the_front(running):
    link = fr.FrontLink(fr._connect(running.name))
    link._send({"serve": 1, "attempt": 2, "max_restarts": 2, "start_s": 1.0})
    running.wait(lambda: running.front.port == 1)
    link.sock.close()
    running.wait(lambda: running.front.done.is_set())


def test_tandem_chat_retries_the_fronts_503_within_its_bound(running):
    from urllib.error import HTTPError

    from launch.serve import chat

    def a_stream(conn):
        event = b'data: {"choices": [{"delta": {"content": "hello"}, "finish_reason": "stop"}]}\n\n'
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     + chunk(event) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    running.front.start_s = 0.2  # Retry-After: 1
    url = f"http://127.0.0.1:{running.port}/v1"
    with pytest.raises(HTTPError) as refused:  # bounded: a retry that would start past retry_for_s is not made
        list(chat.stream_chat(url, {"messages": []}, timeout_s=10, retry_for_s=0.5))
    assert refused.value.code == 503
    backend = Backend(a_stream)
    links = []  # held: a FrontLink dropped closes its socket, which tells the front that rank 0 died
    threading.Timer(0.3, lambda: links.append(running.rank_zero(backend.port))).start()
    notes = []
    pieces = list(chat.stream_chat(url, {"messages": []}, timeout_s=10, note=notes.append))
    assert pieces[0] == "hello" and len(notes) == 1 and "restarting" in notes[0], (pieces, notes)
    backend.close()


def test_with_via_relay_the_front_process_is_the_runs_api_at_the_relay():
    """The front (not rank 0) registers api:<session>: a relay client reaches it while no rank 0 is up, and gets its
    503, not a closed connection. The real process, its token on stdin; it ends with its "agent"."""
    import subprocess
    import sys

    from tests.support.relay_harness import TOKEN, relay_in_thread
    from tests.support.tiny_models import free_port
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with relay_in_thread(api_port=0, api_session="run-7") as relay:
            line = fr.start(["--host", "127.0.0.1", "--port", str(free_port()), "--agent", str(agent.pid),
                             "--relay", f"127.0.0.1:{relay.port}", "--session", "run-7"], TOKEN)
            assert line == "ready", line
            assert health_through(relay.api_port) == {"status": "restarting", "cause": "the ranks are starting",
                                                      "restarts_left": 0}
    finally:
        agent.kill()
        agent.wait()


def health_through(port: int, timeout_s: float = 10.0) -> dict:
    """GET /health at the relay's API port, once the front's registration has arrived (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 503
            return json.loads(r.read())
        except (http.client.HTTPException, ConnectionError):  # the relay has no api:run-7 yet: it closes the client
            assert time.monotonic() < deadline, "the front never registered at the relay"
            time.sleep(0.1)
        finally:
            conn.close()
