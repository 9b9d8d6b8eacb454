"""Tandem's entry: the same script on both ranks; each asks torchrun which rank it is.

    torchrun --nproc_per_node=2 train_free_infer.py prompt="Write a Python function that reverses a string."
    torchrun --nproc_per_node=2 train_free_infer.py serve.port=8000      # an OpenAI-compatible API

Rank 0: embeddings + layers [0, split), the drafter, the tokenizer and the output (or the HTTP API).
Rank 1: layers [split, L), the final norm and the LM head, and verification.

    torchrun --nproc_per_node=3 train_free_infer.py model.split=[10,19] prompt="..."   # N stages

With N ranks the middle ones run their layers in between and the last one does what rank 1 does with two
(speculative.rounds): one pipeline stage per rank, the layers cut at model.split (or auto).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading

if __name__ == "__main__" and {"--help", "-h"} & set(sys.argv[1:]):  # at once: not after torch loads (~4 s here)
    from launch.config import help_text
    print(help_text())
    sys.exit(0)

from launch.build import (build_drafter, build_stage, check_vocabularies, describe_rank, eos_ids, layer_cuts,
                          load_tokenizer, prompt_ids, rank_costs, rank_speed, resolve_models, settle_split)
from launch.config import ConfigError, TandemConfig, config_from_argv
from launch.distributed import (Interrupted, LaunchError, close_channel, open_links, report,
                                skip_the_final_collections_at_exit, torchrun_rank)
from launch.telemetry import Telemetry
from kvcache.static_cache import CacheOverflowError
from model_parallel.loader import ModelLoadError, load_config
from model_parallel.split import RankCosts
from netbridge import protocol
from netbridge.channel import PeerError, leave_last_words
from netbridge.frames import FrameError
from netbridge.protocol import Hello, Request
from speculative.output import Output
from speculative.rounds import NonFiniteLogits, run_middle, run_rank1
from speculative.session import Session, SpecSettings
from speculative.stats import broken_drafter_warning, summarize



EXPECTED = (ConfigError, LaunchError, ModelLoadError, PeerError, FrameError, CacheOverflowError, NonFiniteLogits,
            Interrupted)


def handshake(cfg: TandemConfig, channel, rank: int, ranks: int = 2, onward=None) -> None:
    """Before any rank loads anything. Each rank works out what it may hold (model.max_memory) and, for
    model.split=auto, how fast it runs its share, on its own device; the Hellos carry both. Every rank
    must run the same model; all settle the same split from all the Hellos (a given split wins over
    auto; given ones must agree), and a split that breaks a budget stops every rank here.
    The Hellos go around the ring, in on `channel` (from the rank before) and out on `onward`: rank r
    receives those of ranks 0..r-1 and sends 0..r on; the last rank sends 1..N-1 back to rank 0, which
    with N > 2 sends them down again for the middle ranks. With two ranks: rank 0's Hello, then rank 1's.
    Before the Hellos, rank 0's Timing says whether the ranks time at once or in turns (timing_together)."""
    onward = onward or channel
    given = None
    if cfg.model.split != "auto":  # each rank names its own config's mistake, before waiting for the others
        cuts, _ = layer_cuts(cfg, ranks)
        given = cuts[0] if ranks == 2 else cuts
    costs, source = rank_costs(cfg, rank, ranks, timed=False)
    last, timed = ranks - 1, cfg.model.split == "auto"
    together = timing_together(cfg, channel, onward, rank, last)
    if timed and (together or rank == 0):
        costs.layer_ms, costs.fixed_ms = rank_speed(cfg, rank, ranks)
    if rank == 0:
        mine = hello(cfg, costs, given)
        protocol.send(onward, mine)
        hellos = [mine] + [protocol.recv(channel, Hello) for _ in range(last)]
        for other in hellos[1:] if ranks > 2 else []:  # the second lap, for the middle ranks
            protocol.send(onward, other)
    else:
        hellos = [protocol.recv(channel, Hello) for _ in range(rank)]
        message = disagreement([*hellos, hello(cfg, costs, given)])
        if message:
            protocol.send(onward, protocol.Error(message))
            raise ConfigError(message)
        if timed and not together:  # in turns: the ranks before this one are done timing
            costs.layer_ms, costs.fixed_ms = rank_speed(cfg, rank, ranks)
        hellos.append(hello(cfg, costs, given))
        for other in hellos[1:] if rank == last else hellos:
            protocol.send(onward, other)
        if rank < last:  # a middle rank: the later ranks' Hellos come round from rank 0
            later = [protocol.recv(channel, Hello) for _ in range(last)]  # ranks 1..N-1
            if rank + 1 < last:
                for other in later:
                    protocol.send(onward, other)
            hellos += later[rank:]
    every = [RankCosts(h.budget, h.fixed_bytes, h.layer_bytes, h.layer_ms, h.fixed_ms) for h in hellos]
    splits = [h.split for h in hellos if h.split is not None]
    settle_split(cfg, every, splits[0] if splits else "auto")
    sys.stderr.write(f"[{describe_rank(cfg, rank, every, source, ranks)}]\n")  # one write: the ranks share a terminal
    sys.stderr.flush()


