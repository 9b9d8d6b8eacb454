"""Issue 16: SIGINT/SIGTERM while a request streams. The stream in flight ends with an error event and
[DONE]; rank 0 lets rank 1 go (Bye) and ends with one line naming the signal. In process (the signal's
handler called as the signal would call it); test_serve.py sends real signals under torchrun."""
import http.client
import json
import signal
import threading
import time

from launch.distributed import Interrupted
from tests.support.serve_harness import served


def open_stream(port: int, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    return conn, r


def events(response):
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_sigterm_ends_the_stream_in_flight_with_an_error_and_done(models):
    target, draft = models
    overrides = [f"model.target={target}", "model.dtype=float32", "model.max_len=2048", "draft.kind=model",
                 f"draft.model={draft}", "draft.dtype=float32", "draft.max_len=2048", "gen.max_new_tokens=1900",
                 "transport.timeout_s=20", "transport.emulate_delay_ms=5", "serve.max_concurrent=1"]  # the second waits
    with served(*overrides) as server:
        conn, response = open_stream(server.port, {"prompt": [5, 6, 7], "max_tokens": 1900})
        stream = events(response)
        first = json.loads(next(stream))
        assert first["choices"][0]["text"] is not None
        waiting = {}
        queued = threading.Thread(target=lambda: waiting.update(answer=server.post("/v1/completions", {"prompt": [5], "max_tokens": 2})))
        queued.start()  # a second request, waiting behind the first
        deadline = time.monotonic() + 10
        while server.health()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        server.uvicorn.handle_exit(signal.SIGTERM, None)  # what uvicorn's handler does on the signal
        rest = list(stream)
        conn.close()
        queued.join(10)
        for t in server.threads:
            t.join(10)
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["type"] == "server_error" and "stopped by SIGTERM" in error["message"]
        assert all("error" not in json.loads(e) for e in rest[:-2])  # text chunks until then, no finish chunk
        assert waiting["answer"][0] == 503 and "stopped by SIGTERM" in waiting["answer"][1]["error"]["message"]
        assert isinstance(server.outcome[0], Interrupted) and str(server.outcome[0]).startswith("stopped by SIGTERM")
        assert server.outcome[1] is None  # rank 1 had its Bye (it received no signal of its own here)
