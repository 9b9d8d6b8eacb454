"""torchrun's rendezvous plugins (pyproject.toml's torchrun.handlers entry points):

    rendezvous.py        --rdzv_backend=tandem: hosts that reach each other, each the node rank it is given
    relay_rendezvous.py  --rdzv_backend=tandem-relay: rendezvous through the relay (netbridge/relay)
"""
