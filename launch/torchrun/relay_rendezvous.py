"""torchrun rendezvous through the relay: `--rdzv_backend=tandem-relay --rdzv_endpoint=RELAY:PORT`.

Stock c10d makes node rank 0's agent serve the store the other nodes then connect to, so it needs
rank 1 to reach rank 0's host. Here every connection goes out to the relay, authenticated:

1. Each agent dials the relay (role "rendezvous", session = --rdzv_id, its node rank or "any", and
   --nnodes) and waits, sending heartbeats. When all nodes of the run have come, the relay gives each
   its node rank and the token of this round's store.
2. Node rank 0's agent starts a fresh TCPStore on its own 127.0.0.1 (never exposed) and registers it at
   the relay as service `store:<token>` through the dial-back (netbridge.backend). Every other agent
   starts a local store proxy on 127.0.0.1: each connection to it is carried, after the same HMAC
   handshake (role "store", session = token), to the relay, which splices it to a dial-back from node 0,
   connected to that TCPStore. The relay forwards the bytes and never runs a store (nor imports torch).
3. next_rendezvous() returns the store (node 0: the TCPStore itself; the others: a client of their
   proxy). The agent uses it for rank assignment and the exit barrier; workers get MASTER_ADDR=127.0.0.1 /
   MASTER_PORT=<the store's or the proxy's port> with TORCHELASTIC_USE_AGENT_STORE=True.
Each next_rendezvous() (torchrun calls it again after a restart) gets a fresh store; the last round's
store, proxy and registration are closed. The workers get TANDEM_RELAY_ROUND, the round's name: a relay
transport's link session is <session>/<round>, so restarted ranks pair afresh. The store lives as long as node 0's agent: see docs/relay.md.

The relay token (the relay's --secret-file) comes from `--rdzv_conf relay_token_file=PATH` or
TANDEM_RELAY_TOKEN_FILE; the nodes' pairing secret is not needed here (the relay never sees it). `--rdzv_conf node_rank=0`
pins a node's rank (give it on every node or on none); `--rdzv_conf join_timeout=SECONDS` bounds the wait
for the other nodes (default 120 s; torchrun passes none of its own). Not elastic: --nnodes=N, not MIN:MAX.
While an agent waits, the relay tells it when a claim for this run is refused (a node with the wrong
token, a node rank given twice): it warns once per distinct notice and names the last in its timeout; and
every 10 s (netbridge.link.WAITING_LINE_S) it says that it still waits, and for what.
"""
from __future__ import annotations

import hashlib
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
from netbridge.backend import Backend, serve_through_relay, shut, store_service
from netbridge.link import (RDZV_BODY, RDZV_DONE, STORE_AT_NODE0, LinkClosed, LinkGarbage, LinkSocket, LinkTimeout, NoticeBoard,
                            UnexpectedFrame, WaitingLine)

log = logging.getLogger(__name__)
BACKEND = "tandem-relay"
DEFAULT_PORT = 29400
HEARTBEAT_S = 5.0  # while an agent waits for the others; well inside the relay's --idle-timeout-s (30 s)
# The wait for the other nodes when --rdzv_conf join_timeout is not given: long enough to start torchrun on a
# second host by hand, short enough that a node whose peer never comes says so (c10d's own default is 600 s)
DEFAULT_JOIN_TIMEOUT_S = 120
EXIT_LINGER_S = 10.0  # node 0's store waits this long at most, at the run's end, for the other agents to hang up


# Set in the workers' environment: this rendezvous round's name, the same on every node of the round (a node that
# replaces a lost one, with its torchrun's restart count at 0, gets it too) and new each round, so the ranks of a
# restart pair in a relay session of their own, never with the old attempt's ends (launch/transport.py)
ROUND_ENV = "TANDEM_RELAY_ROUND"


def round_name(token: str) -> str:
    """A digest of the round's store token: alike on every node, and the token itself stays out of session ids."""
    return hashlib.sha256(token.encode()).hexdigest()[:8]


