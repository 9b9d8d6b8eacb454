"""The figures of a generation, from its round records: what the output JSON's "stats" holds."""
from __future__ import annotations

from speculative.rounds import Generation


def summarize(gen: Generation, k: int, drafter: str) -> dict:
    rounds = gen.rounds[1:]  # round 0 is the prefill: no drafts, one token
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    tokens = len(gen.output.tokens)
    per_position = []
    for i in range(max((r.drafted for r in rounds), default=0)):
        tried = [r for r in rounds if r.drafted > i]
        per_position.append(sum(r.accepted > i for r in tried) / len(tried))
    decode_s = gen.total_s - gen.ttft_s
    middles = min((len(r.middle_ms) for r in rounds), default=0)  # N > 2: the ranks between rank 0 and the last

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else 0.0

    return {
        "tokens": tokens,
        "prompt_tokens": len(gen.prompt_ids),
        "prompt_tokens_reused": gen.reused,  # not prefilled again: in the caches from the last request, or from cache.dir
        "prompt_tokens_reused_from": {"memory": gen.reused - gen.reused_disk, "disk": gen.reused_disk},
        "stop_reason": gen.output.stop_reason,
        "k": k,
        "drafter": drafter,
        "rounds": len(gen.rounds),
        "decode_rounds": len(rounds),
        "tokens_per_round": mean(r.committed for r in rounds),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_per_position": per_position,
        "full_hit_rate": mean(r.accepted == r.drafted for r in rounds if r.drafted),
        "lookup_rounds": sum(r.looked_up for r in rounds),  # drafts found in the context, no model step (hybrid, ngram)
        "lookup_acceptance_rate": lookup_acceptance(rounds),
        "cut_lookups": sum(r.cut for r in rounds),  # lookups cut where the model parts from the copy
        "rounds_from_ahead": sum(r.from_ahead for r in rounds),  # spec.overlap: prepared while the last was in flight
        "in_flight_mean": mean(r.in_flight for r in gen.rounds),  # spec.in_flight: rounds on the way at each reply
        "bets_won": sum(r.bet is True for r in gen.rounds),  # rounds prepared ahead whose bet held
        "bets_lost": sum(r.bet is False for r in gen.rounds),
        "rounds_dropped": sum(r.bets_lost for r in gen.rounds),  # sent ahead on a bet that failed
        "dropped_later_ms": sum(r.wasted_ms for r in gen.rounds),  # the later ranks' work on them
        "ttft_s": gen.ttft_s,
        "total_s": gen.total_s,
        "tokens_per_s": (tokens - 1) / decode_s if decode_s > 0 and tokens > 1 else 0.0,
        # the cost model's (speculative.cost_model; 0: none): each decode round's prediction at its K with the
        # acceptance measured so far, over the run as the measured figure is (tokens over their predicted time)
        "predicted_tokens_per_s": held_back(gen.predicted_tokens_per_s or predicted_rate(rounds), tokens - 1,
                                            gen.predicted_held_s),
        # ... the same at the costs as timed at start-up (the prediction above prices each part at the pace the
        # rounds measured, cost_model.PaceTally): the two apart, the host's pace moved from its start-up timing
        "predicted_tokens_per_s_timed": held_back(gen.predicted_tokens_per_s_timed, tokens - 1, gen.predicted_held_s),
        "predicted_ttft_s": gen.predicted_ttft_s,
        "mean_ms": {
            "draft": mean(r.draft_ms for r in rounds),
            "stage0": mean(r.stage0_ms for r in rounds),
            "last": mean(r.last_ms for r in rounds),  # the last rank: its layers, head and verification
            "stage1": mean(r.last_ms for r in rounds),  # the same: its name before N ranks (docs/running.md)
            "network": mean(r.network_ms for r in rounds),
            "ahead": mean(r.ahead_ms for r in rounds),
            "round": mean(r.draft_ms + r.stage0_ms + r.round_ms for r in rounds),
            **({"middle": [mean(r.middle_ms[i] for r in rounds) for i in range(middles)]} if middles else {}),
        },
        "busy_fraction": busy_fraction(rounds, decode_s, middles),
    }


def predicted_rate(rounds) -> float:
    """The decode rounds' tokens over the time the cost model gave each (its tokens at its predicted rate)."""
    timed = [r for r in rounds if r.predicted_tokens_per_s > 0]
    seconds = sum(r.committed / r.predicted_tokens_per_s for r in timed)
    return sum(r.committed for r in timed) / seconds if seconds > 0 else 0.0


def held_back(rate: float, tokens: int, held_s: float) -> float:
    """`tokens` decoded at `rate` tokens/s, and `held_s` more waiting behind prompts admitted later (no rate: 0)."""
    return tokens / (tokens / rate + held_s) if rate > 0 and tokens > 0 else rate


def lookup_acceptance(rounds) -> float:
    """Accepted / drafted over the rounds whose drafts were looked up (draft.kind=hybrid: how well the lookup
    chose; the model's rounds are the rest)."""
    drafted = sum(r.drafted for r in rounds if r.looked_up)
    return sum(r.accepted for r in rounds if r.looked_up) / drafted if drafted else 0.0


def busy_fraction(rounds, decode_s: float, middles: int = 0) -> list[float]:
    """Per rank (0, the middle ones, the last), the share of the decode time it computed: rank 0 drafting
    (ahead too) and its slice, a middle rank its slice, the last rank its slice, head and verification."""
    if decode_s <= 0 or not rounds:
        return [0.0] * (middles + 2)
    busy = [sum(r.draft_ms + r.stage0_ms + r.ahead_ms for r in rounds)]
    busy += [sum(r.middle_ms[i] for r in rounds) for i in range(middles)]
    busy.append(sum(r.last_ms for r in rounds))
    return [ms / 1000 / decode_s for ms in busy]


def broken_drafter_warning(stats: dict, min_rounds: int = 16) -> str | None:
    """A neural drafter that agrees with the target on nothing, round after round, is almost always
    a bug (elsewhere this was how a broken graph capture showed itself), not a bad drafter."""
    if stats["drafter"] in ("model", "hybrid") and stats["decode_rounds"] >= min_rounds and stats["k"] > 0 \
            and stats["acceptance_rate"] == 0.0:
        return (f"warning: {stats['decode_rounds']} rounds with a mean of 1.00 tokens per round: the drafter never "
                "agreed with the target. Check that draft.model shares the target's tokenizer and family; "
                "with draft.graph=on, compare against draft.graph=off.")
    return None
