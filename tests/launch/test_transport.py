"""launch.transport: cfg.transport read once into frozen settings; netbridge never sees the config."""
from __future__ import annotations

import dataclasses

import pytest

from launch.config import TransportConfig
from launch.transport import transport_settings
from netbridge.channel import PeerError


def relay_config(tmp_path, **over) -> TransportConfig:
    (tmp_path / "token").write_bytes(b"relay-token\n")
    (tmp_path / "secret").write_bytes(b"pairing-secret\n")
    fields = dict(kind="relay", relay="relay.example:29400", session="run", relay_token_file=str(tmp_path / "token"),
                  secret_file=str(tmp_path / "secret"), emulate_delay_ms=40.0, emulate_mbps=10.0, reconnect_s=7.0)
    return TransportConfig(**{**fields, **over})


def test_relay_settings_read_the_files_and_keep_the_secrets_out_of_their_repr(tmp_path):
    s = transport_settings(relay_config(tmp_path))
    assert (s.relay, s.session, s.token, s.secret, s.reconnect_s) == ("relay.example:29400", "run", b"relay-token",
                                                                        b"pairing-secret", 7.0)
    assert s.emulation == {"emulate_delay_ms": 40.0, "emulate_mbps": 10.0}
    assert "relay-token" not in repr(s) and "pairing-secret" not in repr(s)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.relay = "elsewhere:1"


def test_relay_settings_default_to_the_rendezvous_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_RELAY", "rdzv.example:29400")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-id")
    monkeypatch.setenv("TANDEM_SECRET_FILE", str(tmp_path / "secret"))
    s = transport_settings(relay_config(tmp_path, relay=None, session=None, secret_file=None))
    assert (s.relay, s.session, s.secret) == ("rdzv.example:29400", "rdzv-id", b"pairing-secret")


def test_each_rendezvous_round_pairs_in_a_session_of_its_own(tmp_path, monkeypatch):
    """torchrun's restart: the new ranks' links must not be taken for the last attempt's (issue 44)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-id")
    rounds = []
    for name in ("1a2b3c4d", "5e6f7a8b"):
        monkeypatch.setenv("TANDEM_RELAY_ROUND", name)
        rounds.append(transport_settings(relay_config(tmp_path, session=None)).session)
    assert rounds == ["rdzv-id/1a2b3c4d", "rdzv-id/5e6f7a8b"]
    assert transport_settings(relay_config(tmp_path)).session == "run/5e6f7a8b"  # a given session too
    monkeypatch.delenv("TANDEM_RELAY_ROUND")
    assert transport_settings(relay_config(tmp_path)).session == "run"  # no tandem-relay rendezvous: as given


def test_a_missing_relay_setting_is_one_line_naming_it(tmp_path, monkeypatch):
    for name in ("TANDEM_RELAY", "TORCHELASTIC_RUN_ID", "TANDEM_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PeerError, match=r"transport.relay=HOST:PORT"):
        transport_settings(relay_config(tmp_path, relay=None))
    with pytest.raises(PeerError, match=r"transport.session=ID"):
        transport_settings(relay_config(tmp_path, session=None))
    with pytest.raises(PeerError, match=r"no pairing secret: set transport.secret_file=PATH"):
        transport_settings(relay_config(tmp_path, secret_file=None))


def test_gloo_settings_need_no_relay_and_read_no_file(tmp_path):
    s = transport_settings(TransportConfig(kind="gloo", timeout_s=5.0, emulate_delay_ms=3.0, secret_file="/nonexistent"))
    assert (s.kind, s.timeout_s, s.relay, s.secret, s.emulation["emulate_delay_ms"]) == ("gloo", 5.0, None, b"", 3.0)
