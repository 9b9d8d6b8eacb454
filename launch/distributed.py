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
from launch.transport import HostPlace, LocalLinks, gloo_link, host_place, local_peers, relay_link, transport_settings
from model_parallel.lines import one_line
from netbridge.channel import Channel, PeerError, leave_last_words
from netbridge.frames import FrameError


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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
HEAP_BLOCK_MAX = 32 << 20  # blocks up to this come from the heap (glibc's own ceiling for them); larger ones are mapped
HEAP_KEPT = 1 << 30  # free memory at the heap's top goes back to the OS only past this


def reuse_freed_memory() -> bool:
    """Keep a forward's freed activations in this process for the next forward: glibc's malloc gives a freed block
    of more than 128 KiB (raised as such blocks come and go, to 32 MiB at most) back to the OS, and trims the heap's
    free top, so a prefill chunk's activations (a 512-token chunk's MLP: 9 MiB a tensor in bf16) are mapped
    and page-faulted in again on every layer. One 1.5B layer over a 512-token chunk, one thread: 84 ms by default,
    64 ms with this (2026-12-06, Xeon avx512_bf16; bench/README). Timing at start-up and serving then run alike: a
    chunk's cost depended on which forwards the process had run before. PyTorch's CPU tuning guide says the same
    (a caching allocator, jemalloc or tcmalloc, preloaded). The cost: blocks freed stay in the process for the
    next to reuse, up to HEAP_KEPT free at the heap's top (release_freed_memory gives back the start-up timing's);
    a KV slot and a tensor over HEAP_BLOCK_MAX are mapped as before. False where the C library has no mallopt (not
    glibc): nothing changes."""
    mallopt = _libc_function("mallopt")
    # setting either fixes both (glibc stops moving them): the threshold first, so blocks up to it stay in the heap
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, HEAP_KEPT))


def release_freed_memory() -> None:
    """Give the heap's free memory back to the OS (glibc's malloc_trim): once the start-up's timing is done, its
    placeholder layers' blocks would stay in the process for good (a 1.5B target's time_alone left 1.1 GiB free in
    the heap; a script's layers built after it grew the process as much as without reuse_freed_memory, less a
    sixth). A forward's activations are faulted in once more, on the first prefill after."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def _libc_function(name: str):
    """The C library's `name`, or None where it has none (not glibc)."""
    import ctypes
    import ctypes.util
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def open_links(cfg: TandemConfig, rank: int, ranks: int, place: HostPlace | None = None) -> tuple[Channel, Channel]:
    """(the link from the rank before, the link to the rank after) on the ring: one Channel per neighbour, so
    with two ranks both are the same one; a neighbour on this host directly (launch.transport.local_peers), any
    other through transport.kind. Dialling a relay link waits for the peer, so the order breaks the cycle:
    rank 0 dials rank 1 first, every other rank its predecessor first (a direct link's listener has published
    its port before any link opens, so dialing it never waits on its owner's order). `place`: where this rank
    sits among the hosts (default: torchrun's environment, launch.transport.host_place)."""
    settings = transport_settings(cfg.transport)
    prev, next = (rank - 1) % ranks, (rank + 1) % ranks
    if settings.kind != "relay":
        _init_gloo(settings, rank)
    place = place or host_place(ranks)
    local = LocalLinks(settings, rank, local_peers(settings.local_links, place, rank, ranks, settings.kind),
                       emulated=place.hosts < 2)
    links: dict[int, Channel] = {}
    try:
        for peer in dict.fromkeys((next, prev) if rank == 0 else (prev, next)):
            links[peer] = (local.open(peer) if peer in local.peers else
                           relay_link(settings, rank, peer, ranks) if settings.kind == "relay" else gloo_link(settings, peer))
            if prev != next:  # one neighbour is "the other rank"
                links[peer].peer_name = f"rank {peer}"
    except BaseException:
        for link in links.values():
            link.close()
        raise
    finally:
        local.close()
    return links[prev], links[next]


