"""serve.port=PORT: rank 0 answers an OpenAI-compatible HTTP API (launch/serve/app.py) while the later ranks serve
rounds as always. This module is the process's side: the port bound and the API key read before anything else
starts, uvicorn run in the main thread (so it owns SIGINT/SIGTERM), the engine thread (launch/serve/engine.py)
started and stopped. A signal ends every live request with an error and stops the server; a lost later rank
stops it too, and `serve` raises it for the entry (train_free_infer.py) to report in one line.
"""
from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from launch.config import TandemConfig
from launch.serve.app import KEEP_ALIVE_S, build_app, headers_within_timeout
from launch.serve.engine import Engine
from launch.serve.front import FrontLink, attach, restarts_allowed
from launch.serve.via_relay import api_relay, register_api


def reserve_port(cfg: TandemConfig) -> socket.socket:
    """Bind serve.host:serve.port before anything else starts: the process group and gloo then open
    ephemeral ports of their own, and one of them could otherwise take a port in that range before
    uvicorn binds it (minutes later, once the models are loaded). A port in use is found at once."""
    from launch.distributed import LaunchError
    try:
        family = socket.AF_INET6 if ":" in cfg.serve.host else socket.AF_INET
        listener = socket.create_server((cfg.serve.host, cfg.serve.port), family=family)
    except OSError as e:
        raise LaunchError(f"cannot serve on {cfg.serve.host}:{cfg.serve.port}: {e.strerror}; pick another serve.port "
                          "(or stop what is using it)") from None
    return listener


@dataclass
class Listening:
    """Where rank 0's server listens: serve.port itself, or, under torchrun with restarts, a loopback port behind
    the front (launch/serve/front.py), which holds serve.port across restarts and carries requests to it."""
    socket: socket.socket
    front: FrontLink | None = None


def open_port(cfg: TandemConfig) -> Listening:
    """serve.port bound now (by this process, or by the front it finds or starts): see reserve_port."""
    if restarts_allowed() == 0:
        return Listening(reserve_port(cfg))
    front = attach(cfg.serve.host, cfg.serve.port, cfg.serve.retry_window_s, cfg.serve.max_body_bytes, api_relay(cfg))
    return Listening(socket.create_server(("127.0.0.1", 0)), front)


def load_api_key(cfg: TandemConfig) -> str | None:
    """serve.api_key_file's first line (or serve.api_key); None when neither is set."""
    from launch.config import ConfigError
    path = cfg.serve.api_key_file
    if path is None:
        key = cfg.serve.api_key
    else:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read serve.api_key_file={path} ({getattr(e, 'strerror', None) or e}); "
                              "create it, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE") from None
    if key is not None and (not key or not key.isprintable() or not key.isascii()):
        raise ConfigError(f"the API key in {'serve.api_key_file=' + path if path else 'serve.api_key'} is empty or not printable ASCII")
    return key


def open_host_warning(host: str, api_key: str | None) -> str | None:
    """The line printed when anyone on the network could use the GPUs."""
    if api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (f"[warning: serving on {host} without an API key: anyone who can reach this port can use it; "
            "set serve.api_key_file=FILE]")


def serve(cfg: TandemConfig, session, tokenizer, eos_ids: set[int], vocab_size: int,
          listening: Listening | None = None, model_name: str | None = None, links: tuple = ()) -> None:
    """Serve until SIGINT/SIGTERM (raises Interrupted, once the later ranks have had their Bye), until the server is
    told to exit (returns), or until a later rank is lost (raises its PeerError)."""
    import uvicorn
    listening = listening or Listening(reserve_port(cfg))
    front = listening.front
    host, port = (cfg.serve.host, cfg.serve.port) if front else listening.socket.getsockname()[:2]
    from pathlib import Path
    model_name = model_name or cfg.serve.model_name or Path(cfg.model.target.rstrip("/")).name  # launch.plan.Models.name
    telemetry = None
    if cfg.log.dir:
        from launch.telemetry import ServeTelemetry
        telemetry = ServeTelemetry(cfg, links)  # links: the Plan's, for TensorBoard's link/*
    api_key = load_api_key(cfg)
    warning = open_host_warning(cfg.serve.host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    engine = Engine(cfg, session, tokenizer, eos_ids, telemetry)
    app = build_app(cfg, engine, tokenizer, vocab_size, model_name, api_key)
    signals: list[int] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # SIGINT/SIGTERM (uvicorn's handler while it runs)
            if not signals:
                signals.append(sig)
                if front is not None and sig == signal.SIGTERM:
                    # torchrun stops the workers because one failed: the requests in flight end naming it, if
                    # the engine finds it in a moment (a dead peer's link fails at its next round)
                    threading.Thread(target=stop_after_the_cause, args=(self, sig, frame), daemon=True).start()
                    return
                engine.interrupt(f"stopped by {signal.Signals(sig).name}")
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if front is not None:
                front.register(listening.socket.getsockname()[1])

    def stop_after_the_cause(server, sig: int, frame) -> None:
        from netbridge.channel import LAST_WORDS_WAIT_S
        deadline = time.monotonic() + LAST_WORDS_WAIT_S + 1.0  # a lost peer's PeerError waits that long for its words
        while engine.fatal is None and engine.live and time.monotonic() < deadline:
            time.sleep(0.02)
        if engine.fatal is None:
            engine.interrupt(f"stopped by {signal.Signals(sig).name}")
            front.tell(f"rank 0 stopped by {signal.Signals(sig).name} (torchrun stops every rank when one fails)")
        uvicorn.Server.handle_exit(server, sig, frame)
    server = Server(uvicorn.Config(app, host=cfg.serve.host, port=cfg.serve.port, log_level="warning",
                                   lifespan="off", timeout_graceful_shutdown=2, http=headers_within_timeout(),
                                   timeout_keep_alive=KEEP_ALIVE_S, ssl_certfile=cfg.serve.ssl_certfile,
                                   ssl_keyfile=cfg.serve.ssl_keyfile))

    def on_fatal() -> None:
        if front is not None:
            front.tell(str(engine.fatal))
        server.should_exit = True
    engine.on_fatal = on_fatal
    if threading.current_thread() is threading.main_thread():
        # uvicorn restores the handlers it found and re-raises the signal it caught once it has shut
        # down: finding these, that re-raise is a no-op, and the entry exits cleanly
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    engine.thread.start()
    scheme = "https" if cfg.serve.ssl_certfile else "http"
    print(f"[serving {model_name} on {scheme}://{host}:{port}/v1 (OpenAI-compatible); "
          f"Ctrl-C stops every rank]", file=sys.stderr, flush=True)
    relayed = register_api(cfg, port) if front is None else None  # a front registers it itself: it outlives us
    if (where := api_relay(cfg)) is not None:
        print(f"[and through the relay {where.relay}: clients use its --api-port (api:{where.session})]", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[listening.socket])
    finally:
        if relayed is not None:
            relayed.close()
    if engine.fatal is None:
        engine.stop()  # ends the live requests at their next round, then says Bye to the later ranks
    if telemetry is not None:
        telemetry.close()
    if engine.fatal is not None:
        raise engine.fatal
    if signals:
        from launch.distributed import Interrupted
        raise Interrupted(signals[0], f" after {engine.served} requests")
    print(f"[stopped after {engine.served} requests]", file=sys.stderr, flush=True)