def timing_together(cfg: TandemConfig, channel, onward, rank: int, last: int) -> bool:
    """Whether the ranks time their shares (model.split=auto) at once or in turns, as rank 0 says (the
    handshake's first message, passed down the ring). At once with spec.overlap: in a round the ranks then
    work at the same time, so ranks that share a host's cores time what they will meet there; in turns
    without it, each rank after the Hellos before it, as a round runs them one after another."""
    if rank == 0:
        protocol.send(onward, protocol.Timing(bool(cfg.spec.overlap)))
        return bool(cfg.spec.overlap)
    together = protocol.recv(channel, protocol.Timing).together
    if rank < last:
        protocol.send(onward, protocol.Timing(together))
    return together


def hello(cfg: TandemConfig, costs: RankCosts, given) -> Hello:
    return Hello(load_config(cfg.model.target).num_hidden_layers, cfg.model.dtype, cfg.model.quant, given, costs.budget,
                 costs.fixed_bytes, costs.layer_bytes, costs.layer_ms, costs.fixed_ms)


def disagreement(hellos: list[Hello]) -> str | None:
    """The line every rank stops with when the last of `hellos` names another model than an earlier one
    (or another given split)."""
    mine, rank = hellos[-1], len(hellos) - 1
    diff = []
    for k in ["num_layers", "dtype", "quant", "version", "split"]:
        for i, theirs in reversed(list(enumerate(hellos[:-1]))):  # the nearest rank first
            a, b = getattr(theirs, k), getattr(mine, k)
            if k == "split" and None in (a, b):
                continue
            if a != b:
                diff.append(f"{k} (rank {i}: {a}, rank {rank}: {b})")
                break
    if not diff:
        return None
    return "the ranks disagree on " + ", ".join(diff) + "; give every rank the same config and Tandem version"


def rank0(cfg: TandemConfig, channel, listener=None, replies=None, ranks: int = 2) -> dict | None:
    """Rank 0's whole life: one answer (returned as the output JSON), or serving until a signal
    (on `listener`, the HTTP port bound at start). With N > 2 ranks `channel` goes to rank 1 and the
    last rank's `replies` come back on their own link."""
    announce(resolve_models(cfg, 0))
    handshake(cfg, replies or channel, 0, ranks, onward=channel)
    target_config = load_config(cfg.model.target)  # what can be checked is, before any weights load
    tokenizer = load_tokenizer(cfg.model.target)
    check_vocabularies(cfg, tokenizer, target_config)
    ids = prompt_ids(cfg, tokenizer, target_config.vocab_size) if cfg.serve.port is None else None
    stage = build_stage(cfg, 0, ranks)
    drafter = build_drafter(cfg, tokenizer, stage.config)
    spec = SpecSettings(cfg.spec.k, cfg.spec.adaptive, cfg.spec.overlap, cfg.spec.k_from_costs, cfg.model.prefill_chunk)
    session = Session(stage, drafter, channel, spec, replies)
    if cfg.serve.port is not None:
        from launch.server import serve
        serve(cfg, session, tokenizer, eos_ids(cfg.model.target), stage.config.vocab_size, listener)
        return None
    output = Output(tokenizer, eos_ids(cfg.model.target), cfg.gen.max_new_tokens, cfg.gen.stop, cfg.output.stream)
    try:
        result = answer(cfg, session, ids, output, tokenizer)
    except BaseException as e:
        # keep what was generated: the tokens committed so far, the text, and why it stopped
        kept = {"token_ids": output.tokens, "text": output.text(), "error": _one_line(e)}
        write_output(cfg, kept)
        status(f"[stopped after {len(output.tokens)} tokens]")
        raise
    session.close()
    write_output(cfg, result)
    if output.stop_reason == "stdout_closed":
        raise StdoutClosed()
    return result


