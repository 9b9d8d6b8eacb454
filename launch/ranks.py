"""Each rank's life once its links are open: open its models, meet the other ranks (launch.handshake, which
gives the Plan), build what the Plan gives it, run.

    first_rank   rank 0: embeddings + its layers, the drafter, the tokenizer, the Session (a FirstRank); then
                 answer_once (the output JSON) or the HTTP API (launch.serve.server.serve): the entry decides
    middle_rank  N > 2: its layers, between the rank before it and the one after it
    last_rank    the last layers, the final norm and the head, and verification

The ring: every rank receives from the one before it (`prev`) and sends to the one after it (`next`);
with two ranks both are one channel.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
from dataclasses import dataclass
from functools import partial

from launch.build import (build_drafter, build_prefixes, build_stage, check_vocabularies, eos_ids, load_tokenizer,
                          prompt_ids)
from launch.config import TandemConfig
from launch.distributed import Interrupted, error_line
from launch.handshake import handshake
from launch.plan import Models, Plan, open_models
from launch.prediction import plan_predictor, planned_depth, prediction_line
from netbridge.protocol import SamplingParams
from speculative.output import Output
from speculative.grammar import FolderGrammars
from speculative.rounds import run_last, run_middle
from speculative.session import Session
from speculative.stats import broken_drafter_warning, summarize


class StdoutClosed(Exception):
    """The reader of stdout left (`| head`): the answer ended there, as a Unix filter's does."""
    exit_status = 128 + signal.SIGPIPE  # 141: what a shell shows for a filter a closed pipe stopped (SIGPIPE)


def status(line: str) -> None:
    """A line on stderr in one write: the ranks share the terminal, and print() writes the newline apart."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def announce(lines) -> None:
    for line in lines:
        status(f"[{line}]")


def meet(cfg: TandemConfig, prev, next, rank: int, ranks: int) -> Plan:
    """This rank's models opened (their start-up lines), then the Plan the ranks agree on."""
    models = open_models(cfg, rank)
    announce(models.lines)
    return handshake(cfg, models, prev, next, rank, ranks)


@dataclass
class FirstRank:
    """Rank 0 once the ranks have met: what answering once and serving both start from."""
    plan: Plan
    session: Session
    tokenizer: object
    ids: list[int] | None  # the prompt, checked (answering once); None when serving
    eos_ids: set[int]
    vocab_size: int


def first_rank(cfg: TandemConfig, next, replies=None, ranks: int = 2) -> FirstRank:
    """Rank 0 up to its Session: its models opened, the prompt read and checked, the ranks met, its stage and
    drafter built. The last rank's replies come back on `replies` (with two ranks, `next` itself)."""
    replies = replies or next
    models = open_models(cfg, 0)
    announce(models.lines)
    tokenizer, ids = read_prompt(cfg, models)
    plan = handshake(cfg, models, replies, next, 0, ranks)
    status(f"[{prediction_line(plan)}]")
    stage = build_stage(plan)
    drafter = build_drafter(plan)
    session = Session(stage, drafter, next, plan.spec, replies, build_prefixes(plan, stage, drafter), slots=plan.slots,
                      predictor=plan_predictor(plan), depth_at_start=planned_depth(plan))
    return FirstRank(plan, session, tokenizer, ids, eos_ids(plan.models.target), stage.config.vocab_size)


def plan_only(cfg: TandemConfig, prev, next, rank: int, ranks: int) -> None:
    """plan_only=true: this rank's models opened (config.json, the checkpoints' headers; rank 0 checks the
    vocabularies), the ranks met, their links probed and every rank timed (the handshake: its start-up line says the
    layers and bytes it would hold), and rank 0's prediction; then the rank leaves, no weight loaded."""
    models = open_models(cfg, rank)
    announce(models.lines)
    if rank == 0:
        check_vocabularies(models, load_tokenizer(models.target.folder))
    plan = handshake(cfg, models, prev, next, rank, ranks)
    if rank == 0:
        status(f"[{prediction_line(plan)}]")
        status(f"[plan only (plan_only=true): {ranks} ranks planned, no weight loaded; leave plan_only out to run]")


def answer_once(first: FirstRank) -> dict:
    """One answer to the prompt, written as the output JSON (output.json) and returned; on a failure what was
    generated so far is written, then the error raised."""
    cfg, session, tokenizer, ids = first.plan.settings, first.session, first.tokenizer, first.ids
    output = Output(tokenizer, first.eos_ids, cfg.gen.max_new_tokens, cfg.gen.stop, cfg.output.stream)
    try:
        result = answer(first.plan, session, ids, output, tokenizer)
    except BaseException as e:
        # keep what was generated: the tokens committed so far, the text, and why it stopped
        write_output(cfg, {"token_ids": output.tokens, "text": output.text(), "error": error_line(e)})
        status(f"[stopped after {len(output.tokens)} tokens]")
        raise
    session.close()
    write_output(cfg, result)
    if output.stop_reason == "stdout_closed":
        raise StdoutClosed()
    return result


