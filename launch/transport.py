"""transport.* of the config, read once into plain settings, and the links opened from them.

netbridge never sees the config: it takes these values. Under torchrun's tandem-relay rendezvous the relay
address and session default to the rendezvous endpoint and --rdzv_id (launch/torchrun/relay_rendezvous.py sets
TANDEM_RELAY; torchrun sets TORCHELASTIC_RUN_ID); the relay token file defaults to TANDEM_RELAY_TOKEN_FILE and
the pairing secret's to TANDEM_SECRET_FILE. Under that rendezvous the link session is <session>/<round>
(TANDEM_RELAY_ROUND, new each rendezvous round): the ranks of a restart pair afresh instead of meeting the
last attempt's half-closed links, which the secure session would refuse as "restarted".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from netbridge import auth
from netbridge.channel import GlooChannel, PeerError
from netbridge.relay_dial import DEFAULT_RECONNECT_S, ring_link


@dataclass(frozen=True)
class TransportSettings:
    kind: str  # gloo | relay
    timeout_s: float
    reconnect_s: float = DEFAULT_RECONNECT_S
    emulate_delay_ms: float = 0.0
    emulate_mbps: float = 0.0
    relay: str | None = None  # kind=relay: HOST:PORT
    session: str | None = None  # kind=relay: the session id both ranks give
    token: bytes = field(default=b"", repr=False)  # kind=relay: the relay's admission token
    secret: bytes = field(default=b"", repr=False)  # kind=relay: the two nodes' pairing secret

    @property
    def emulation(self) -> dict:
        return {"emulate_delay_ms": self.emulate_delay_ms, "emulate_mbps": self.emulate_mbps}


def transport_settings(t) -> TransportSettings:
    """The settings of `t` (cfg.transport, only read). For kind=relay the address, session and both secrets are
    resolved now, so a missing one is one PeerError line naming the setting before anything is dialed."""
    common = dict(kind=t.kind, timeout_s=t.timeout_s, reconnect_s=t.reconnect_s, emulate_delay_ms=t.emulate_delay_ms,
                  emulate_mbps=t.emulate_mbps)
    if common["kind"] != "relay":
        return TransportSettings(**common)
    relay = t.relay or os.environ.get("TANDEM_RELAY")
    if not relay:
        raise PeerError("transport.kind=relay needs transport.relay=HOST:PORT, the address of `tandem-relay`")
    session = t.session or os.environ.get("TORCHELASTIC_RUN_ID")
    if not session:
        raise PeerError("transport.kind=relay needs transport.session=ID, the same on both ranks (or torchrun --rdzv_id)")
    if os.environ.get("TANDEM_RELAY_ROUND"):  # a torchrun restart's ranks must not resume the last attempt's links
        session = f"{session}/{os.environ['TANDEM_RELAY_ROUND']}"
    try:
        token = auth.load_secret(t.relay_token, t.relay_token_file or os.environ.get("TANDEM_RELAY_TOKEN_FILE"),
                                 what=auth.RELAY_TOKEN)
        secret = auth.load_secret(t.secret, t.secret_file or os.environ.get("TANDEM_SECRET_FILE"), what=auth.PAIRING_SECRET)
    except auth.HandshakeError as e:
        raise PeerError(str(e)) from None
    return TransportSettings(**common, relay=relay, session=session, token=token, secret=secret)


def relay_link(s: TransportSettings, rank: int, peer: int | None = None, ranks: int = 2):
    """The relay Channel between `rank` and `peer` (with two ranks, the one session named transport.session;
    with more, the ring link's own session, netbridge.relay_dial.ring_link)."""
    from netbridge.relay_channel import RelayChannel  # the relay's crypto only where the relay is used
    if ranks == 2:
        return RelayChannel.connect(s.relay, s.session, rank, s.token, s.secret, timeout_s=s.timeout_s,
                                    reconnect_s=s.reconnect_s, **s.emulation)
    link_session, end = ring_link(s.session, rank, peer, ranks)
    return RelayChannel.connect(s.relay, link_session, end, s.token, s.secret, timeout_s=s.timeout_s,
                                reconnect_s=s.reconnect_s, ring=(rank, peer), **s.emulation)


def gloo_link(s: TransportSettings, peer: int) -> GlooChannel:
    """The gloo Channel to `peer` (the process group must be up)."""
    return GlooChannel(peer, s.timeout_s, **s.emulation)