class StdoutClosed(Exception):
    """The reader of stdout left (`| head`): the answer ended there, as a Unix filter's does."""
    exit_status = 128 + signal.SIGPIPE  # 141: what a shell shows for a filter a closed pipe stopped (SIGPIPE)


def announce(lines: list[str]) -> None:
    for line in lines:
        status(f"[{line}]")


def status(line: str) -> None:
    """A line on stderr in one write: the ranks share the terminal, and print() writes the newline apart."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def answer(cfg: TandemConfig, session: Session, ids: list[int], output: Output, tokenizer) -> dict:
    status(f"[prefill: {len(ids)} prompt tokens; k={cfg.spec.k}, drafter {cfg.draft.kind}]")
    telemetry = Telemetry(cfg, ids, tokenizer.decode(ids) if tokenizer else None) if cfg.log.dir else None
    request = Request(cfg.gen.temperature, cfg.gen.top_p, cfg.gen.seed)
    gen = session.generate(ids, output, request, on_round=telemetry.on_round if telemetry else None)
    stats = summarize(gen, cfg.spec.k, cfg.draft.kind if cfg.spec.k else "none")
    warning = broken_drafter_warning(stats)
    if warning:
        status(warning)
    status(f"[{stats['tokens']} tokens, {stats['tokens_per_s']:.2f} tokens/s, {stats['tokens_per_round']:.2f} tokens/round, "
           f"acceptance {stats['acceptance_rate']:.0%}, stop: {stats['stop_reason']}]")
    if telemetry:
        clock = telemetry.finish(gen, stats, output.text())
        status(f"[log: {telemetry.dir}; rank {telemetry.last_rank}'s clock {clock['offset_ms']:+.3f} +/- {clock['uncertainty_ms']:.3f} ms "
               f"from rank 0's over {clock['rounds']} round trips]")
    return {"token_ids": output.tokens, "text": output.text(), "stats": stats}


def write_output(cfg: TandemConfig, result: dict) -> None:
    if cfg.output.json:
        from launch.private_files import write_private
        write_private(cfg.output.json, json.dumps(result, indent=1))


def rank1(cfg: TandemConfig, channel, reply_to=None, ranks: int = 2) -> None:
    """The last rank: from the rank before it on `channel`, replies to rank 0 on `reply_to` (with two, `channel`)."""
    announce(resolve_models(cfg, ranks - 1))
    handshake(cfg, channel, ranks - 1, ranks, onward=reply_to)
    stage = build_stage(cfg, ranks - 1, ranks)
    if threading.current_thread() is threading.main_thread():
        _stop_after_grace()
    run_rank1(stage, channel, reply_to)
    if _signalled:  # rank 0 ended the session because the same signal stopped it
        raise Interrupted(_signalled[0])


def middle(cfg: TandemConfig, prev, next, rank: int, ranks: int) -> None:
    """A middle rank (N > 2): its layers between the rank before it (`prev`) and the one after it (`next`)."""
    announce(resolve_models(cfg, rank))
    handshake(cfg, prev, rank, ranks, onward=next)
    stage = build_stage(cfg, rank, ranks)
    if threading.current_thread() is threading.main_thread():
        _stop_after_grace()
    run_middle(stage, prev, next)
    if _signalled:
        raise Interrupted(_signalled[0])


_signalled: list[int] = []  # the signals this process received: its true cause when the peer then goes away


def _stop_after_grace(grace_s: int = 2) -> None:
    """Rank 1 (every rank after 0) on a signal: a Ctrl-C reaches every rank at once, and rank 0 then ends the session itself
    (Bye, or its own error), so rank 1 keeps serving the round in flight; only if that does not come
    within `grace_s` does it stop on its own."""
    def on_signal(signum, _frame):
        _signalled.append(signum)
        signal.signal(signal.SIGALRM, lambda *_: _raise_interrupted(signum))
        signal.alarm(grace_s)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def _raise_interrupted(signum, _frame=None):
    _signalled.append(signum)
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> None:
    try:
        cfg = config_from_argv(argv)  # exits 0 after printing the keys for --help / -h
    except ConfigError as e:
        # every rank on this host read the same command line: the first says so, each tells torchrun
        report(str(e), echo=os.environ.get("LOCAL_RANK", "0") == "0")
        sys.exit(1)
    if threading.current_thread() is threading.main_thread():  # (tests drive main() from threads)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _raise_interrupted)
    links, ranks, rank = None, 2, None
    try:
        rank, ranks = torchrun_rank()
        skip_the_final_collections_at_exit()
        listener, refused = None, None
        if rank == 0 and cfg.serve.port is not None:
            from launch.server import load_api_key, reserve_port
            try:
                load_api_key(cfg)  # an unreadable key file fails now, not after the weights load
                listener = reserve_port(cfg)  # before the process group opens ports of its own
            except EXPECTED as e:
                refused = e  # raised once the links are open: the other ranks, waiting to meet, hear it at once
        if refused is not None:
            _refuse(cfg, rank, ranks, refused)
        links = prev, next = open_links(cfg, rank, ranks)  # one channel both ways with two ranks
        if rank == 0:
            rank0(cfg, next, listener, replies=prev, ranks=ranks)
        elif rank == ranks - 1:
            rank1(cfg, prev, reply_to=next, ranks=ranks)
        else:
            middle(cfg, prev, next, rank, ranks)
    except StdoutClosed as e:  # rank 1 had its Bye: it leaves as after any answer
        _wait_for_peer_to_leave(links)
        _drop_stdout()
        sys.exit(e.exit_status)
    except EXPECTED as e:
        if _signalled and isinstance(e, PeerError):  # the peer left because the same Ctrl-C stopped it
            e = Interrupted(_signalled[0])
        report(str(e), rank)  # first: torchrun stops this rank as soon as the peer exits
        # a signal reaches every rank: the peer is stopping too, and may never read this
        _tell_peer(links, str(e), ranks, wait_s=0.5 if isinstance(e, Interrupted) else 5.0)
        sys.exit(128 + e.signum if isinstance(e, Interrupted) else 1)
    except BaseException as e:
        _tell_peer(links, _one_line(e), ranks)
        if not isinstance(e, SystemExit):  # Python prints the traceback; torchrun's summary ends with this line
            report(_one_line(e), rank, echo=False)
        raise
    finally:
        if links is not None:
            close_channel(*links)


def _wait_for_peer_to_leave(links, wait_s: float = 2.0) -> None:
    """Until the last rank, after its Bye, closes its end: torchrun stops the ranks still running as soon as one
    exits with a failure status, and a rank stopped on its way out would print a cause of its own."""
    channel = links[0]
    try:
        channel.timeout_s = min(channel.timeout_s, wait_s)
        channel.recv()
    except Exception:  # noqa: BLE001 - its leaving is what this waits for
        pass


def _drop_stdout() -> None:
    """stdout to /dev/null: Python flushes it at exit, and the closed pipe would fail that flush too."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