class StoreProxy:
    """127.0.0.1:<port> here -> (HMAC handshake) -> the relay -> node 0's TCPStore, one StorePipe a connection."""

    def __init__(self, endpoint: str, secret: bytes, token: str, timeout_s: float):
        self.endpoint, self.secret, self.token, self.timeout_s = endpoint, secret, token, timeout_s
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self._pipes: list[StorePipe] = []
        self._closed = False
        threading.Thread(target=self._accept, name="tandem-store-proxy", daemon=True).start()

    def _dial(self) -> socket.socket:
        remote = auth.dial(self.endpoint, self.secret, self.token, auth.ROLE_STORE, 0, 0, self.timeout_s,
                           what=f"the store proxy of run store {self.token}")
        remote.settimeout(None)
        return remote

    def _accept(self) -> None:
        while not self._closed:
            try:
                local, _ = self.listener.accept()
            except OSError:
                return
            try:
                self._pipes.append(StorePipe(local, self._dial, STORE_RESUME_S))
            except auth.HandshakeError as e:
                log.error("tandem-relay store proxy: %s", e)
                local.close()

    def close(self) -> None:
        self._closed = True
        shut(self.listener)
        self.listener.close()
        for pipe in self._pipes:
            pipe.close()


# A store connection whose relay leg broke is dialed again for this long: the relay restarting (2 s down, node 0
# re-registering its store within its backoff) is survived; node 0's store gone ends it after this.
STORE_RESUME_S = 20.0


class StorePipe:
    """One local store connection carried to node 0's store. When the relay leg breaks (a relay restart), it is
    dialed again and the local connection goes on: torchrun's agent keeps one store connection for the whole run
    and a TCPStore client never reconnects, so otherwise the exit barrier would fail here while node 0's agent,
    whose store lives on, waited 300 s (torch's exit_barrier_timeout) for this node. The store serves a new
    connection only after the client's opening (TCPStore's validation and ping): the bytes the client sent before
    the store first answered are sent again on the new leg and the answer, as long as the first, is dropped; no
    other byte is read or kept. A request crossing at the moment of the break is lost (its caller times out);
    the agent's store is idle while the workers run."""

    def __init__(self, local: socket.socket, dial, resume_s: float):
        self.local, self.dial, self.resume_s = local, dial, resume_s
        self.remote = dial()
        self.lock = threading.Lock()  # held while the relay leg is replaced, and for the opening's bookkeeping
        self.ended = threading.Event()
        self.opening, self.opening_answer = bytearray(), bytearray()
        self.opened = False  # the client spoke again after the store's first answer: the opening is complete
        local.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._up, name="tandem-store-pipe", daemon=True).start()
        threading.Thread(target=self._down, name="tandem-store-pipe", daemon=True).start()

    def _up(self) -> None:
        """local -> relay: a send that fails is repeated on the next relay leg."""
        while (data := _recv(self.local)):
            with self.lock:
                if not self.opening_answer:
                    self.opening += data
                else:
                    self.opened = True
            while (remote := self._current()) is not None:
                try:
                    remote.sendall(data)
                    break
                except OSError:
                    self._lost(remote)
        self.close()

    def _down(self) -> None:
        """relay -> local; a relay leg that ends is replaced."""
        while (remote := self._current()) is not None:
            data = _recv(remote)
            if not data:
                self._lost(remote)
                continue
            with self.lock:
                if not self.opened:
                    self.opening_answer += data
            try:
                self.local.sendall(data)
            except OSError:
                break
        self.close()

    def _current(self) -> socket.socket | None:
        with self.lock:
            return None if self.ended.is_set() else self.remote

    def _lost(self, remote: socket.socket) -> None:
        """`remote` broke: dial again (once, whichever direction noticed first) until resume_s, else close."""
        with self.lock:
            if self.ended.is_set() or self.remote is not remote:
                return
            shut(remote)
            deadline = time.monotonic() + self.resume_s
            while self.opened and not self.ended.is_set() and time.monotonic() < deadline:
                try:
                    self.remote = self._reopen(self.dial())
                    log.warning("tandem-relay store proxy: the relay leg to node 0's store broke; dialed again")
                    return
                except (auth.HandshakeError, OSError):
                    self.ended.wait(0.5)
        self.close()

    def _reopen(self, remote: socket.socket) -> socket.socket:
        """The client's opening on a new leg, the store's answer to it dropped."""
        remote.settimeout(10.0)
        try:
            remote.sendall(self.opening)
            left = len(self.opening_answer)
            while left:
                got = remote.recv(left)
                if not got:
                    raise OSError("closed during the opening")
                left -= len(got)
        except OSError:
            shut(remote)
            raise
        remote.settimeout(None)
        return remote

    def close(self) -> None:
        """Not under the lock: a pipe dialing again ends at once."""
        self.ended.set()
        shut(self.local)
        shut(self.remote)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


