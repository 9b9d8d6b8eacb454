"""torchrun rendezvous for hosts that reach each other (gloo): `--rdzv_backend=tandem --rdzv_endpoint=HOST0:PORT
--rdzv_conf node_rank=R`. Each host becomes the node rank its user names.

Why not torchrun's own backends: c10d ignores --node_rank and numbers the nodes by sorting their host names
and process ids, so which host runs rank 0 (the drafter, the answer) depends on their names; static honours
--node_rank but takes any claim as it comes: two hosts both saying R=1 start two rank-1 workers and hang in
gloo, an R out of range is never checked, and a host whose peer never comes waits 15 minutes by default.

Here, as with the relay's backend (launch/torchrun/relay_rendezvous.py), `--rdzv_conf node_rank=R` is the node's rank:
node rank 0's agent serves a TCPStore at HOST0:PORT (as static does, so the workers' store is the same one),
every node claims its rank there (compare-and-set: a second claim is refused), and all wait, polling, until
every rank is claimed, a claim is refused (every node then stops with that line), or `--rdzv_conf
join_timeout=SECONDS` (default 120 s) passes, naming the node ranks that never came.
"""
from __future__ import annotations

import os
import socket
import time
import uuid
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
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

from model_parallel.lines import one_line

BACKEND = "tandem"
DEFAULT_PORT = 29400
DEFAULT_JOIN_TIMEOUT_S = 120  # as the relay's backend: long enough to start a second host by hand
POLL_S = 0.2
OUTCOME_KEY = "tandem/rendezvous-outcome"  # COMPLETE, or the line every node stops with
JOINED_KEY, HEARD_KEY = "tandem/joined", "tandem/heard"  # nodes that reached the store / that read a refusal
LINGER_S = 5.0  # how long node rank 0 keeps the store up after a refusal, for every node to read it
COMPLETE = "complete"


def _node_key(rank: int) -> str:
    return f"tandem/node/{rank}"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", str(DEFAULT_PORT))
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(f"--rdzv_endpoint={endpoint!r} is not HOST:PORT (the address of node rank 0's host)")
    return host.strip("[]"), int(port)


class FixedGroup(RendezvousHandler):
    """What torchrun asks of a rendezvous beyond meeting, for a fixed group of nodes (--nnodes=N, not elastic):
    the same for Tandem's two backends (this one and launch/torchrun/relay_rendezvous.py's)."""
    backend = ""
    run_id = ""
    _closed = False

    def get_backend(self) -> str:
        return self.backend

    @property
    def use_agent_store(self) -> bool:
        return True

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # a fixed group: nobody waits to be admitted

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


