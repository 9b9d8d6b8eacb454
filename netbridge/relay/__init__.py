"""tandem-relay: the one public address both ranks dial out to, for torchrun's rendezvous and for data.

    python -m netbridge.relay --host 0.0.0.0 --port 29400 --secret-file ~/.tandem/relay.token

The --secret-file is the relay token (admission, netbridge.auth); the nodes' pairing secret, which keys
their end-to-end encryption, never comes here (netbridge.secure), so the relay forwards what it cannot read.

Every connection starts with the HMAC handshake of netbridge.auth and then is one of:
  data   the two ranks of a session; the relay forwards their link frames verbatim, cut-through
         (a frame's bytes move on as they arrive, the relay never holds a whole frame)
  rdzv   torchrun agents of one run meeting (launch/relay_rendezvous.py); when all have come the
         relay gives each its node rank and the token of a fresh store
  store  a byte pipe to that run's c10d TCPStore, which listens on the relay's loopback only

The parts, each one concern:
  admission.py   who may start a handshake (per-source bounds, shedding), the handshake, --max-connections
  notices.py     a refused claim told to the members of its session that wait
  sessions.py    data sessions (two ranks paired) and rendezvous groups (a run's agents gathered)
  connection.py  the per-connection protocol: link frames, heartbeats, forwarding, PEER_LEFT
  emulation.py   EMULATION of a WAN link between paired ranks (--emulate-delay-ms, --emulate-mbps)
  store.py       the rendezvous stores and the pipes to them
  server.py      Relay: the listening socket, the sweep timer, a claim routed to its part by role
  cli.py         main(): flags, event loop, signals

No torch import unless the rendezvous store is enabled (then torch.distributed, CPU is enough).
"""
from netbridge.relay.admission import claimed_session, source_of
from netbridge.relay.cli import main, peak_rss_mb
from netbridge.relay.server import Relay

__all__ = ["Relay", "claimed_session", "main", "peak_rss_mb", "source_of"]
