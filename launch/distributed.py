"""Who am I, and how do I reach the other ranks: torchrun's environment -> (rank, its links).

The ranks form a ring 0 -> 1 -> ... -> N-1 -> 0 (speculative.rounds): each rank receives from the one
before it and sends to the one after it; with two ranks both links are one Channel."""
from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from datetime import timedelta

from launch.config import TandemConfig
from launch.transport import gloo_link, relay_link, transport_settings
from netbridge.channel import Channel


class LaunchError(RuntimeError):
    """Started the wrong way; the message says how to start."""


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM (torchrun stopping its workers): one line, never a traceback."""

    def __init__(self, signum: int, detail: str = ""):
        import signal
        super().__init__(f"stopped by {signal.Signals(signum).name}{detail}")
        self.signum = signum


def torchrun_rank() -> tuple[int, int]:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise LaunchError("not started by torchrun: run `torchrun --nproc_per_node=2 train_free_infer.py ...` "
                          "(or one torchrun per host with --nnodes=N, see README)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise LaunchError(f"Tandem runs on 2 or more ranks (one per pipeline stage), torchrun started {world}: use "
                          "--nproc_per_node=N on one host, or --nnodes=N --nproc_per_node=1 on N")
    return rank, world


def skip_the_final_collections_at_exit() -> None:
    """At exit a rank's interpreter runs full garbage collections over everything torch and transformers
    built (some 400k objects): 1-3 s per rank on 2 cores, all after the answer was printed, and torchrun
    waits for it. Freezing the heap at exit (an atexit hook) makes those collections skip it; the memory
    goes back to the OS with the process anyway. The cost: an object in a reference cycle that is still
    around at exit is not finalized, which Python does not promise either; what must reach disk (output
    file, telemetry, the channel) is closed explicitly before exit. A collection before freezing would
    keep that too, but costs most of the gain (measured: exit 1.1-2.0 s with it, 0.9-1.0 s without)."""
    atexit.unregister(gc.freeze)  # once, however often this is called
    atexit.register(gc.freeze)


def open_links(cfg: TandemConfig, rank: int, ranks: int) -> tuple[Channel, Channel]:
    """(the link from the rank before, the link to the rank after) on the ring; one channel with two ranks."""
    if ranks == 2:
        channel = open_channel(cfg, rank)
        return channel, channel
    if cfg.transport.kind == "relay":
        return _open_relay_links(cfg, rank, ranks)
    _init_gloo(cfg, rank)
    settings = transport_settings(cfg.transport)
    links = [gloo_link(settings, (rank + step) % ranks) for step in (-1, 1)]
    for link in links:
        link.peer_name = f"rank {link.peer}"
    return links[0], links[1]


def _open_relay_links(cfg: TandemConfig, rank: int, ranks: int) -> tuple[Channel, Channel]:
    """One two-member relay session per ring link (netbridge.relay_channel.ring_link). Dialling waits for the
    peer, so the order breaks the cycle: rank 0 dials rank 1 first, every other rank its predecessor first."""
    settings = transport_settings(cfg.transport)
    prev_rank, next_rank = (rank - 1) % ranks, (rank + 1) % ranks
    order = (next_rank, prev_rank) if rank == 0 else (prev_rank, next_rank)
    links: dict[int, Channel] = {}
    try:
        for peer in order:
            links[peer] = relay_link(settings, rank, peer, ranks)
            links[peer].peer_name = f"rank {peer}"
    except BaseException:
        for link in links.values():
            link.close()
        raise
    return links[prev_rank], links[next_rank]


def open_channel(cfg: TandemConfig, rank: int) -> Channel:
    settings = transport_settings(cfg.transport)
    if settings.kind == "relay":
        return relay_link(settings, rank)
    _init_gloo(cfg, rank)
    return gloo_link(settings, 1 - rank)


def _init_gloo(cfg: TandemConfig, rank: int) -> None:
    import torch.distributed as dist
    t = cfg.transport
    endpoint = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=t.timeout_s))
    except Interrupted:  # Ctrl-C while waiting for the other rank: that is the cause, not the group
        raise
    except Exception as e:  # noqa: BLE001 - torch raises several types here; all mean the same to a user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise LaunchError(f"rank {rank} could not form the gloo group via {endpoint} within {t.timeout_s:.0f} s ({first}); "
                          "is the other rank running, and can each host reach the other? If not, use transport.kind=relay") from None


def close_channel(channel: Channel, *more: Channel) -> None:
    for c in {id(c): c for c in (channel, *more)}.values():
        c.close()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def report(message: str, rank: int | str | None = None, echo: bool = True) -> None:
    """One line on stderr, tagged with the rank (torchrun's RANK if not given; none when not under
    torchrun): the user sees the cause and the fix, not a traceback. Under torchrun the line also goes
    to this worker's error file, so the failure summary torchrun prints last ends with it
    (`traceback : tandem[rank N]: ...`) instead of "To enable traceback see: ...". `echo=False`: the
    file only (a line another rank of this host prints already)."""
    rank = os.environ.get("RANK") if rank is None else rank
    line = f"tandem[rank {rank}]: {message}" if rank is not None else f"tandem: {message}"
    if echo:  # in one write: print() writes the newline apart, and another rank's line could come between
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    record_for_torchrun(line)


def record_for_torchrun(line: str) -> None:
    """Write `line` where torchrun reads a failed worker's cause: the file named by TORCHELASTIC_ERROR_FILE,
    in the layout of torch's own ErrorHandler.record_exception, less the traceback (torchrun shows
    `py_callstack` when there is one, else `message`). torchrun names as root cause the failure with
    the earliest timestamp (whole seconds; a tie goes to the first it noticed)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:  # the line is on stderr already; torchrun then shows its generic hint
        pass