def read_prompt(cfg: TandemConfig, models: Models) -> tuple[object, list[int] | None]:
    """Rank 0's tokenizer, checked against the models, and (one answer) the prompt as ids, checked: from the files
    alone, before the ranks meet (with model.split=auto they time their layers) and before any weight loads. A
    refusal here reaches the other ranks where they wait to meet this one."""
    tokenizer = load_tokenizer(models.target.folder)
    check_vocabularies(models, tokenizer)
    ids = prompt_ids(cfg, tokenizer, models.target.config.vocab_size) if cfg.serve.port is None else None
    return tokenizer, ids


def answer(plan: Plan, session: Session, ids: list[int], output: Output, tokenizer) -> dict:
    from launch.telemetry import Telemetry
    cfg = plan.settings
    status(f"[prefill: {len(ids)} prompt tokens; k={cfg.spec.k}, drafter {cfg.draft.kind}]")
    telemetry = Telemetry(cfg, ids, tokenizer.decode(ids) if tokenizer else None, plan.links) if cfg.log.dir else None
    params = SamplingParams(cfg.gen.temperature, cfg.gen.top_p, cfg.gen.seed)
    gen = session.generate(ids, output, params, on_round=telemetry.on_round if telemetry else None)
    stats = summarize(gen, cfg.spec.k, cfg.draft.kind if cfg.spec.k else "none")
    warning = broken_drafter_warning(stats)
    if warning:
        status(warning)
    status(f"[{stats['tokens']} tokens, {stats['tokens_per_s']:.2f} tokens/s, {stats['tokens_per_round']:.2f} tokens/round, "
           f"acceptance {stats['acceptance_rate']:.0%}, {looked_up(stats)}stop: {stats['stop_reason']}]")
    if telemetry:
        clock = telemetry.finish(gen, stats, output.text())
        status(f"[log: {telemetry.dir}; rank {telemetry.last_rank}'s clock {clock['offset_ms']:+.3f} +/- {clock['uncertainty_ms']:.3f} ms "
               f"from rank 0's over {clock['rounds']} round trips]")
    return {"token_ids": output.tokens, "text": output.text(), "stats": stats}


def looked_up(stats: dict) -> str:
    """draft.kind=hybrid: how many rounds prompt lookup proposed (no model step), for the last status line."""
    return f"{stats['lookup_rounds']} of {stats['decode_rounds']} rounds looked up, " if stats["drafter"] == "hybrid" else ""


def write_output(cfg: TandemConfig, result: dict) -> None:
    if cfg.output.json:
        from launch.private_files import write_private
        write_private(cfg.output.json, json.dumps(result, indent=1))


def last_rank(cfg: TandemConfig, prev, reply_to=None, ranks: int = 2) -> None:
    """The last rank: from the rank before it on `prev`, replies to rank 0 on `reply_to` (with two, `prev`)."""
    reply_to = reply_to or prev
    plan = meet(cfg, prev, reply_to, ranks - 1, ranks)
    stage = build_stage(plan)
    target = plan.models.target  # structured outputs: the last rank masks by each request's grammar
    grammars = FolderGrammars(target.folder, target.config.vocab_size, eos_ids(target))
    _serve_rounds(partial(run_last, grammars=grammars), stage, prev, reply_to, build_prefixes(plan, stage))


def middle_rank(cfg: TandemConfig, prev, next, rank: int, ranks: int) -> None:
    """A middle rank (N > 2): its layers between the rank before it (`prev`) and the one after it (`next`)."""
    plan = meet(cfg, prev, next, rank, ranks)
    stage = build_stage(plan)
    _serve_rounds(run_middle, stage, prev, next, build_prefixes(plan, stage))


def _serve_rounds(run, stage, prev, next, prefixes=None) -> None:
    if threading.current_thread() is threading.main_thread():
        _stop_after_grace()
    run(stage, prev, next, prefixes)
    if prefixes is not None:
        prefixes.close()  # every saved block on disk before the process exits
    if signalled:  # rank 0 ended the session because the same signal stopped it
        raise Interrupted(signalled[0])


signalled: list[int] = []  # the signals this process received: its true cause when the peer then goes away


def _stop_after_grace(grace_s: int = 2) -> None:
    """Every rank after 0 on a signal: a Ctrl-C reaches every rank at once, and rank 0 then ends the session
    itself (Bye, or its own error), so this rank keeps serving the round in flight; only if that does not
    come within `grace_s` does it stop on its own."""
    def on_signal(signum, _frame):
        signalled.append(signum)
        signal.signal(signal.SIGALRM, lambda *_: raise_interrupted(signum))
        signal.alarm(grace_s)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def raise_interrupted(signum, _frame=None):
    signalled.append(signum)
    raise Interrupted(signum)
