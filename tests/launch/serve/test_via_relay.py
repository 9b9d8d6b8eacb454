"""serve.via_relay (issue 43): the settings it needs are refused in one line when missing (an exposed API needs a
key; TLS files come in pairs), and register_api registers rank 0's port at the relay as the run's API service, so
a client on the relay's --api-port reaches it. The whole launch through the relay is tests/netbridge/test_netns_relay.py."""
from __future__ import annotations

import socket
import threading

import pytest

from launch.config import ConfigError, load_config
from launch.distributed import LaunchError
from launch.serve.via_relay import api_relay, register_api
from tests.support.relay_harness import TOKEN, relay_in_thread


def config(tmp_path, *extra: str):
    key = tmp_path / "key"
    key.write_text("k-123\n")
    return load_config(["serve.port=0", f"serve.api_key_file={key}", *extra])


def test_an_exposed_api_without_a_key_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"serve.via_relay=true makes the API reachable .* set serve.api_key_file=FILE") as e:
        load_config(["serve.port=0", "serve.via_relay=true"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="give serve.port=PORT too"):
        load_config(["prompt=hi", "serve.via_relay=true", "serve.api_key=k"])


def test_tls_files_come_in_pairs_and_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="ssl_certfile and serve.ssl_keyfile together"):
        config(tmp_path, f"serve.ssl_certfile={tmp_path / 'key'}")
    with pytest.raises(ConfigError, match="serve.ssl_keyfile=.*nope is not a file"):
        config(tmp_path, f"serve.ssl_certfile={tmp_path / 'key'}", f"serve.ssl_keyfile={tmp_path / 'nope'}")


def test_the_relay_address_session_and_token_are_found_or_named(tmp_path, monkeypatch):
    for var in ("TANDEM_RELAY", "TORCHELASTIC_RUN_ID", "TANDEM_RELAY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    assert api_relay(config(tmp_path)) is None  # not asked for
    with pytest.raises(LaunchError, match="needs the relay's address: transport.relay=HOST:PORT"):
        api_relay(config(tmp_path, "serve.via_relay=true"))
    with pytest.raises(LaunchError, match="needs the run's id: transport.session=ID"):
        api_relay(config(tmp_path, "serve.via_relay=true", "transport.relay=r:1"))
    with pytest.raises(LaunchError, match="no relay token"):
        api_relay(config(tmp_path, "serve.via_relay=true", "transport.relay=r:1", "transport.session=run"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "my-run")  # torchrun's --rdzv_id
    token = tmp_path / "token"
    token.write_bytes(TOKEN)
    got = api_relay(config(tmp_path, "serve.via_relay=true", "transport.relay=r:1", f"transport.relay_token_file={token}"))
    assert (got.relay, got.session, got.token) == ("r:1", "my-run", TOKEN)


def test_rank_0s_port_is_registered_as_the_runs_api(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: server.accept()[0].sendall(b"HTTP/1.1 200 OK\r\n\r\n"), daemon=True).start()
    token = tmp_path / "token"
    token.write_bytes(TOKEN)
    with relay_in_thread(api_port=0, api_session="run-7") as relay:
        cfg = config(tmp_path, "serve.via_relay=true", f"transport.relay=127.0.0.1:{relay.port}", "transport.session=run-7",
                     f"transport.relay_token_file={token}", "serve.host=0.0.0.0")
        backend = register_api(cfg, server.getsockname()[1])
        try:
            assert backend.registered.wait(5) and backend.service == "api:run-7"
            with socket.create_connection(("127.0.0.1", relay.api_port), timeout=5) as client:
                client.sendall(b"GET / HTTP/1.1\r\n\r\n")
                assert client.recv(100) == b"HTTP/1.1 200 OK\r\n\r\n"
        finally:
            backend.close()
            server.close()