REFUSAL_WAIT_S = 30.0  # at most this (and transport.timeout_s) rank 0 waits for the others to meet, to tell them why it stops


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
        _tell_peer(opened[0], str(error), ranks, cause=error)
        close_channel(*opened[0])
    sys.exit(1)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if not isinstance(e, EXPECTED) else str(e)


def _tell_peer(links, message: str, ranks: int = 2, wait_s: float = 5.0, cause: BaseException | None = None) -> None:
    """Best effort: let the other rank exit with the cause instead of waiting out its timeout. Not after a
    PeerError that means the peer is gone; a frame this rank refused (tampered, replayed: a PeerError and a
    FrameError) leaves the peer there, waiting for the reason. With N > 2 the rank after this one on the
    ring, which passes it on (every rank waits on the one before it), whatever the cause."""
    cause = cause or sys.exc_info()[1]  # by default the exception being handled
    if not isinstance(cause, PeerError):  # this rank's own cause, for a peer that is sending, not receiving
        leave_last_words(message)
    if links is None or (ranks == 2 and isinstance(cause, PeerError) and not isinstance(cause, FrameError)):
        return
    channel = links[1]
    try:
        channel.timeout_s = min(channel.timeout_s, wait_s)
        protocol.send(channel, protocol.Error(message))
    except Exception:  # noqa: BLE001 - the peer may be gone already; our own error is what matters
        pass


if __name__ == "__main__":
    main()
