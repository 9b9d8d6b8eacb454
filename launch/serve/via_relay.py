"""serve.via_relay=true: rank 0's API server registered at the relay, so clients outside the NAT reach it at
`tandem-relay --api-port P` (netbridge.backend's dial-back; the relay never parses what it carries).

The relay, the run's session and the relay token are the transport's (transport.relay / TANDEM_RELAY,
transport.session / --rdzv_id, transport.relay_token_file / TANDEM_RELAY_TOKEN_FILE), whatever
transport.kind is: the API is registered as service `api:<session>`. Under torchrun --max_restarts the front
(launch/serve/front.py) registers it instead of rank 0: it outlives the ranks, so relay clients get its 503
during a restart.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from launch.config import TandemConfig
from netbridge import auth
from netbridge.backend import Backend, api_service, serve_through_relay


class ApiRelay(NamedTuple):
    relay: str
    session: str
    token: bytes


def api_relay(cfg: TandemConfig) -> ApiRelay | None:
    """Where rank 0 registers its API (None without serve.via_relay); a missing setting is one LaunchError line."""
    from launch.distributed import LaunchError
    if not cfg.serve.via_relay:
        return None
    t = cfg.transport
    relay = t.relay or os.environ.get("TANDEM_RELAY")
    if not relay:
        raise LaunchError("serve.via_relay=true needs the relay's address: transport.relay=HOST:PORT (or torchrun "
                          "--rdzv_backend=tandem-relay, which sets it)")
    session = t.session or os.environ.get("TORCHELASTIC_RUN_ID")
    if not session:
        raise LaunchError("serve.via_relay=true needs the run's id: transport.session=ID (or torchrun --rdzv_id)")
    try:
        token = auth.load_secret(t.relay_token, t.relay_token_file or os.environ.get("TANDEM_RELAY_TOKEN_FILE"))
        auth.check_session(api_service(session))
    except auth.HandshakeError as e:
        raise LaunchError(f"serve.via_relay=true: {e}") from None
    return ApiRelay(relay, session, token)


def register_api(cfg: TandemConfig, port: int) -> Backend | None:
    """Register the server listening on serve.host:`port` at the relay (None without serve.via_relay)."""
    where = api_relay(cfg)
    if where is None:
        return None
    from launch.serve.front import local_address
    return serve_through_relay(where.relay, where.token, api_service(where.session), (local_address(cfg.serve.host), port))