class NodeStore:
    """Node rank 0's store of one round: a TCPStore on this host's loopback (the world reaches it only through
    the relay's handshake), registered at the relay for the other nodes' proxies."""

    def __init__(self, endpoint: str, secret: bytes, token: str, timeout_s: float):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))  # TCPStore alone would listen on every interface
        listener.listen(64)
        self.port = listener.getsockname()[1]
        try:
            self.store = TCPStore("127.0.0.1", self.port, None, True, timedelta(seconds=timeout_s),
                                  wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now and closes it when it goes
        self.backend: Backend = serve_through_relay(endpoint, secret, store_service(token), ("127.0.0.1", self.port))

    def close(self, linger_s: float = 0.0) -> None:
        """`linger_s`: at the run's end, first wait (that long at most) for the other nodes' agents to hang up:
        torchrun's exit barrier returns here as soon as the last node checks in, and a store closed at once
        would cut the others' barrier wait short (a DistNetworkError and a page of C++ frames on their side)."""
        self.backend.drain(linger_s)
        self.backend.close()
        del self.store


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
        self._node_store: NodeStore | None = None
        self._closed = False
        os.environ.setdefault("TANDEM_RELAY", self.endpoint)  # workers inherit it: transport.relay's default

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"rendezvous of run {self.run_id!r} at {self.endpoint} is closed")
        rank, world, token = self._join()
        self._close_round()
        try:
            store, port = self._open_store(rank, token)
        except Exception as e:  # noqa: BLE001 - DistStoreError, RuntimeError: all mean the same here
            where = "start the rendezvous store" if rank == 0 else "reach the rendezvous store on node 0"
            raise RendezvousConnectionError(f"could not {where} of run {self.run_id!r} through the relay {self.endpoint} "
                                            f"({one_line(e, 160, first=True)})") from None
        log.info("tandem-relay rendezvous: run %s node rank %d of %d via %s", self.run_id, rank, world, self.endpoint)
        os.environ[ROUND_ENV] = round_name(token)  # the workers inherit it: launch/transport.py's link session
        if self.node_rank is not None:
            os.environ["TANDEM_NODE_RANK"] = str(self.node_rank)  # the workers inherit it: their start-up line names it
        return RendezvousInfo(store, rank, world, RendezvousStoreInfo("127.0.0.1", port))

    def _open_store(self, rank: int, token: str) -> tuple[TCPStore, int]:
        """This round's store and its port on 127.0.0.1: node 0 hosts it, the others reach it through a proxy."""
        if rank == 0:
            self._node_store = NodeStore(self.endpoint, self.secret, token, self.join_timeout_s)
            return self._node_store.store, self._node_store.port
        self._proxy = StoreProxy(self.endpoint, self.secret, token, timeout_s=30.0)
        return TCPStore("127.0.0.1", self._proxy.port, None, False, timedelta(seconds=self.join_timeout_s)), self._proxy.port

    def _close_round(self, linger_s: float = 0.0) -> None:
        """The last round's store (node 0) or proxy: a new round has a fresh one."""
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
        if self._node_store is not None:
            self._node_store.close(linger_s)
            self._node_store = None

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
        rank, world, token, store_at = RDZV_BODY.unpack(body)
        if store_at != STORE_AT_NODE0:
            raise RendezvousError(f"the relay at {self.endpoint} is an older Tandem version (it hosts the rendezvous store "
                                  "itself); upgrade it to this version")
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
        self._close_round(linger_s=EXIT_LINGER_S)
        return True


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    quiet_exit_barrier()
    return RelayRendezvousHandler(params)


class _ExitBarrierLine(logging.Filter):
    """The run's TCPStore lives in node 0's agent, reached through the relay: when node 0's agent has gone (or
    the relay is down), torchrun's exit barrier (after the workers finished, whatever their outcome) fails
    with a DistNetworkError whose text carries a page of C++ frames. The agent logs it with
    logger.exception; this makes it one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith("Error waiting on exit barrier"):
            error = record.exc_info[1]
            record.msg = ("tandem-relay: torchrun's exit barrier was skipped: the run's store is out of reach (%s; node "
                          "0's agent ended, or the relay is down?); the workers' own exit status stands")
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
    from launch.torchrun.restarts import used_up_line
    line = used_up_line(e, sys.argv[1:])
    if line is not None:  # the ranks said why; what is left to say is that torchrun will not start them again
        sys.stderr.write(line + "\n")
        return 1
    return None
