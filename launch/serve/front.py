"""The front: a small process that holds serve.port while torchrun restarts the ranks (--max_restarts > 0).

torchrun restarts every worker when one fails, rank 0 and its server included. So the first rank 0 starts this
process in a session of its own (torchrun's stop of the workers does not reach it); it binds serve.host:serve.port
and carries each request to rank 0's current server on a loopback port. Every rank 0 finds it by a unix socket
named after the torchrun agent's pid and the port, registers its server there, and keeps that connection open:
when it closes, the server is gone. While no server is registered the front answers itself:

    a new request        held up to serve.retry_window_s for the server to come back, else 503 + Retry-After
    GET /health          503 {"status": "restarting", "cause": ...}
    a request in flight  when rank 0 dies: a 503 if it was not answered yet; a stream gets an error event, then
                         its end. (When a later rank dies, rank 0's engine ends them itself, naming that rank.)

It exits when the agent that started the run exits, or when the last attempt's server leaves. One request per
client connection (Connection: close): what it holds per request is a few lines. With serve.via_relay it, not
rank 0, registers the port at the relay as the run's API (publish): relay clients get its answers during a
restart too. Standard library and netbridge's dial-back (no torch).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import struct
import sys
import time

HEADER_TIMEOUT_S = 10.0  # as the server's own (launch/serve/app.py): a client's headers within this
BODY_TIMEOUT_S = 30.0  # and its body within this
HEAD_LIMIT = 64 * 1024  # request or response headers beyond this are refused
NO_WORD = "lost rank 0 (its process ended without a word: killed, or its host was lost)"


def control_name(port: int, agent_pid: int) -> str:
    """The front's unix socket (Linux's abstract namespace: no file to leave behind)."""
    return f"\0tandem-front/{agent_pid}/{port}"


def error_body(message: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def response(status: int, body: dict, headers: dict | None = None) -> bytes:
    data = json.dumps(body).encode()
    reason = {200: "OK", 400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
              431: "Request Header Fields Too Large", 503: "Service Unavailable"}.get(status, "")
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(data)}",
             "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Request:
    """A client's request, read whole: its head (Connection rewritten to close) and its body."""

    def __init__(self, method: str, path: str, head: bytes, body: bytes):
        self.method, self.path, self.head, self.body = method, path, head, body


