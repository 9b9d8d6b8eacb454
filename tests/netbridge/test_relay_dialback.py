"""The relay's dial-back (issue 43), in process on loopback: a service registered with netbridge.backend gets its
clients' connections spliced to its target, bytes verbatim both ways; a client of a service nobody registered is
closed with a log line; --api-max-connections bounds API clients (idle ones shed for an honest one), and neither
they nor their dial-backs count against --max-connections (rank links); TLS through it leaves the relay ciphertext
only; a registered service and node 0's rendezvous store outlive a relay restart."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from netbridge import auth
from netbridge.backend import serve_through_relay
from netbridge.relay.services import store_service
from tests.support.relay_harness import TOKEN, closed_by_peer, dial_raw, read_link, recv_exact, relay_in_thread

PAYLOAD = bytes(range(256)) * 64 + os.urandom(200_000)  # every byte value, and more than one socket read


@contextmanager
def target_server(reply: bytes):
    """A TCP server on loopback: each connection's bytes are recorded (until the client has sent len(PAYLOAD)),
    then `reply` is sent and the connection closed."""
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def handle(conn: socket.socket) -> None:
        with conn:
            got.append(recv_exact(conn, len(PAYLOAD)) or b"")
            conn.sendall(reply)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[:2], got
    finally:
        listener.close()


def registered(relay, service: str, target) -> object:
    backend = serve_through_relay(f"127.0.0.1:{relay.port}", TOKEN, service, target, dial_timeout_s=5)
    assert backend.registered.wait(5), f"{service} did not register"
    return backend


def read_all(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    sock.settimeout(timeout_s)
    out = bytearray()
    while chunk := sock.recv(65536):
        out += chunk
    return bytes(out)


def test_an_api_client_is_spliced_to_the_registered_service_bytes_verbatim_both_ways():
    reply = os.urandom(300_000)
    with relay_in_thread(api_port=0) as relay, target_server(reply) as (target, got):
        backend = registered(relay, "api:run-a", target)
        try:
            with socket.create_connection(("127.0.0.1", relay.api_port), timeout=10) as client:
                client.sendall(PAYLOAD)
                answer = read_all(client)
            assert got == [PAYLOAD]  # client -> service, exactly
            assert answer == reply  # service -> client, exactly
            assert backend.spliced == 1
        finally:
            backend.close()


def test_a_store_pipe_waits_for_node_0_to_register_its_store_then_is_spliced():
    """The rendezvous gives the token before node 0's store is registered: a store pipe that comes first waits."""
    reply = b"store answer"
    with relay_in_thread() as relay, target_server(reply) as (target, got):
        relay.loop.call_soon_threadsafe(relay.services.expect, store_service("0123abcd"), time.monotonic() + 30)
        time.sleep(0.1)
        pipe = auth.dial(f"127.0.0.1:{relay.port}", TOKEN, "0123abcd", auth.ROLE_STORE, 0, 0, 5)
        pipe.sendall(PAYLOAD)  # held at the relay (one read) until the dial-back joins
        time.sleep(0.3)
        backend = registered(relay, store_service("0123abcd"), target)
        try:
            assert read_all(pipe) == reply and got == [PAYLOAD]
        finally:
            pipe.close()
            backend.close()
        with pytest.raises(auth.HandshakeError, match="knows no 'ffff0000'"):  # a token no rendezvous gave
            auth.dial(f"127.0.0.1:{relay.port}", TOKEN, "ffff0000", auth.ROLE_STORE, 0, 0, 5)


