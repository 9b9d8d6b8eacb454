"""Tandem's entry: the same script on every rank; each asks torchrun which rank it is.

    torchrun --nproc_per_node=2 train_free_infer.py prompt="Write a Python function that reverses a string."
    torchrun --nproc_per_node=2 train_free_infer.py serve.port=8000      # an OpenAI-compatible API
    torchrun --nproc_per_node=3 train_free_infer.py model.split=[10,19] prompt="..."   # N stages

Parse the config, open the links of the ring, run this rank (launch.ranks: meet the others, which settles the
Plan, build what it gives, run). Rank 0 holds the embeddings, its layers, the drafter, the tokenizer and the
Session, and then answers the prompt once or, with serve.port, serves the HTTP API (launch/serve/): `rank_zero`
decides; the middle ranks run their layers; the last rank its layers, the head and verification.
Every failure is one line on every rank, and the exit status says which kind.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

if __name__ == "__main__" and {"--help", "-h"} & set(sys.argv[1:]):  # at once: not after torch loads (~4 s here)
    from launch.config import help_text
    print(help_text())
    sys.exit(0)

from launch import ranks as lives
from launch.config import ConfigError, StdinError, TandemConfig, config_from_argv
from launch.distributed import (Interrupted, close_channel, error_line, expected_failures, open_links, report,
                                reuse_freed_memory, skip_the_final_collections_at_exit, tell_peer, torchrun_rank,
                                wait_for_peer_to_leave)
from launch.ranks import StdoutClosed
from netbridge.channel import PeerError

EXPECTED = expected_failures()
REFUSAL_WAIT_S = 30.0  # at most this (and transport.timeout_s) rank 0 waits for the others to meet, to tell them why it stops


def main(argv: list[str] | None = None) -> None:
    cfg, refusal = parse(argv)
    if threading.current_thread() is threading.main_thread():  # (tests drive main() from threads)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lives.raise_interrupted)
    links, rank = None, None
    try:
        rank, ranks = torchrun_rank()
        skip_the_final_collections_at_exit()
        reuse_freed_memory()  # before the start-up's timing: it times forwards as serving will run them
        if refusal is not None:
            _refuse(cfg, rank, ranks, refusal)
        listener = serving_port(cfg, rank, ranks)
        links = prev, next = open_links(cfg, rank, ranks)  # one channel both ways with two ranks
        if cfg.plan_only:  # meet, time, predict, and leave before any weight loads
            lives.plan_only(cfg, prev, next, rank, ranks)
        elif rank == 0:
            rank_zero(cfg, next, replies=prev, listener=listener, ranks=ranks)
        elif rank == ranks - 1:
            lives.last_rank(cfg, prev, reply_to=next, ranks=ranks)
        else:
            lives.middle_rank(cfg, prev, next, rank, ranks)
    except StdoutClosed as e:  # the last rank had its Bye: this rank leaves as after any answer
        wait_for_peer_to_leave(links)
        _drop_stdout()
        sys.exit(e.exit_status)
    except EXPECTED as e:
        if lives.signalled and isinstance(e, PeerError):  # the peer left because the same Ctrl-C stopped it
            e = Interrupted(lives.signalled[0])
        report(str(e), rank)  # first: torchrun stops this rank as soon as the peer exits
        # a signal reaches every rank: the peer is stopping too, and may never read this
        tell_peer(links, str(e), wait_s=0.5 if isinstance(e, Interrupted) else 5.0)
        sys.exit(128 + e.signum if isinstance(e, Interrupted) else 1)
    except BaseException as e:
        tell_peer(links, error_line(e))
        if not isinstance(e, SystemExit):  # Python prints the traceback; torchrun's summary ends with this line
            report(error_line(e), rank, echo=False)
        raise
    finally:
        if links is not None:
            close_channel(*links)


def rank_zero(cfg: TandemConfig, next, replies=None, listener=None, ranks: int = 2) -> dict | None:
    """Rank 0: its Session (launch.ranks.first_rank), then one answer to the prompt (returned as the output JSON),
    or, with serve.port, the HTTP API on `listener` (the port bound at start: a server.Listening) until a signal."""
    first = lives.first_rank(cfg, next, replies=replies, ranks=ranks)
    if cfg.serve.port is None:
        return lives.answer_once(first)
    from launch.serve.server import serve
    serve(cfg, first.session, first.tokenizer, first.eos_ids, first.vocab_size, listener, first.plan.models.name,
          first.plan.links)
    return None


def parse(argv: list[str] | None) -> tuple[TandemConfig, StdinError | None]:
    """The config (exits 0 after printing the keys for --help / -h); a mistake is one line and exit 1. Stdin is
    rank 0's alone: when what came there is refused, the other ranks, which parsed the command line without it,
    are on their way to meet rank 0, so that error comes back with their config, for `_refuse` to tell them."""
    try:
        try:
            return config_from_argv(argv), None
        except StdinError as e:
            return config_from_argv(argv, read_stdin=False), e
    except ConfigError as e:
        # every rank on this host read the same command line: the first says so, each tells torchrun
        report(str(e), echo=os.environ.get("LOCAL_RANK", "0") == "0")
        sys.exit(1)


def serving_port(cfg: TandemConfig, rank: int, ranks: int):
    """Rank 0 serving: its API key read and its port bound now, before the process group opens ports of its own
    and before any weight loads; a failure there is refused (`_refuse`). None when not serving."""
    if rank != 0 or cfg.serve.port is None or cfg.plan_only:
        return None
    from launch.serve.server import load_api_key, open_port
    from launch.serve.via_relay import api_relay
    try:
        load_api_key(cfg)
        api_relay(cfg)  # serve.via_relay: the relay, session and token found now, not after the weights load
        return open_port(cfg)  # under torchrun with restarts: the front's port (launch/serve/front.py)
    except EXPECTED as e:
        _refuse(cfg, rank, ranks, e)


def _refuse(cfg: TandemConfig, rank: int, ranks: int, error: BaseException) -> None:
    """A check only rank 0 makes failed: its line at once, then, if the others come to meet it within
    REFUSAL_WAIT_S, the same line to them (they would otherwise wait at the rendezvous for a rank 0 that is
    gone until torchrun kills them), then exit 1."""
    report(str(error), rank)
    opened: list = []
    opener = threading.Thread(target=lambda: opened.append(open_links(cfg, rank, ranks)), daemon=True)
    opener.start()
    opener.join(min(REFUSAL_WAIT_S, cfg.transport.timeout_s))
    if opened:
        tell_peer(opened[0], str(error), cause=error)
        close_channel(*opened[0])
    sys.exit(1)


def _drop_stdout() -> None:
    """stdout to /dev/null: Python flushes it at exit, and the closed pipe would fail that flush too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    main()
