"""Tandem's entry: the same script on both ranks; each asks torchrun which rank it is.

    torchrun --nproc_per_node=2 train_free_infer.py prompt="Write a Python function that reverses a string."
    torchrun --nproc_per_node=2 train_free_infer.py serve.port=8000      # an OpenAI-compatible API

Rank 0: embeddings + layers [0, split), the drafter, the tokenizer and the output (or the HTTP API).
Rank 1: layers [split, L), the final norm and the LM head, and verification.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading

from launch.build import (build_drafter, build_stage, check_vocabularies, describe_rank, eos_ids, load_tokenizer,
                          prompt_ids, rank_costs, resolve_models, settle_split, split_point)
from launch.config import ConfigError, TandemConfig, config_from_argv
from launch.distributed import (Interrupted, LaunchError, close_channel, open_channel, report,
                                skip_the_final_collections_at_exit, torchrun_rank)
from launch.telemetry import Telemetry
from kvcache.static_cache import CacheOverflowError
from model_parallel.loader import ModelLoadError, load_config
from model_parallel.split import RankCosts
from netbridge import protocol
from netbridge.channel import PeerError
from netbridge.frames import FrameError
from netbridge.protocol import Hello, Request
from speculative.output import Output
from speculative.rounds import NonFiniteLogits, run_rank1
from speculative.session import Session
from speculative.stats import broken_drafter_warning, summarize



EXPECTED = (ConfigError, LaunchError, ModelLoadError, PeerError, FrameError, CacheOverflowError, NonFiniteLogits,
            Interrupted)


def handshake(cfg: TandemConfig, channel, rank: int) -> None:
    """Before either rank loads anything. Each rank works out what it may hold (model.max_memory) and,
    for model.split=auto, how fast it runs its share, on its own device; the Hellos carry both. Both
    ranks must run the same model; both settle the same split from the two Hellos (a given split wins
    over auto; two given ones must agree), and a split that breaks a budget stops both here."""
    if cfg.model.split != "auto":
        split_point(cfg)  # each rank names its own config's mistake, before waiting for the other
    costs, source = rank_costs(cfg, rank)
    given = None if cfg.model.split == "auto" else split_point(cfg)[0]
    mine = Hello(load_config(cfg.model.target).num_hidden_layers, cfg.model.dtype, cfg.model.quant, given, costs.budget,
                 costs.fixed_bytes, costs.layer_bytes, costs.layer_ms, costs.fixed_ms)
    if rank == 0:
        protocol.send(channel, mine)
        hellos = [mine, protocol.recv(channel, Hello)]
    else:
        theirs = protocol.recv(channel, Hello)
        message = disagreement(theirs, mine)
        if message:
            protocol.send(channel, protocol.Error(message))
            raise ConfigError(message)
        protocol.send(channel, mine)
        hellos = [theirs, mine]
    every = [RankCosts(h.budget, h.fixed_bytes, h.layer_bytes, h.layer_ms, h.fixed_ms) for h in hellos]
    splits = [h.split for h in hellos if h.split is not None]
    settle_split(cfg, every, splits[0] if splits else "auto")
    sys.stderr.write(f"[{describe_rank(cfg, rank, every, source)}]\n")  # one write: the ranks share a terminal
    sys.stderr.flush()


def disagreement(rank0: Hello, rank1: Hello) -> str | None:
    """The line both ranks stop with when their Hellos name different models (or two different splits)."""
    fields = ["num_layers", "dtype", "quant", "version"] + (["split"] if None not in (rank0.split, rank1.split) else [])
    diff = [(k, getattr(rank0, k), getattr(rank1, k)) for k in fields if getattr(rank0, k) != getattr(rank1, k)]
    if not diff:
        return None
    return ("the ranks disagree on " + ", ".join(f"{k} (rank 0: {a}, rank 1: {b})" for k, a, b in diff)
            + "; give both the same config and Tandem version")


def rank0(cfg: TandemConfig, channel, listener=None) -> dict | None:
    """Rank 0's whole life: one answer (returned as the output JSON), or serving until a signal
    (on `listener`, the HTTP port bound at start)."""
    announce(resolve_models(cfg, 0))
    handshake(cfg, channel, 0)
    target_config = load_config(cfg.model.target)  # what can be checked is, before any weights load
    tokenizer = load_tokenizer(cfg.model.target)
    check_vocabularies(cfg, tokenizer, target_config)
    ids = prompt_ids(cfg, tokenizer, target_config.vocab_size) if cfg.serve.port is None else None
    stage = build_stage(cfg, 0)
    drafter = build_drafter(cfg, tokenizer, stage.config)
    session = Session(stage, drafter, channel, cfg.spec.k, cfg.spec.adaptive, cfg.spec.overlap, cfg.model.prefill_chunk,
                      cfg.spec.k_from_costs)
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
        print(f"[stopped after {len(output.tokens)} tokens]", file=sys.stderr, flush=True)
        raise
    session.close()
    write_output(cfg, result)
    return result


def announce(lines: list[str]) -> None:
    for line in lines:
        print(f"[{line}]", file=sys.stderr, flush=True)


def answer(cfg: TandemConfig, session: Session, ids: list[int], output: Output, tokenizer) -> dict:
    print(f"[prefill: {len(ids)} prompt tokens; k={cfg.spec.k}, drafter {cfg.draft.kind}]", file=sys.stderr, flush=True)
    telemetry = Telemetry(cfg, ids, tokenizer.decode(ids) if tokenizer else None) if cfg.log.dir else None
    request = Request(cfg.gen.temperature, cfg.gen.top_p, cfg.gen.seed)
    gen = session.generate(ids, output, request, on_round=telemetry.on_round if telemetry else None)
    stats = summarize(gen, cfg.spec.k, cfg.draft.kind if cfg.spec.k else "none")
    warning = broken_drafter_warning(stats)
    if warning:
        print(warning, file=sys.stderr)
    print(f"[{stats['tokens']} tokens, {stats['tokens_per_s']:.2f} tokens/s, {stats['tokens_per_round']:.2f} tokens/round, "
          f"acceptance {stats['acceptance_rate']:.0%}, stop: {stats['stop_reason']}]", file=sys.stderr)
    if telemetry:
        clock = telemetry.finish(gen, stats, output.text())
        print(f"[log: {telemetry.dir}; rank 1's clock {clock['offset_ms']:+.3f} +/- {clock['uncertainty_ms']:.3f} ms "
              f"from rank 0's over {clock['rounds']} round trips]", file=sys.stderr)
    return {"token_ids": output.tokens, "text": output.text(), "stats": stats}


def write_output(cfg: TandemConfig, result: dict) -> None:
    if cfg.output.json:
        with open(cfg.output.json, "w") as f:
            json.dump(result, f, indent=1)


def rank1(cfg: TandemConfig, channel) -> None:
    announce(resolve_models(cfg, 1))
    handshake(cfg, channel, 1)
    stage = build_stage(cfg, 1)
    if threading.current_thread() is threading.main_thread():
        _stop_after_grace()
    run_rank1(stage, channel)
    if _signalled:  # rank 0 ended the session because the same signal stopped it
        raise Interrupted(_signalled[0])


_signalled: list[int] = []  # the signals this process received: its true cause when the peer then goes away


def _stop_after_grace(grace_s: int = 2) -> None:
    """Rank 1 on a signal: a Ctrl-C reaches both ranks at once, and rank 0 then ends the session itself
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
    channel, rank = None, None
    try:
        rank, _ = torchrun_rank()
        skip_the_final_collections_at_exit()
        listener = None
        if rank == 0 and cfg.serve.port is not None:
            from launch.server import load_api_key, reserve_port
            load_api_key(cfg)  # an unreadable key file fails now, not after the weights load
            listener = reserve_port(cfg)  # before the process group opens ports of its own
        channel = open_channel(cfg, rank)
        rank0(cfg, channel, listener) if rank == 0 else rank1(cfg, channel)
    except EXPECTED as e:
        if _signalled and isinstance(e, PeerError):  # the peer left because the same Ctrl-C stopped it
            e = Interrupted(_signalled[0])
        report(str(e), rank)  # first: torchrun stops this rank as soon as the peer exits
        # a signal reaches both ranks: the peer is stopping too, and may never read this
        _tell_peer(channel, str(e), wait_s=0.5 if isinstance(e, Interrupted) else 5.0)
        sys.exit(128 + e.signum if isinstance(e, Interrupted) else 1)
    except BaseException as e:
        _tell_peer(channel, _one_line(e))
        if not isinstance(e, SystemExit):  # Python prints the traceback; torchrun's summary ends with this line
            report(_one_line(e), rank, echo=False)
        raise
    finally:
        if channel is not None:
            close_channel(channel)


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if not isinstance(e, EXPECTED) else str(e)


def _tell_peer(channel, message: str, wait_s: float = 5.0) -> None:
    """Best effort: let the other rank exit with the cause instead of waiting out its timeout. Not after a
    PeerError that means the peer is gone; a frame this rank refused (tampered, replayed: a PeerError and a
    FrameError) leaves the peer there, waiting for the reason."""
    cause = sys.exc_info()[1]
    if channel is None or (isinstance(cause, PeerError) and not isinstance(cause, FrameError)):
        return
    try:
        channel.timeout_s = min(channel.timeout_s, wait_s)
        protocol.send(channel, protocol.Error(message))
    except Exception:  # noqa: BLE001 - the peer may be gone already; our own error is what matters
        pass


if __name__ == "__main__":
    main()
