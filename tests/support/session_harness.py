"""One serving Session on rank 0 and the other ranks as threads, in process: several requests in a row
over the same caches, as a server sends them (the speculative and sampling tests share it)."""
import threading

from launch.build import build_drafter, build_prefixes, build_stage, eos_ids
from launch.ranks import last_rank, meet, middle_rank
from launch.config import load_config
from netbridge.channel import local_ring
from netbridge.protocol import SamplingParams
from speculative.output import Output
from speculative.rounds import Generation
from speculative.session import Session

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
MAX_NEW = 23  # not a multiple of K+1 for any K tested


def session_args(target, draft, max_new=MAX_NEW):
    # K up to 4, adaptive (the default): the drafter's cache and the adaptive K both carry over requests
    return [f"model.target={target}", "model.dtype=float32", "draft.kind=model", f"draft.model={draft}",
            "draft.dtype=float32", "spec.k=4", f"gen.max_new_tokens={max_new}"]


def serve(overrides: list[str], requests: list[tuple[list[int], SamplingParams]], ranks: int = 2, on_round=None,
          keep_going: bool = False) -> list[Generation | Exception]:
    """One Session on rank 0 (built as launch.ranks.first_rank builds it) serving `requests` in a row,
    the last rank (launch.ranks.last_rank) in a thread, over local_pair; with `ranks` > 2 the middle ranks
    (launch.ranks.middle_rank) in threads too, over local_ring. `on_round` goes to every generation;
    `keep_going`: a request that raises gives its exception in the list and the same session goes on (the
    server stops serving instead; a caller may keep the session)."""
    def one_by_one(session, cfg, eos):
        gens = []
        for ids, request in requests:
            output = Output(None, eos, cfg.gen.max_new_tokens, [], stream=False)
            try:
                gens.append(session.generate(ids, output, request, on_round=on_round))
            except Exception as e:  # noqa: BLE001 - handed to the test
                if not keep_going:
                    raise
                gens.append(e)
            session.idle()  # between requests, as a server does
        return gens
    return with_ranks(overrides, ranks, one_by_one)


def serve_together(overrides: list[str], requests: list[tuple], ranks: int = 2, slots: int = 8,
                   cancel_after: dict[int, int] | None = None, on_round=None, links=None, batches: int | None = None):
    """The same, but `requests` ((ids, SamplingParams[, max new tokens])) served at once as a server with
    serve.max_concurrent=`slots` does: admitted while a slot is free (in order), the rest waiting; `cancel_after`:
    {request index: the rounds of all requests together after which its client goes away}; `batches`: the
    Session's batches_on_the_way (None: from costs). Returns (the Generations in request order, the Session)."""
    cancel_after = cancel_after or {}

    def together(session, cfg, eos):
        waiting, gens, streams = list(enumerate(requests)), {}, {}
        while waiting or session.live:
            while waiting and session.free():
                i, (ids, request, *max_new) = waiting.pop(0)
                output = Output(None, eos, max_new[0] if max_new else cfg.gen.max_new_tokens, [], stream=False)
                gone = (lambda i=i: i in cancel_after and sum(len(t.gen.rounds) for t in streams.values()) >= cancel_after[i])
                streams[i] = session.admit(ids, output, request, on_round=on_round, cancelled=gone)
            for s in session.tick():
                gens[next(i for i, t in streams.items() if t is s)] = s.gen
        return [gens[i] for i in range(len(requests))], session
    return with_ranks(["serve.port=0", f"serve.max_concurrent={slots}", *overrides], ranks, together, links, batches)


def with_ranks(overrides: list[str], ranks: int, body, links=None, batches: int | None = None):
    """body(session, cfg, eos ids) on rank 0 with the other ranks in threads; its result. `links`: every rank's
    (from the rank before, to the rank after), default local_ring's (with two ranks local_pair's)."""
    serving = any(o.startswith("serve.port=") for o in overrides)  # a server takes no prompt of its own
    cfg = load_config(["output.stream=false", "chat=false", *([] if serving else ["prompt_ids=[1]"]), *overrides])
    links = links or local_ring(ranks, 30.0)
    errors = []

    def rank(r: int):
        prev, next = links[r]
        try:
            if r == ranks - 1:
                last_rank(cfg, prev, reply_to=next, ranks=ranks)
            else:
                middle_rank(cfg, prev, next, r, ranks)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)
            prev.close()
            next.close()
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, ranks)]
    for thread in threads:
        thread.start()
    replies, channel = links[0]
    try:
        plan = meet(cfg, replies, channel, 0, ranks)
        stage, drafter = build_stage(plan), build_drafter(plan)
        session = Session(stage, drafter, channel, plan.spec, replies=replies,
                          prefixes=build_prefixes(plan, stage, drafter), slots=plan.slots,  # cache.dir, when set
                          batches_on_the_way=batches)
        result = body(session, cfg, eos_ids(plan.models.target))
        session.close()
    except BaseException:
        channel.close()
        raise
    finally:
        for thread in threads:
            thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    if errors:
        raise errors[0]
    return result
