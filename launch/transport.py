"""transport.* of the config, read once into plain settings, and the links opened from them.

A ring link between two ranks of one host is direct (`LocalLinks`: a loopback TCP Channel) when
transport.local_links says so (auto: unless one host runs the whole ring with kind=relay, which emulates hosts
through the relay); every other link is what transport.kind says. A gloo link costs each frame two rendezvous with
the peer and a sender thread that waits for its process's GIL, so a frame sent while its rank computes leaves only
when the rank next waits (bench/busy_link.py, two ranks computing 3 ms between frames: a round trip of 3.8 ms at
p50 and 8.0 at p90 over gloo, 3.3 and 3.4 over loopback TCP, whose send is the kernel's). On one host, which
emulates several, a direct link carries transport.emulate_* as the transport's would; between hosts a direct link
never leaves its host and carries none. torchrun numbers the ranks of a host one after another (its agent gives
each node a base rank, the ranks before it, plus LOCAL_RANK), so on the ring 0 -> 1 -> ... -> N-1 -> 0 a rank's
predecessor is on its host iff LOCAL_RANK > 0, its successor iff LOCAL_RANK + 1 < LOCAL_WORLD_SIZE: N hosts make N
host-to-host links, whatever the ranks per host (`local_peers`).

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
from datetime import timedelta

from netbridge import auth
from netbridge.channel import GlooChannel, PeerError
from netbridge.relay_dial import DEFAULT_RECONNECT_S, ring_link


@dataclass(frozen=True)
class TransportSettings:
    kind: str  # gloo | relay
    timeout_s: float
    local_links: str = "auto"  # auto | direct | transport
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
    common = dict(kind=t.kind, timeout_s=t.timeout_s, local_links=t.local_links, reconnect_s=t.reconnect_s,
                  emulate_delay_ms=t.emulate_delay_ms, emulate_mbps=t.emulate_mbps)
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


# --- direct links between two ranks of one host ------------------------------------------------------

@dataclass(frozen=True)
class HostPlace:
    """Where a rank sits among the hosts, from torchrun's environment."""
    local_rank: int  # LOCAL_RANK: its place among the ranks of its host
    local_ranks: int  # LOCAL_WORLD_SIZE: the ranks of its host
    hosts: int  # GROUP_WORLD_SIZE: the hosts (torchrun's nodes) of the run


def host_place(ranks: int, env=os.environ) -> HostPlace:
    """This rank's HostPlace; a process started without torchrun's node variables is one host of `ranks`."""
    return HostPlace(int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", ranks)), int(env.get("GROUP_WORLD_SIZE", 1)))


def local_peers(mode: str, place: HostPlace, rank: int, ranks: int, kind: str = "gloo") -> set[int]:
    """The ring neighbours of `rank` it links to directly (on its host), by transport.local_links `mode`: auto is
    direct but where one host runs the ring with `kind` relay (it emulates several hosts: its links go through the
    relay)."""
    if mode == "transport" or (mode == "auto" and place.hosts < 2 and kind == "relay"):
        return set()
    prev, next = (rank - 1) % ranks, (rank + 1) % ranks
    if place.hosts < 2:  # every rank is on this host, the link from the last back to rank 0 too
        return {prev, next}
    return {peer for peer, here in ((prev, place.local_rank > 0), (next, place.local_rank + 1 < place.local_ranks)) if here}


def local_key(rank: int, peer: int) -> str:
    """The store key where the lower rank of a direct link publishes its port and token (per torchrun restart)."""
    low, high = sorted((rank, peer))
    return f"tandem/local-link/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{low}-{high}"


class LocalLinks:
    """This rank's direct links: it listens for those to a higher rank, publishing port and token in torchrun's
    store before any link is opened (so a peer dialing it never waits on this rank's order), and dials the
    others once their lower rank has published."""

    def __init__(self, s: TransportSettings, rank: int, peers: set[int], emulated: bool = False):
        from netbridge.loopback_channel import LoopbackListener
        self.settings, self.rank, self.peers = s, rank, peers
        self.emulation = s.emulation if emulated else {}  # one host emulating several: its links are the WAN
        self.store = local_store(s.timeout_s) if peers else None
        self.listeners = {peer: LoopbackListener() for peer in peers if peer > rank}
        for peer, listener in self.listeners.items():
            self.store.set(local_key(rank, peer), f"{listener.port} {listener.token.hex()}")

    def open(self, peer: int):
        """The Channel to `peer` on this host (emulated only where the whole run is on it: `emulated`)."""
        from netbridge.loopback_channel import LoopbackChannel
        name, s = f"rank {peer}", self.settings
        if peer in self.listeners:
            return self.listeners.pop(peer).accept(s.timeout_s, name, **self.emulation)
        try:
            self.store.wait([local_key(self.rank, peer)], timedelta(seconds=s.timeout_s))
            port, token = self.store.get(local_key(self.rank, peer)).decode().split()
        except Exception:  # noqa: BLE001 - the store's errors are one kind to a user: the peer never published
            raise PeerError(f"rank {peer} did not open its port on this host within {s.timeout_s:g} s (transport.timeout_s); "
                            f"is it running, and are ranks {self.rank} and {peer} on one host? "
                            "(transport.local_links=transport sends every link through transport.kind)") from None
        return LoopbackChannel.connect(int(port), bytes.fromhex(token), s.timeout_s, name, **self.emulation)

    def close(self) -> None:
        for listener in self.listeners.values():
            listener.close()


def local_store(timeout_s: float):
    """torchrun's store, where two ranks of a host find each other's port: the process group's when gloo is up,
    else the agent's (MASTER_ADDR:MASTER_PORT with TORCHELASTIC_USE_AGENT_STORE; under tandem-relay, the agent's
    proxy to the relay's store)."""
    import torch.distributed as dist
    if dist.is_initialized():
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        raise PeerError("direct links between ranks of one host need torchrun's store (MASTER_ADDR, MASTER_PORT); "
                        "start with torchrun, or set transport.local_links=transport")
    return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