def open_channel(cfg: TandemConfig, rank: int) -> Channel:
    """The one link of a rank of two."""
    return open_links(cfg, rank, 2)[0]


def _init_gloo(settings, rank: int) -> None:
    import torch.distributed as dist
    endpoint = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    timeout = timedelta(seconds=settings.timeout_s)
    try:
        store = attempt_store(timeout)
        if store is None:
            dist.init_process_group("gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    except Interrupted:  # Ctrl-C while waiting for the other rank: that is the cause, not the group
        raise
    except Exception as e:  # noqa: BLE001 - torch raises several types here; all mean the same to a user
        raise LaunchError(f"rank {rank} could not form the gloo group via {endpoint} within {settings.timeout_s:.0f} s "
                          f"({one_line(e, 200, first=True)}); "
                          "is the other rank running, and can each host reach the other? If not, use transport.kind=relay") from None


def attempt_store(timeout: timedelta):
    """The store this attempt's gloo group meets in, under torchrun with one agent: the agent's store, its keys
    prefixed by TORCHELASTIC_RESTART_COUNT. torchrun's static rendezvous keeps ONE store for every restart, and
    the workers' keys are not prefixed (torch assumes a fresh store per attempt): a restarted rank read the last
    attempt's address of rank 0 and failed with "Connection refused" in seconds, or met, by luck of timing.
    With one agent every worker of an attempt has the same count; with several (--nnodes > 1) the agents count
    their own restarts (c10d restarts a healthy node's workers without counting), so the store is left as it is
    (torch's default, None here); across hosts a restart is the tandem-relay rendezvous's (a store per round)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        return None
    import torch.distributed as dist
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"tandem/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


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


# --- a failure, told -------------------------------------------------------------------------------

def expected_failures() -> tuple[type, ...]:
    """The failures Tandem foresees: each is one line on every rank, never a traceback."""
    from kvcache.static_cache import CacheOverflowError
    from launch.config import ConfigError
    from model_parallel.loader import ModelLoadError
    from speculative.rounds import NonFiniteLogits
    return (ConfigError, LaunchError, ModelLoadError, PeerError, FrameError, CacheOverflowError, NonFiniteLogits,
            Interrupted)


def error_line(e: BaseException) -> str:
    """The one line a failure is reported with: a foreseen one's own message, anything else after its type."""
    return str(e) if isinstance(e, expected_failures()) else one_line(e, 2000, named=True)


def tell_peer(links, message: str, wait_s: float = 5.0, cause: BaseException | None = None) -> None:
    """Best effort: let the rank after this one on the ring exit with the cause instead of waiting out its
    timeout (every rank waits on the one before it, and passes the cause on). Not after a PeerError that means
    the only neighbour is gone; a frame this rank refused (tampered, replayed: a PeerError and a FrameError)
    leaves the peer there, waiting for the reason."""
    cause = cause or sys.exc_info()[1]  # by default the exception being handled
    if not isinstance(cause, PeerError):  # this rank's own cause, for a peer that is sending, not receiving
        leave_last_words(message)
    if links is None:
        return
    prev, next = links
    if prev is next and isinstance(cause, PeerError) and not isinstance(cause, FrameError):
        return
    try:
        next.timeout_s = min(next.timeout_s, wait_s)
        from netbridge import protocol
        protocol.send(next, protocol.Error(message))
    except Exception:  # noqa: BLE001 - the peer may be gone already; our own error is what matters
        pass


def wait_for_peer_to_leave(links, wait_s: float = 2.0) -> None:
    """Until the last rank, after its Bye, closes its end: torchrun stops the ranks still running as soon as one
    exits with a failure status, and a rank stopped on its way out would print a cause of its own."""
    channel = links[0]
    try:
        channel.timeout_s = min(channel.timeout_s, wait_s)
        channel.recv()
    except Exception:  # noqa: BLE001 - its leaving is what this waits for
        pass
