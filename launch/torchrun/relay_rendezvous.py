"""torchrun rendezvous through the relay: `--rdzv_backend=tandem-relay --rdzv_endpoint=RELAY:PORT`.

Stock c10d makes node rank 0's agent serve the store the other nodes then connect to, so it needs
rank 1 to reach rank 0's host. Here every connection goes out to the relay, authenticated:

1. Each agent dials the relay (role "rendezvous", session = --rdzv_id, its node rank or "any", and
   --nnodes) and waits, sending heartbeats. When all nodes of the run have come, the relay gives each
   its node rank and the token of a fresh TCPStore it started for this run on its own loopback.
2. The agent starts a local store proxy on 127.0.0.1: every connection to it is carried, after the
   same HMAC handshake (role "store", session = token), to that TCPStore on the relay.
3. next_rendezvous() returns a TCPStore client of the proxy. The agent uses it for rank assignment
   and the exit barrier; workers get MASTER_ADDR=127.0.0.1 / MASTER_PORT=<proxy port> with
   TORCHELASTIC_USE_AGENT_STORE=True, so even a worker that builds a store reaches the relay's.

The relay token (the relay's --secret-file) comes from `--rdzv_conf relay_token_file=PATH` or
TANDEM_RELAY_TOKEN_FILE; the nodes' pairing secret is not needed here (the relay never sees it). `--rdzv_conf node_rank=0`
pins a node's rank (give it on every node or on none); `--rdzv_conf join_timeout=SECONDS` bounds the wait
for the other nodes (default 120 s; torchrun passes none of its own). Not elastic: --nnodes=N, not MIN:MAX.
While an agent waits, the relay tells it when a claim for this run is refused (a node with the wrong
token, a node rank given twice): it warns once per distinct notice and names the last in its timeout; and
every 10 s (netbridge.link.WAITING_LINE_S) it says that it still waits, and for what.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from launch.torchrun.rendezvous import FixedGroup
from model_parallel.lines import one_line
from netbridge import auth
from netbridge.link import (RDZV_BODY, RDZV_DONE, LinkClosed, LinkGarbage, LinkSocket, LinkTimeout, NoticeBoard, UnexpectedFrame,
                            WaitingLine)

log = logging.getLogger(__name__)
BACKEND = "tandem-relay"
DEFAULT_PORT = 29400
HEARTBEAT_S = 5.0  # while an agent waits for the others; well inside the relay's --idle-timeout-s (30 s)
# The wait for the other nodes when --rdzv_conf join_timeout is not given: long enough to start torchrun on a
# second host by hand, short enough that a node whose peer never comes says so (c10d's own default is 600 s)
DEFAULT_JOIN_TIMEOUT_S = 120


class StoreProxy:
    """127.0.0.1:<port> here -> (HMAC handshake) -> the run's TCPStore on the relay. One thread per direction."""

    def __init__(self, endpoint: str, secret: bytes, token: str, timeout_s: float):
        self.endpoint, self.secret, self.token, self.timeout_s = endpoint, secret, token, timeout_s
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, name="tandem-store-proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                local, _ = self.listener.accept()
            except OSError:
                return
            try:
                remote = auth.dial(self.endpoint, self.secret, self.token, auth.ROLE_STORE, 0, 0, self.timeout_s,
                                   what=f"the store proxy of run store {self.token}")
            except auth.HandshakeError as e:
                log.error("tandem-relay store proxy: %s", e)
                local.close()
                continue
            remote.settimeout(None)
            local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [local, remote]
            for a, b in ((local, remote), (remote, local)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        for s in [self.listener, *self._socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class RelayRendezvousHandler(FixedGroup):
    backend = BACKEND

    def __init__(self, params: RendezvousParameters):
        if params.min_nodes != params.max_nodes:
            raise RendezvousError(f"--rdzv_backend={BACKEND} is not elastic: give --nnodes=N, not {params.min_nodes}:{params.max_nodes}")
        if not params.endpoint:
            raise RendezvousError(f"--rdzv_backend={BACKEND} needs --rdzv_endpoint=RELAY_HOST:PORT")
        host, port = auth.parse_endpoint(params.endpoint, DEFAULT_PORT)
        self.endpoint = f"{host}:{port}"
        self.run_id = params.run_id
        auth.check_session(self.run_id)
        self.world = params.max_nodes
        node_rank = params.get_as_int("node_rank", None)
        if node_rank is not None and not 0 <= node_rank < self.world:
            raise RendezvousError(f"--rdzv_conf node_rank={node_rank} is not in 0..{self.world - 1}")
        self.node_rank = node_rank
        self.join_timeout_s = float(params.get_as_int("join_timeout", DEFAULT_JOIN_TIMEOUT_S))
        if self.join_timeout_s <= 0:
            raise RendezvousError(f"--rdzv_conf join_timeout={self.join_timeout_s:g} must be a positive number of seconds")
        try:
            self.secret = auth.load_secret(None, params.get("relay_token_file") or os.environ.get("TANDEM_RELAY_TOKEN_FILE"))
        except auth.HandshakeError as e:
            raise RendezvousError(f"{e} (torchrun: --rdzv_conf relay_token_file=PATH or TANDEM_RELAY_TOKEN_FILE)") from None
        self._proxy: StoreProxy | None = None
        self._closed = False
        os.environ.setdefault("TANDEM_RELAY", self.endpoint)  # workers inherit it: transport.relay's default

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"rendezvous of run {self.run_id!r} at {self.endpoint} is closed")
        rank, world, token = self._join()
        if self._proxy is not None:
            self._proxy.close()
        self._proxy = StoreProxy(self.endpoint, self.secret, token, timeout_s=30.0)
        try:
            store = TCPStore("127.0.0.1", self._proxy.port, None, False, timedelta(seconds=self.join_timeout_s))
        except Exception as e:  # noqa: BLE001 - DistStoreError, RuntimeError: all mean the same here
            raise RendezvousConnectionError(f"could not reach the rendezvous store of run {self.run_id!r} through the relay "
                                            f"{self.endpoint} ({one_line(e, 160, first=True)})") from None
        log.info("tandem-relay rendezvous: run %s node rank %d of %d via %s", self.run_id, rank, world, self.endpoint)
        if self.node_rank is not None:
            os.environ["TANDEM_NODE_RANK"] = str(self.node_rank)  # the workers inherit it: their start-up line names it
        return RendezvousInfo(store, rank, world, RendezvousStoreInfo("127.0.0.1", self._proxy.port))

    def _join(self) -> tuple[int, int, str]:
        want = auth.ANY_RANK if self.node_rank is None else self.node_rank
        try:
            sock = auth.dial(self.endpoint, self.secret, self.run_id, auth.ROLE_RDZV, want, self.world,
                             min(self.join_timeout_s, 30.0), what=f"node {'?' if self.node_rank is None else self.node_rank} of run {self.run_id!r}")
        except auth.HandshakeError as e:
            raise RendezvousConnectionError(str(e)) from None
        link = LinkSocket(sock, self.endpoint, send_timeout_s=30.0)
        notices = NoticeBoard(lambda text: log.warning("tandem-relay rendezvous: run %r still waits for its other node(s): %s",
                                                       self.run_id, text))
        waiting = WaitingLine(self._waiting_line)
        try:
            body = link.wait_for(RDZV_DONE, time.monotonic() + self.join_timeout_s, HEARTBEAT_S, on_notice=notices,
                                 still_waiting=waiting)
            if len(body) != RDZV_BODY.size:
                raise UnexpectedFrame(RDZV_DONE)  # a done frame of another layout: another version's relay
        except UnexpectedFrame as e:
            raise RendezvousError(f"the relay at {self.endpoint} sent frame type {e.kind} during the rendezvous; same Tandem version?") from None
        except LinkGarbage as e:
            raise RendezvousError(str(e)) from None
        except LinkTimeout:
            raise RendezvousTimeoutError(self._join_timeout_message(notices)) from None
        except LinkClosed as e:
            raise RendezvousConnectionError(f"the relay at {self.endpoint} closed the rendezvous connection ({e.reason}); check its log") from None
        finally:
            link.close()
        rank, world, token, has_store = RDZV_BODY.unpack(body)
        if not has_store:
            raise RendezvousError(f"the relay at {self.endpoint} could not start the rendezvous store (is torch installed there? see its log)")
        return rank, world, token.decode()

    def _waiting_line(self, waited_s: float) -> None:
        node = "?" if self.node_rank is None else self.node_rank
        log.warning("tandem-relay rendezvous: node %s of run %r waiting at the relay %s for its other node(s) (%.0f s of "
                    "%g s, --rdzv_conf join_timeout); are they started with the same --rdzv_id, --nnodes and relay token?",
                    node, self.run_id, self.endpoint, waited_s, self.join_timeout_s)

    def _join_timeout_message(self, notices: NoticeBoard) -> str:
        missing = f"not all {self.world} nodes of run {self.run_id!r} joined at the relay {self.endpoint} within " \
                  f"{self.join_timeout_s:g} s (--rdzv_conf join_timeout)"
        if notices.last:  # the relay saw the other node and refused it: that, not its absence, is the cause
            return missing + notices.suffix()
        return missing + ": start torchrun on the other node(s) with the same --rdzv_endpoint, --rdzv_id, --nnodes and relay token"

    def shutdown(self) -> bool:
        super().shutdown()
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        return True


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    quiet_exit_barrier()
    return RelayRendezvousHandler(params)


class _ExitBarrierLine(logging.Filter):
    """The run's TCPStore lives in the relay: after a relay restart it is gone, so torchrun's exit barrier
    (after the workers finished, whatever their outcome) fails with a DistNetworkError whose text carries
    a page of C++ frames. The agent logs it with logger.exception; this makes it one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith("Error waiting on exit barrier"):
            error = record.exc_info[1]
            record.msg = ("tandem-relay: torchrun's exit barrier was skipped: the run's store is gone (%s; the relay "
                          "restarted?); the workers' own exit status stands")
            record.args = (type(error).__name__,)
            record.exc_info, record.exc_text = None, None
        return True


def quiet_exit_barrier() -> None:
    """Install _ExitBarrierLine on torchrun's agent logger (once; the agent's process only)."""
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    if not any(isinstance(f, _ExitBarrierLine) for f in agent_log.filters):
        agent_log.addFilter(_ExitBarrierLine())


def torchrun_handler():
    """Entry point of group `torchrun.handlers`: torchrun calls it and registers what it returns."""
    quiet_launcher_exits()
    return create_rdzv_handler


def quiet_launcher_exits() -> None:
    """In torchrun's own process (it loads every `torchrun.handlers` entry point at start, whatever the backend):
    Ctrl-C or SIGTERM ends it with 130 / 143 and no SignalException traceback (the ranks have said why they
    stopped), and a run whose failed ranks all ended 141 (stdout closed: `| head`) ends 141 without its
    ChildFailedError summary. Every other failure keeps torchrun's own report."""
    if getattr(sys.excepthook, "tandem", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        status = launcher_exit_status(value)
        if status is None:
            return previous(kind, value, tb)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # after an uncaught exception Python's own exit status is always 1
    hook.tandem = True
    sys.excepthook = hook
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_not_a_closed_pipe)


def _not_a_closed_pipe(record: logging.LogRecord) -> bool:
    """Drops torchrun's "failed (exitcode: 141) local_rank: 0 ..." line: a reader that left is no failure."""
    return not (str(record.msg).startswith("failed (exitcode: %s)") and record.args and record.args[0] == 128 + signal.SIGPIPE)


def launcher_exit_status(e: BaseException) -> int | None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    if isinstance(e, SignalException):
        return 128 + int(e.sigval)
    closed_pipe = 128 + signal.SIGPIPE
    if isinstance(e, ChildFailedError) and e.failures and all(f.exitcode == closed_pipe for f in e.failures.values()):
        return closed_pipe
    return None