def test_an_api_client_with_nobody_registered_is_closed_with_a_log_line(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.relay"), relay_in_thread(api_port=0, handshake_timeout_s=10) as relay:
        with socket.create_connection(("127.0.0.1", relay.api_port), timeout=5) as client:
            client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert closed_by_peer(client, 2)  # at once, not at the first-bytes deadline (10 s)
        time.sleep(0.1)
    assert "no run registered an API here (serve.via_relay=true on its rank 0)" in caplog.text


def test_a_client_whose_service_never_dials_back_is_closed_after_the_timeout(caplog):
    """A control connection that ignores DIAL (its process hangs): the client is not held forever."""
    with caplog.at_level(logging.WARNING, logger="tandem.relay"), relay_in_thread(api_port=0, dial_back_timeout_s=0.5) as relay:
        control = auth.dial(f"127.0.0.1:{relay.port}", TOKEN, "api:hung", auth.ROLE_SERVICE, 0, 0, 5)
        try:
            time.sleep(0.1)
            with socket.create_connection(("127.0.0.1", relay.api_port), timeout=5) as client:
                client.sendall(b"hello")
                t0 = time.monotonic()
                assert read_link(control, 5)[0] == 7  # DIAL came
                assert closed_by_peer(client, 5)
                assert 0.3 < time.monotonic() - t0 < 3
        finally:
            control.close()
    assert "no dial-back from service api:hung within 0.5 s" in caplog.text


def test_api_clients_are_capped_apart_and_never_make_a_rank_link_full(caplog):
    """--api-max-connections=3 and --max-connections=3: three API clients spliced (three dial-backs at the relay),
    a fourth closed at once with a line; the two ranks of a session still pair."""
    with caplog.at_level(logging.WARNING, logger="tandem.relay"), \
            relay_in_thread(api_port=0, api_max_connections=3, max_connections=3) as relay, \
            target_server(b"ok") as (target, _got):
        backend = registered(relay, "api:capped", target)  # its control connection: 1 of 3 --max-connections
        clients = []
        try:
            for _ in range(3):
                c = socket.create_connection(("127.0.0.1", relay.api_port), timeout=5)
                c.sendall(b"x")  # each gets its dial-back
                clients.append(c)
            deadline = time.monotonic() + 5
            while backend.spliced < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert backend.spliced == 3
            with socket.create_connection(("127.0.0.1", relay.api_port), timeout=5) as fourth:
                assert closed_by_peer(fourth, 2)
            r0 = dial_raw(f"127.0.0.1:{relay.port}", "ranks", 0)  # 2 of 3
            r1 = dial_raw(f"127.0.0.1:{relay.port}", "ranks", 1)  # 3 of 3: FULL if the dial-backs counted
            assert read_link(r1) == (3, b"")  # PAIRED
            r0.close()
            r1.close()
        finally:
            for c in clients:
                c.close()
            backend.close()
    assert "--api-max-connections (3) API clients are open" in caplog.text


def test_a_stream_goes_through_piece_by_piece_without_buffering():
    """Server-sent events: each piece must reach the client before the server sends the next (here the server
    waits for the client's ack of each piece, so any buffering at the relay or the backend would stall it)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_events() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(100)  # the request
            for i in range(20):
                conn.sendall(f"data: {i}\n\n".encode())
                if conn.recv(1) != b"a":  # the client's ack of this event
                    return
    threading.Thread(target=serve_events, daemon=True).start()
    with relay_in_thread(api_port=0) as relay:
        backend = registered(relay, "api:sse", listener.getsockname()[:2])
        try:
            with socket.create_connection(("127.0.0.1", relay.api_port), timeout=5) as client:
                client.sendall(b"POST /v1/chat/completions")
                for i in range(20):
                    event = f"data: {i}\n\n".encode()
                    assert recv_exact(client, len(event)) == event
                    client.sendall(b"a")
        finally:
            backend.close()
            listener.close()


def test_a_service_registers_again_with_a_restarted_relay():
    """Node 0's store must outlive a relay restart: its process notices the relay gone and registers again."""
    with target_server(b"after restart") as (target, got):
        with relay_in_thread() as first:
            port = first.port
            backend = registered(first, store_service("feed0001"), target)
        try:
            deadline = time.monotonic() + 5
            while backend.registered.is_set() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not backend.registered.is_set(), "the backend did not notice the relay had gone"
            with relay_in_thread(port=port) as second:
                assert backend.registered.wait(10), "the backend did not register with the restarted relay"
                pipe = auth.dial(f"127.0.0.1:{second.port}", TOKEN, "feed0001", auth.ROLE_STORE, 0, 0, 5)
                pipe.sendall(PAYLOAD)
                assert read_all(pipe) == b"after restart" and got == [PAYLOAD]
                pipe.close()
        finally:
            backend.close()


def test_the_rendezvous_store_on_node_0_outlives_a_relay_restart():
    """torchrun's agent keeps one store connection for the whole run and a TCPStore client never reconnects: node
    1's proxy dials the relay again behind it, so after a relay restart the same client reaches node 0's store."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from launch.torchrun.relay_rendezvous import NodeStore, StoreProxy
    with relay_in_thread() as first:
        port, endpoint = first.port, f"127.0.0.1:{first.port}"
        node0 = NodeStore(endpoint, TOKEN, "cafe0002", timeout_s=10)  # what node rank 0's agent starts
        assert node0.backend.registered.wait(5)
        proxy = StoreProxy(endpoint, TOKEN, "cafe0002", timeout_s=5)  # node 1's
        client = TCPStore("127.0.0.1", proxy.port, None, False, timedelta(seconds=10))
        client.set("before", "1")
        assert node0.store.get("before") == b"1"
    try:
        with relay_in_thread(port=port):
            assert node0.backend.registered.wait(10)
            client.set("after", "2")  # the same client, its relay leg dialed again
            assert node0.store.get("after") == b"2" and client.get("before") == b"1"
    finally:
        proxy.close()
        node0.close()


def self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files), as serve.ssl_certfile / serve.ssl_keyfile take them."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def test_with_tls_the_relay_forwards_only_ciphertext(tmp_path, monkeypatch):
    """From the relay's seat: every byte it splices, recorded, holds neither the request, the API key nor the
    answer, while the client, verifying rank 0's certificate through the relay, gets the answer."""
    import ssl

    from netbridge.relay.services import Splice
    seen = bytearray()
    received = Splice.received
    monkeypatch.setattr(Splice, "received", lambda self, side, data: (seen.extend(data), received(self, side, data))[1])
    cert, key = self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    request, answer = b"POST /v1/chat Authorization: Bearer secret-api-key-42", b"the answer: 42 secret tokens"

    def serve() -> None:
        conn, _ = listener.accept()
        with server_tls.wrap_socket(conn, server_side=True) as tls:
            if recv_exact(tls, len(request)) == request:
                tls.sendall(answer)
    threading.Thread(target=serve, daemon=True).start()
    with relay_in_thread(api_port=0) as relay:
        backend = registered(relay, "api:tls", listener.getsockname()[:2])
        try:
            client_tls = ssl.create_default_context(cafile=cert)
            with client_tls.wrap_socket(socket.create_connection(("127.0.0.1", relay.api_port), timeout=5),
                                        server_hostname="127.0.0.1") as client:
                client.sendall(request)
                assert recv_exact(client, len(answer)) == answer
        finally:
            backend.close()
            listener.close()
    assert len(seen) > len(request) + len(answer)  # the handshake and the records crossed the relay
    for secret in (request, b"secret-api-key-42", answer, b"42 secret"):
        assert secret not in seen


def test_idle_api_sockets_from_a_flooder_are_shed_for_an_honest_client(caplog):
    """--api-max-connections=3 held by idle sockets from 127.0.0.2: a client from 127.0.0.1 still gets its answer
    (the oldest idle socket of the busiest source is shed), as the relay's handshake table does."""
    with relay_in_thread(api_port=0, api_max_connections=3, handshake_timeout_s=10) as relay, \
            target_server(b"served") as (target, got):
        backend = registered(relay, "api:shed", target)
        idle = [socket.create_connection(("127.0.0.1", relay.api_port), timeout=5, source_address=("127.0.0.2", 0))
                for _ in range(3)]
        try:
            time.sleep(0.2)
            with socket.create_connection(("127.0.0.1", relay.api_port), timeout=5) as client:
                client.sendall(PAYLOAD)
                assert read_all(client) == b"served" and got == [PAYLOAD]
            assert closed_by_peer(idle[0], 2)  # the oldest idle one made room
        finally:
            for s in idle:
                s.close()
            backend.close()
