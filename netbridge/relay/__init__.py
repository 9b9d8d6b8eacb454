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

No torch import unless the rendezvous store is enabled (then torch.distributed, CPU is enough).
"""
from netbridge.relay.cli import main, peak_rss_mb
from netbridge.relay.server import Relay, claimed_session, source_of

__all__ = ["Relay", "claimed_session", "main", "peak_rss_mb", "source_of"]
