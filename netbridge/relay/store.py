"""The store proxy: each finished rendezvous gets a c10d TCPStore on the relay's loopback, and the run's
processes reach it through the relay (role "store"): after the handshake, a byte pipe, verbatim both ways.
The store listens on loopback only, so the world reaches it only through the handshake.

torch.distributed is imported only here, and only when a store is made.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

from netbridge import auth

Client = Any  # the relay's connection of a store pipe: .session read; .tell, .drop, .throttle, .close_soon called

log = logging.getLogger("tandem.relay")

STORE_GRACE_S = 120.0  # a run's store lives this long after its last connection closed


class _Store:
    def __init__(self, store, port: int):
        self.store, self.port = store, port
        self.conns = 0
        self.idle_since = time.monotonic()


class Stores:
    """The rendezvous stores by token, with how many pipes each has open; idle ones are dropped."""

    def __init__(self):
        self.by_token: dict[str, _Store] = {}

    def make(self, token: str) -> None:
        from datetime import timedelta

        import torch.distributed as dist
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))  # loopback only: the world reaches it through the handshake
        listener.listen(64)
        port = listener.getsockname()[1]
        try:
            store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                                  wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now and closes it when it goes
        self.by_token[token] = _Store(store, port)

    def drop(self, token: str) -> None:
        st = self.by_token.pop(token, None)
        if st is not None:
            del st.store
            log.info("store %s: dropped", token)

    def admit(self, conn: Client) -> int:
        st = self.by_token.get(conn.session)
        if st is None:
            return auth.UNKNOWN
        st.conns += 1
        return auth.OK

    def port_of(self, token: str) -> int:
        """Where the store of `token` listens (on loopback), for a store pipe admitted to it."""
        return self.by_token[token].port

    def leave(self, conn: Client) -> None:
        st = self.by_token.get(conn.session)
        if st is not None:
            st.conns -= 1
            st.idle_since = time.monotonic()

    def sweep(self, now: float) -> None:
        for token, st in list(self.by_token.items()):
            if st.conns == 0 and now - st.idle_since > STORE_GRACE_S:
                self.drop(token)

    def close(self) -> None:
        for token in list(self.by_token):
            self.drop(token)


class StoreProxy:
    """One store connection's pipe to its store. Until the pipe is up the client's bytes are kept and the
    client is not read further; once up, either side's full buffer pauses the other (backpressure)."""

    def __init__(self, client: Client):
        self.client = client
        self.upstream = None  # the transport to the store, once connected
        self.backlog: list = []

    async def open(self, port: int) -> None:
        client = self.client
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(lambda: _StorePipe(client), "127.0.0.1", port)
        except OSError as e:
            client.drop(f"cannot connect to store on 127.0.0.1:{port} ({e})")
            return
        if client.state != "store":  # the client left while we connected
            transport.close()
            return
        self.upstream = transport
        for data in self.backlog:
            transport.write(data)
        self.backlog.clear()
        client.throttle("store-connect", False)

    def from_client(self, data: bytes) -> None:
        if self.upstream is not None:
            self.upstream.write(data)
        else:
            self.backlog.append(data)
            self.client.throttle("store-connect", True)

    def pause_reading(self) -> None:  # the client does not read what the store sends: stop reading the store
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_reading(self) -> None:
        if self.upstream is not None:
            self.upstream.resume_reading()

    def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()


class _StorePipe(asyncio.Protocol):
    """The relay's side of a store pipe: bytes from the TCPStore go back to the client."""

    def __init__(self, client: Client):
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.tell(data)

    def connection_lost(self, exc) -> None:
        self.client.close_soon()
