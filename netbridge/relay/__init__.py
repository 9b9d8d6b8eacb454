"""tandem-relay: the one public address both ranks dial out to, for torchrun's rendezvous and for data, and
optionally the door to a run's API (--api-port).

    python -m netbridge.relay --host 0.0.0.0 --port 29400 --secret-file ~/.tandem/relay.token

The --secret-file is the relay token (admission, netbridge.auth); the nodes' pairing secret, which keys
their end-to-end encryption, never comes here (netbridge.secure), so the relay forwards what it cannot read.

Every connection starts with the HMAC handshake of netbridge.auth and then is one of:
  data   the two ranks of a session; the relay forwards their link frames verbatim, cut-through
         (a frame's bytes move on as they arrive, the relay never holds a whole frame)
  rdzv   torchrun agents of one run meeting (launch/torchrun/relay_rendezvous.py); when all have come the
         relay gives each its node rank and the token of a fresh store, which node 0's agent starts
  store  a byte pipe to that run's c10d TCPStore on node 0, through the dial-back
  service, backend  the dial-back (services.py, netbridge/backend.py): a process behind the NAT registers a
         service; for each client of it the relay asks it to dial back, and splices the two connections
An --api-port client has no handshake: its bytes are spliced to the dial-back of the run's API service.

The parts, layered one way (each imports only the ones above it in this list):
  scanner.py     pure: a client's stream of link frames followed without holding a body
  handshake.py   pure: the HMAC handshake as decisions (Claim, Refusal), source_of, the refusal notices' texts
  admission.py   decisions: the table of unfinished handshakes (whom to shed), --max-connections
  emulation.py   EMULATION of a WAN link between paired ranks (--emulate-delay-ms, --emulate-mbps)
  notices.py     a refused claim told to the members of its session that wait (rate-limited tables)
  refusals.py    decisions: refused dials per source address, answered ever later, logged as counts
  sessions.py    bookkeeping: data sessions (two ranks paired), rendezvous groups (a run's agents gathered)
  services.py    the dial-back's bookkeeping: registered services, clients waiting for a dial-back (Splice)
  connection.py  the one owner of a connection's state and writer to the transports; asks its Host
  server.py      Relay, the Host: the listening socket, the sweep timer; asks the parts, tells the connections
  cli.py         main(): flags, event loop, signals

No torch import, ever: the relay's install is the standard library and `cryptography` (uvloop optional).
"""
from netbridge.relay.cli import main, peak_rss_mb
from netbridge.relay.handshake import claimed_session, source_of
from netbridge.relay.server import Relay

__all__ = ["Relay", "claimed_session", "main", "peak_rss_mb", "source_of"]
