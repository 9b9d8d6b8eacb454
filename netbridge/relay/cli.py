"""tandem-relay's command line: flags, the event loop, signals, and the line it prints once it listens."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from netbridge import auth
from netbridge.link import MAX_FRAME_BYTES
from netbridge.relay.admission import MAX_PENDING_PER_SOURCE, STALE_HANDSHAKE_S
from netbridge.relay.refusals import MAX_REFUSAL_DELAY_S
from netbridge.relay.server import Relay

log = logging.getLogger("tandem.relay")


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM), in MB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="tandem-relay", description="Relay both Tandem ranks dial out to (rendezvous + data), "
                                "and optionally the door to a run's API (--api-port).")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29400, help="the one port both nodes dial (default 29400; 0 = any free)")
    p.add_argument("--secret-file", default=os.environ.get("TANDEM_RELAY_TOKEN_FILE"),
                   help="file holding the relay token that admits nodes (default: $TANDEM_RELAY_TOKEN_FILE); never the "
                        "nodes' pairing secret, which the relay must not have; there is no --secret on purpose")
    p.add_argument("--max-frame-bytes", type=int, default=MAX_FRAME_BYTES, help="bound of one frame")
    p.add_argument("--handshake-timeout-s", type=float, default=10.0,
                   help="a client must finish the handshake within this; the outer bound on an unfinished handshake "
                        "even when nobody needs its slot (default 10)")
    p.add_argument("--idle-timeout-s", type=float, default=30.0, help="drop a client silent this long (clients send heartbeats)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="authenticated connections at once; one more is answered 'full' (default 1024)")
    p.add_argument("--max-pending", type=int, default=128,
                   help="connections in the handshake at once; when full, the oldest unfinished handshake of the busiest "
                        "source address is shed to admit a newcomer, so idle sockets cannot lock clients out (default 128)")
    p.add_argument("--max-pending-per-source", type=int, default=MAX_PENDING_PER_SOURCE,
                   help="connections in the handshake at once from one IPv4 address or IPv6 /64; a newcomer beyond it "
                        f"takes the slot of that address's oldest handshake if that is over {STALE_HANDSHAKE_S:g} s old, "
                        "else it is turned away at once; raise it when many nodes share one NAT address "
                        f"(default {MAX_PENDING_PER_SOURCE})")
    p.add_argument("--max-refusal-delay-s", type=float, default=MAX_REFUSAL_DELAY_S,
                   help="refusals in a row from one address (a wrong relay token) are answered ever later: the first at "
                        f"once, then 1/16 of this, doubling up to it; 0 = never slowed (default {MAX_REFUSAL_DELAY_S:g})")
    p.add_argument("--emulate-delay-ms", type=float, default=0.0, help="EMULATION: one-way delay added to every forwarded byte")
    p.add_argument("--emulate-mbps", type=float, default=0.0, help="EMULATION: per-direction bandwidth cap, 0 = none")
    p.add_argument("--api-port", type=int, default=None,
                   help="accept API clients on this port and pipe each, bytes verbatim, to the server of the run whose rank 0 "
                        "registered it (serve.via_relay=true); 0 = any free port (default: no API port)")
    p.add_argument("--api-host", default=None, help="address of --api-port (default: --host)")
    p.add_argument("--api-session", default=None,
                   help="the run (its transport.session / --rdzv_id) whose API --api-port serves (default: the one run that "
                        "registered an API; needed when several do)")
    p.add_argument("--api-max-connections", type=int, default=256,
                   help="API clients at once; one more is closed at once. Counted apart from --max-connections, with their "
                        "dial-backs: a flood of API clients cannot make a rank link 'full' (default 256)")
    p.add_argument("--no-store", action="store_true", help=argparse.SUPPRESS)  # before issue 43: the relay hosted the store
    p.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                   help="event loop: uvloop when installed (auto), else asyncio's own")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s tandem-relay %(levelname)s %(message)s", stream=sys.stderr)
    if not a.secret_file:
        p.error("--secret-file is required (or set TANDEM_RELAY_TOKEN_FILE)")
    if a.no_store:
        log.warning("--no-store is ignored: the relay never hosts the rendezvous store now (node 0's agent does) and never "
                    "imports torch; drop the flag")
    if a.api_session is not None:
        try:
            auth.check_session(a.api_session)
        except auth.HandshakeError as e:
            p.error(f"--api-session: {e}")
    try:
        secret = auth.load_secret(secret_file=a.secret_file)
    except auth.HandshakeError as e:
        p.error(str(e))
    relay = Relay(secret, a.host, a.port, max_frame_bytes=a.max_frame_bytes, handshake_timeout_s=a.handshake_timeout_s,
                  idle_timeout_s=a.idle_timeout_s, max_connections=a.max_connections, max_pending=a.max_pending,
                  max_pending_per_source=a.max_pending_per_source, emulate_delay_ms=a.emulate_delay_ms, emulate_mbps=a.emulate_mbps,
                  max_refusal_delay_s=a.max_refusal_delay_s, api_port=a.api_port, api_host=a.api_host, api_session=a.api_session,
                  api_max_connections=a.api_max_connections)
    api_fds = 2 * a.api_max_connections if a.api_port is not None else 0  # each API client and its dial-back
    _raise_fd_limit(a.max_connections + a.max_pending + api_fds + 64)
    with asyncio.Runner(loop_factory=_loop_factory(a.loop)) as runner:
        runner.run(_serve(relay, _loop_name(a.loop)))


def _raise_fd_limit(needed: int) -> None:
    """Every connection is a file descriptor; the usual soft limit (1024) is below the defaults' sum, and
    running out would refuse clients with EMFILE before the relay could answer 'full'."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed or soft == resource.RLIM_INFINITY:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        log.warning("only %d file descriptors allowed (hard limit), %d needed for --max-connections + --max-pending; "
                    "raise `ulimit -Hn` or lower those limits", target, needed)


def _loop_factory(choice: str):
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            sys.exit("tandem-relay: --loop uvloop, but uvloop is not installed (pip install uvloop)")
        return None
    return uvloop.new_event_loop


def _loop_name(choice: str) -> str:
    return "uvloop" if _loop_factory(choice) is not None else "asyncio"


async def _serve(relay: Relay, loop_name: str = "asyncio") -> None:
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await relay.start()
    extras = []
    if relay.emulating:
        extras.append(f"EMULATING delay {relay.limits.emulate_delay_ms:g} ms, {relay.limits.emulate_mbps:g} Mbit/s per direction")
    if relay.api_port is not None:
        extras.append(f"API clients on {relay.api_host}:{relay.api_port}")
    extras.append(loop_name)
    print(f"tandem-relay listening on {relay.host}:{relay.port} ({', '.join(extras)})", flush=True)
    await stop
    s = relay.stats
    log.info("stopping: %d accepted, %d refused, %d dropped, %d shed, %d turned away, %d sessions, %d API clients "
             "(%d refused), %.1f MB forwarded, peak RSS %.0f MB", s["accepted"], s["refused"], s["dropped"], s["shed"],
             s["turned_away"], s["sessions"], s["api"], s["api_refused"], s["bytes"] / 1e6, peak_rss_mb())
    print(f"tandem-relay peak RSS {peak_rss_mb():.1f} MB", flush=True)
    await relay.close()
