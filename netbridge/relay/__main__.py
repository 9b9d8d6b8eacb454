"""python -m netbridge.relay: the same as the tandem-relay command."""
from netbridge.relay.cli import main

main()