async def read_request(reader: asyncio.StreamReader, max_body: int) -> Request | None:
    try:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
    except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
        return None  # gone, or never sent its headers
    except asyncio.LimitOverrunError:
        raise Refused(431, "the request headers are too large") from None
    lines = raw.decode("latin-1").split("\r\n")
    method, path = (lines[0].split(" ") + ["", ""])[:2]
    headers = [line.split(":", 1) for line in lines[1:] if ":" in line]
    fields = {k.strip().lower(): v.strip() for k, v in headers}
    kept = [f"{k}:{v}" for k, v in headers if k.strip().lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive")]
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            body = await read_body(reader, fields, max_body)
    except TimeoutError:
        raise Refused(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        return None
    head = "\r\n".join([lines[0], *kept, f"content-length: {len(body)}", "connection: close"]) + "\r\n\r\n"
    return Request(method, path, head.encode("latin-1"), body)


async def read_body(reader: asyncio.StreamReader, fields: dict, max_body: int) -> bytes:
    too_big = Refused(413, f"the request body exceeds serve.max_body_bytes={max_body}")
    if "chunked" not in fields.get("transfer-encoding", ""):
        size = int(fields.get("content-length", "0"))
        if size > max_body:
            raise too_big
        return await reader.readexactly(size)
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        body += (await reader.readexactly(size + 2))[:-2]
        if len(body) > max_body:
            raise too_big
    await reader.readuntil(b"\r\n")  # the end of the (empty) trailers
    return body


class Front:
    """The port's holder: which server is rank 0's now, and every client connection carried to it."""

    def __init__(self, retry_window_s: float, max_body: int):
        self.retry_window_s, self.max_body = retry_window_s, max_body
        self.port: int | None = None  # rank 0's server on 127.0.0.1, None while the ranks restart
        self.registered = asyncio.Event()
        self.attempt, self.max_restarts = 0, 0
        self.cause = "the ranks are starting"
        self.start_s = 10.0  # what the last rank 0 took from its start to serving: the Retry-After
        self.done = asyncio.Event()  # set: the front exits

    async def listen(self, listener: socket.socket, control: socket.socket) -> None:
        """Clients on `listener` (serve.port), rank 0s on `control` (the unix socket)."""
        await asyncio.start_server(self.on_client, sock=listener, limit=HEAD_LIMIT)
        await asyncio.start_unix_server(self.on_rank_zero, sock=control)

    # --- rank 0's registrations ----------------------------------------------------------------------
    async def on_rank_zero(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One rank 0's connection: {"serve": port, ...} registers its server, {"cause": ...} says why it
        stops; the connection's end is the server's."""
        sock = writer.get_extra_info("socket")
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[2]
        if uid != os.getuid():  # another local user's process: it may not take the API over
            writer.close()
            return
        mine = False
        try:
            async for line in reader:
                message = json.loads(line)
                if "serve" in message:
                    mine = True
                    self.port, self.attempt = message["serve"], message["attempt"]
                    self.max_restarts, self.start_s = message["max_restarts"], message["start_s"]
                    self.cause = ""
                    self.registered.set()
                if "cause" in message and mine:
                    self.cause = message["cause"]
        except (ValueError, KeyError, ConnectionError):
            pass
        writer.close()
        if mine:
            self.port = None
            self.registered.clear()
            self.cause = self.cause or NO_WORD
            if self.attempt >= self.max_restarts:  # torchrun restarts no more: the run is over
                asyncio.get_running_loop().call_later(1.0, self.done.set)  # the last answers written first

    async def server_port(self, wait_s: float) -> int | None:
        if self.port is None and wait_s > 0:
            try:
                await asyncio.wait_for(self.registered.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return self.port

    def restarting(self) -> str:
        left = self.max_restarts - self.attempt
        return f"the server is restarting ({self.cause}; torchrun restarts left: {left}); retry after {self.retry_after()} s"

    def retry_after(self) -> int:
        return max(1, math.ceil(self.start_s))

    # --- clients ---------------------------------------------------------------------------------------
    async def on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = await read_request(reader, self.max_body)
            except Refused as e:
                writer.write(response(e.status, error_body(str(e))))
                return
            if request is not None:
                await self.carry(request, writer)
        except ConnectionError:  # the client left
            pass
        finally:
            writer.close()

    async def carry(self, request: Request, writer: asyncio.StreamWriter) -> None:
        """The request to rank 0's server and its answer back; the front's own answer when there is none."""
        health = request.path.split("?")[0] == "/health"
        port = await self.server_port(0 if health else self.retry_window_s)
        if port is not None:
            try:
                reader, upstream = await asyncio.open_connection("127.0.0.1", port, limit=HEAD_LIMIT)
            except OSError:
                port = None  # it died a moment ago; its connection's end is on its way
        if port is None:
            if health:
                body = {"status": "restarting", "cause": self.cause, "restarts_left": self.max_restarts - self.attempt}
            else:
                body = error_body(self.restarting(), "server_restarting")
            writer.write(response(503, body, {"retry-after": str(self.retry_after())}))
            return
        try:
            upstream.write(request.head + request.body)
            await pass_answer(reader, writer, self.lost, responses=request.path.startswith("/v1/responses"))
        finally:
            upstream.close()

    async def lost(self) -> str:
        """Why rank 0's server stopped mid-answer: what it said, once its connection here has ended (briefly)."""
        deadline = time.monotonic() + 2.0
        while self.port is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return f"generation failed: {self.cause or NO_WORD}; torchrun restarts the ranks (retry after {self.retry_after()} s)"


async def pass_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lost, responses: bool = False) -> None:
    """The server's answer to the client as it comes, a chunk at a time. When the server goes before its end:
    no answer yet -> a 503; a stream -> an error event and the stream's end; any other body is cut (the
    client sees a short answer, never a complete-looking wrong one)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        writer.write(response(503, error_body(await lost(), "server_restarting")))
        return
    writer.write(head)
    fields = head.decode("latin-1").lower()
    chunked, stream = "transfer-encoding: chunked" in fields, "content-type: text/event-stream" in fields
    try:
        if chunked:
            while True:
                line = await reader.readuntil(b"\r\n")
                size = int(line.split(b";")[0], 16)
                writer.write(line + await reader.readexactly(size + 2))  # whole chunks: an event never halved
                await writer.drain()
                if size == 0:
                    return
        else:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
            return
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionResetError, ValueError):
        pass
    if chunked and stream:
        writer.write(chunk(stream_error(await lost(), responses)) + b"0\r\n\r\n")


def stream_error(message: str, responses: bool) -> bytes:
    """The error event a stream ends with, as launch/serve/forms.py writes it: the Responses API's "error" event,
    or the completions' error object then [DONE]."""
    if responses:
        return f"event: error\ndata: {json.dumps({'type': 'error', 'code': 'server_restarting', 'message': message, 'param': None})}\n\n".encode()
    return f"data: {json.dumps(error_body(message, 'server_restarting'))}\n\ndata: [DONE]\n\n".encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


# --- rank 0's side ----------------------------------------------------------------------------------

def restarts_allowed() -> int:
    """torchrun's --max_restarts (0 when not under torchrun): with restarts, rank 0 serves behind the front."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) if "RANK" in os.environ else 0


class FrontLink:
    """Rank 0's connection to the front: its server registered once it listens, the cause told if it fails. The
    connection closes with the process, however it ends: that is how the front learns the server is gone."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def register(self, port: int) -> None:
        env = os.environ
        self._send({"serve": port, "attempt": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "max_restarts": restarts_allowed(), "start_s": process_age_s()})

    def tell(self, cause: str) -> None:
        self._send({"cause": cause})

    def _send(self, message: dict) -> None:
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:  # the front is gone (its agent exited): nothing to tell
            pass


def attach(host: str, port: int, retry_window_s: float, max_body: int, relay=None) -> FrontLink:
    """The front of this run (torchrun's agent, rank 0's parent, and the port), started if it is not running
    yet; a port it cannot bind is a LaunchError naming it. `relay` (launch.serve.via_relay.ApiRelay, or None):
    where the front registers the port as the run's API."""
    from launch.distributed import LaunchError
    name = control_name(port, os.getppid())
    sock = _connect(name)
    if sock is None:
        args = ["--host", host, "--port", str(port), "--agent", str(os.getppid()), "--retry-window-s", str(retry_window_s),
                "--max-body", str(max_body)]
        if relay is not None:
            args += ["--relay", relay.relay, "--session", relay.session]
        line = start(args, relay.token if relay is not None else None)
        if line != "ready":
            raise LaunchError(line)
        sock = _connect(name)
    if sock is None:
        raise LaunchError(f"cannot reach the front of serve.port={port}; is another run using that port?")
    return FrontLink(sock)


def start(args: list[str], token: bytes | None) -> str:
    """Start the front with `args` in a session of its own; its first line ("ready" once it listens, a fraction
    of a second). The relay token goes on its stdin, never on its command line (which every local user can read)."""
    import subprocess
    front = subprocess.Popen([sys.executable, "-m", "launch.serve.front", *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    front.stdin.write(token.hex() if token is not None else "")
    front.stdin.close()
    line = front.stdout.readline().strip()
    front.stdout.close()
    return line or f"the front process (launch/serve/front.py) exited with status {front.wait()}"


def _connect(name: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(name)
    except OSError:
        sock.close()
        return None
    return sock


def process_age_s() -> float:
    """Seconds since this process started (its start-up, which the front offers clients as Retry-After)."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        return float(open("/proc/uptime").read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 10.0


# --- the process ------------------------------------------------------------------------------------

def watch_agent(pid: int, done: asyncio.Event) -> None:
    """`done` set when the torchrun agent exits (a pidfd becomes readable then)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # already gone
        done.set()
        return
    asyncio.get_running_loop().add_reader(fd, done.set)


async def run(args: argparse.Namespace) -> None:
    front = Front(args.retry_window_s, args.max_body)
    try:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        listener = socket.create_server((args.host, args.port), family=family, backlog=128)
        control = socket.socket(socket.AF_UNIX)
        control.bind(control_name(args.port, args.agent))
    except OSError as e:
        print(f"cannot serve on {args.host}:{args.port}: {e.strerror}; pick another serve.port (or stop what is using it)",
              flush=True)
        return
    await front.listen(listener, control)
    watch_agent(args.agent, front.done)
    publish(args.host, args.port, args.relay, args.session, args.token)
    print("ready", flush=True)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # rank 0 reads to here and closes its end
    await front.done.wait()
    os._exit(0)  # at once: the sockets close with the process, and no connection's task is torn down half-way


def publish(host: str, port: int, relay: str | None, session: str | None, token: bytes):
    """serve.via_relay: this port registered at `relay` as service api:<session>, for as long as the front lives
    (the relay drops it when the process ends). The front outlives the ranks, so a relay client gets the front's
    503 + Retry-After during a restart, not a closed connection. The dial-back's handle, or None without a relay."""
    if relay is None:
        return None
    from netbridge.backend import api_service, serve_through_relay
    return serve_through_relay(relay, token, api_service(session), (local_address(host), port))


def local_address(host: str) -> str:
    """Where a process on this host connects to a server listening on `host` (an any-address is loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Tandem's front (started by rank 0; see launch/serve/front.py)")
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--agent", type=int, required=True, help="the torchrun agent's pid: the front exits with it")
    ap.add_argument("--retry-window-s", type=float, default=0.0)
    ap.add_argument("--max-body", type=int, default=1 << 20)
    ap.add_argument("--relay", help="serve.via_relay: the relay's HOST:PORT (its token comes on stdin, in hex)")
    ap.add_argument("--session", help="with --relay: the run's session; the API is service api:SESSION")
    args = ap.parse_args(argv)
    args.token = bytes.fromhex(sys.stdin.readline().strip()) if args.relay else b""
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