class NodeRankRendezvous(FixedGroup):
    backend = BACKEND

    def __init__(self, params: RendezvousParameters):
        if params.min_nodes != params.max_nodes:
            raise RendezvousError(f"--rdzv_backend={BACKEND} is not elastic: give --nnodes=N, not {params.min_nodes}:{params.max_nodes}")
        if not params.endpoint:
            raise RendezvousError(f"--rdzv_backend={BACKEND} needs --rdzv_endpoint=HOST0:PORT (node rank 0's host)")
        self.host, self.port = parse_endpoint(params.endpoint)
        self.world = params.max_nodes
        self.run_id = params.run_id
        node_rank = params.get_as_int("node_rank", None)
        if node_rank is None:
            raise RendezvousError(f"--rdzv_backend={BACKEND} needs --rdzv_conf node_rank=R on every host (0..{self.world - 1}; "
                                  "0 on the host that runs the drafter and prints the answer)")
        self.node_rank = node_rank
        self.join_timeout_s = float(params.get_as_int("join_timeout", DEFAULT_JOIN_TIMEOUT_S))
        if self.join_timeout_s <= 0:
            raise RendezvousError(f"--rdzv_conf join_timeout={self.join_timeout_s:g} must be a positive number of seconds")
        self.me = f"{socket.gethostname()} (pid {os.getpid()})"
        self.claim = f"{self.me}#{uuid.uuid4().hex}"  # unique even for two handlers in one process
        self._store: TCPStore | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return self._meet()
        except RendezvousError as e:
            # torchrun would print its agent's traceback around the cause; the cause alone is the line to read
            raise SystemExit(f"[rendezvous: {e}]") from None

    def _meet(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"rendezvous of run {self.run_id!r} at {self.host}:{self.port} is closed")
        deadline = time.monotonic() + self.join_timeout_s
        store = self._open_store(deadline)
        store.add(JOINED_KEY, 1)
        try:
            return self._claim_and_wait(store, deadline)
        except RendezvousError:
            self._heard(store)
            raise

    def _claim_and_wait(self, store: TCPStore, deadline: float) -> RendezvousInfo:
        if not 0 <= self.node_rank < self.world:
            message = (f"--rdzv_conf node_rank={self.node_rank} on {self.me} is not in 0..{self.world - 1} "
                       f"(--nnodes={self.world}): give each host its own node rank")
            self._decide(store, message)
            raise RendezvousError(message)
        self._claim(store)
        self._wait_for_all(store, deadline)
        os.environ["TANDEM_NODE_RANK"] = str(self.node_rank)  # the workers inherit it: their start-up line names it
        return RendezvousInfo(PrefixStore(self.run_id, store), self.node_rank, self.world,
                              RendezvousStoreInfo(self.host, self.port))

    def _open_store(self, deadline: float) -> TCPStore:
        """Node rank 0 serves the store on PORT; the others dial it until join_timeout."""
        is_server = self.node_rank == 0
        if not is_server:
            self._wait_for_server(deadline)
        try:
            store = TCPStore(self.host, self.port, None, is_server, timedelta(seconds=self.join_timeout_s),
                             wait_for_workers=False, multi_tenant=True)
        except Exception as e:  # noqa: BLE001 - DistNetworkError, DistStoreError, RuntimeError: one cause each way
            detail = one_line(e, 160, first=True)
            if is_server:
                raise RendezvousConnectionError(f"node rank 0 could not serve the rendezvous on port {self.port} ({detail}): "
                                                "is another torchrun with node_rank=0 already running on this host? "
                                                "pick a free port in --rdzv_endpoint on every host") from None
            raise RendezvousConnectionError(f"node rank {self.node_rank} could not join node rank 0's rendezvous at "
                                            f"{self.host}:{self.port} ({detail})") from None
        self._store = store
        return store

    def _wait_for_server(self, deadline: float) -> None:
        """Until node rank 0's port answers: plain TCP connects, since a TCPStore client that retries backs off for
        seconds at a time and prints a page of C++ frames at each try."""
        while True:
            try:
                socket.create_connection((self.host, self.port), timeout=min(2.0, self.join_timeout_s)).close()
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RendezvousTimeoutError(
                        f"node rank {self.node_rank} could not reach node rank 0's rendezvous at {self.host}:{self.port} "
                        f"within {self.join_timeout_s:g} s (--rdzv_conf join_timeout; {e.strerror or e}): start torchrun "
                        "with node_rank=0 on that host, and check the address and that the port is open") from None
            time.sleep(POLL_S)

    def _claim(self, store: TCPStore) -> None:
        holder = store.compare_set(_node_key(self.node_rank), "", self.claim).decode()
        if holder != self.claim:
            holder = holder.partition("#")[0]
            message = (f"two hosts claim --rdzv_conf node_rank={self.node_rank}: {holder} and {self.me}; give each host "
                       f"its own node rank 0..{self.world - 1} and start again")
            if self._decide(store, message) != message:  # the others had all met already: they go on without this host
                message += f" (the launch went on with {holder})"
            raise RendezvousError(message)

    def _heard(self, store: TCPStore) -> None:
        """A refusal was read here. Node rank 0 serves the store: it stays until every node that joined has read it."""
        try:
            store.add(HEARD_KEY, 1)
            until = time.monotonic() + LINGER_S
            while self.node_rank == 0 and time.monotonic() < until and store.add(HEARD_KEY, 0) < store.add(JOINED_KEY, 0):
                time.sleep(POLL_S)
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to tell
            pass

    def _decide(self, store: TCPStore, outcome: str) -> str:
        """The rendezvous's one outcome, COMPLETE or a refusal: the first to set it wins, so every node acts on the
        same one (a duplicate claim that comes after all met cannot stop the others halfway)."""
        return store.compare_set(OUTCOME_KEY, "", outcome).decode()

    def _wait_for_all(self, store: TCPStore, deadline: float) -> None:
        """Node rank 0 decides COMPLETE once every rank is claimed; every node waits for the outcome."""
        keys = [_node_key(r) for r in range(self.world)]
        while True:
            try:
                if self.node_rank == 0 and store.check(keys):
                    self._decide(store, COMPLETE)
                outcome = store.get(OUTCOME_KEY).decode() if store.check([OUTCOME_KEY]) else None
                late = outcome is None and time.monotonic() > deadline
                missing = [str(r) for r, key in enumerate(keys) if late and not store.check([key])]
            except Exception:  # noqa: BLE001 - the store's host went away mid-rendezvous
                raise RendezvousConnectionError(f"node rank 0's host {self.host}:{self.port} left the rendezvous; its own "
                                                "line says why") from None
            if outcome == COMPLETE:
                return
            if outcome is not None:
                raise RendezvousError(outcome)
            if late:
                raise RendezvousTimeoutError(
                    f"not all {self.world} nodes joined the rendezvous at {self.host}:{self.port} within "
                    f"{self.join_timeout_s:g} s (--rdzv_conf join_timeout): node rank {', '.join(missing)} never came; "
                    "start torchrun there with the same --rdzv_endpoint and --nnodes")
            time.sleep(POLL_S)


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    try:
        return NodeRankRendezvous(params)
    except RendezvousError as e:  # a bad --rdzv_* option: its line, not torchrun's traceback
        raise SystemExit(f"[rendezvous: {e}]") from None


def torchrun_handler():
    """Entry point of group `torchrun.handlers`: torchrun calls it and registers what it returns."""
    return create_rdzv_handler
