"""What the cost model (speculative.cost_model) predicts for a Plan: its Pipeline from every rank's timing and
every link's probe, the settings it would run, and the start-up line.

    p = plan_pipeline(plan)            # the ranks' costs at the split, the links, the drafter, a prior acceptance
    s = planned_settings(plan, p)      # K, depth, batches: as given, or ('auto') from the model
    planned_depth(plan)                # the depth a lone stream starts at (spec.in_flight=auto: the model's)
    prediction_line(plan)              # "predicted: X tokens/s one stream, Y for N at once, TTFT of 2k: Z s"
    workload_cuts(plan)                # workload.streams: the split that ends that workload soonest
"""
from __future__ import annotations

from dataclasses import replace

from speculative import cost_model
from speculative.cost_model import Acceptance, LinkCost, Pipeline, Prediction, Settings, Workload

PROMPT_TOKENS = 2048  # the start-up line's TTFT: a 2k-token prompt, nothing cached
PRIOR_ACCEPTANCE = 0.7  # a model drafter's chance per draft before any is measured (the embedded pair: 0.78-0.83)
# workload.*: a split other than one stream's only when the model ends the workload this much sooner on it. The
# model's figures aim within 15% of what runs, and before rounds measure acceptance it prices one stream's
# chained bets at a flat prior, where the pair's kept drafts rise with position (0.83, 0.95, 1.0 for drafts 1-3,
# its bets held 0.69 of the time, against 0.7^(K+1)): a nearer call favours a split that may not be faster.
WORKLOAD_MARGIN = 0.15


def link_costs(plan) -> tuple[LinkCost, ...]:
    """Every ring link as the handshake measured it (link i: rank i -> i+1, the last the reply to rank 0): half
    its round trip one way, its sending rate, what a message behind another costs its ends; none measured (one
    process): free links."""
    links = getattr(plan, "links", ()) or ()
    if len(links) != plan.ranks:
        return tuple(LinkCost() for _ in range(plan.ranks))
    return tuple(LinkCost(link.rtt_ms / 2, link.send_mbps, link.message_ms) for link in links)


def plan_pipeline(plan) -> Pipeline:
    """The Pipeline of `plan`: each rank's timed costs at its layers (untimed ranks cost nothing: a given split),
    the probed links, the bytes of a token's hidden state, a prior acceptance."""
    from launch.plan import draft_steps, drafts_with_model
    from model_parallel.loader import DTYPES
    from model_parallel.split import CONTEXT
    cfg = plan.settings
    counts = [len(plan.layers(r)) for r in range(plan.ranks)]
    hidden = plan.models.target.config.hidden_size * DTYPES[cfg.model.dtype].itemsize
    prior = PRIOR_ACCEPTANCE if cfg.spec.k > 0 else cost_model.PRIOR_ACCEPTANCE
    steps = draft_steps(cfg) if drafts_with_model(cfg) else 0
    p = cost_model.from_rank_costs(plan.costs, counts, list(link_costs(plan)), cfg.spec.k + 1, steps, hidden,
                                   bool(cfg.spec.overlap), Acceptance(prior=prior), timed_context=CONTEXT)
    return with_draft_rows(p, plan.models.draft_format)


def with_draft_rows(p: Pipeline, draft_format) -> Pipeline:
    """The drafter's ms per row more in a step as draft.quant=auto timed it at one row and at the slots' (a 4-bit
    step's first extra row costs most: from one row on it dequantizes), where it did; else the timing's token slope."""
    step_ms = getattr(draft_format, "step_ms", None) or {}
    most = max(step_ms, default=1)
    if most <= 1 or not p.draft.step_ms:
        return p
    row_ms = max(step_ms[most] - step_ms[1], 0.0) / (most - 1)
    return replace(p, draft=replace(p.draft, row_ms=row_ms))


def planned_settings(plan, p: Pipeline) -> Settings:
    """The K, depth and batch count the run starts from: spec.k (spec.k_from_costs: the model's best K within
    it, at its best depth spec.in_flight allows), spec.in_flight (auto: the model's at that K), the batches the
    model picks for the KV slots."""
    spec = plan.settings.spec
    depths = cost_model.depths_allowed(spec.in_flight)
    k = cost_model.best_k(p, spec.k, depths) if spec.k_from_costs and spec.k > 0 else spec.k
    depth = cost_model.best_depth(p, k) if spec.in_flight == "auto" else int(spec.in_flight)
    return Settings(k, depth, cost_model.best_batches(p, k, plan.slots) if plan.slots > 1 else 1)


def planned_depth(plan) -> int:
    """The depth a lone stream starts at: spec.in_flight, or (auto) the model's at start-up (1 when the ranks
    were not timed)."""
    if plan.settings.spec.in_flight != "auto":
        return int(plan.settings.spec.in_flight)
    return planned_settings(plan, plan_pipeline(plan)).depth if timed_everywhere(plan) else 1


def plan_prediction(plan) -> Prediction:
    p = plan_pipeline(plan)
    chunk = plan.settings.model.prefill_chunk
    return cost_model.predict(p, planned_settings(plan, p), plan.slots, PROMPT_TOKENS, chunk)


def plan_predictor(plan) -> cost_model.Predictor | None:
    """The run's Predictor (None when the ranks were not timed: nothing to predict from)."""
    if not timed_everywhere(plan):
        return None
    return cost_model.Predictor(plan_pipeline(plan), plan.settings.model.prefill_chunk)


def planned_workload(plan) -> Workload | None:
    """workload.*, its streams at most the KV slots (the rest would wait), or None (none given)."""
    w = plan.settings.workload
    return None if w.streams is None else Workload(min(w.streams, plan.slots), w.prompt_tokens, w.answer_tokens)


def workload_seconds(plan) -> tuple[float, int]:
    """(seconds, K): when the planned workload ends on `plan`'s split at its best K (spec.k_from_costs: any in
    0..spec.k; else spec.k) and depths (spec.in_flight)."""
    spec, p = plan.settings.spec, plan_pipeline(plan)
    ks = range(spec.k + 1) if spec.k_from_costs else (spec.k,)
    return cost_model.best_for_workload(p, planned_workload(plan), ks, plan.settings.model.prefill_chunk,
                                        cost_model.depths_allowed(spec.in_flight))


def workload_cuts(plan) -> list[int]:
    """The split that ends workload.* soonest by the cost model (model_parallel.split.best_split), where it ends
    it more than WORKLOAD_MARGIN sooner than `plan`'s (one stream's decode round balanced) would: one split cannot
    serve every workload best (the embedded pair over two ranks: one stream runs fastest with 1 of 28 layers on
    rank 0, whose drafting hides behind the other 27; four 2,000-token prompts at once with 16, at K=0, their
    prefill pipelined)."""
    seconds = lambda cuts: workload_seconds(replace(plan, cuts=list(cuts)))[0]
    return split_for_workload(plan.num_layers, plan.costs, list(plan.cuts), seconds)


def split_for_workload(num_layers: int, costs, one_stream: list[int], seconds) -> list[int]:
    """Of the splits that fit `costs`, the one with the fewest `seconds(cuts)` (model_parallel.split.best_split),
    where that is more than WORKLOAD_MARGIN fewer than one stream's split's; else that one (a launch's
    workload_cuts, launch.project --workload)."""
    from model_parallel.split import best_split
    best = best_split(num_layers, costs, one_stream, seconds)
    return best if seconds(best) * (1 + WORKLOAD_MARGIN) < seconds(one_stream) else list(one_stream)


def workload_line(plan) -> str:
    """What the plan predicts for workload.* (empty when none was given)."""
    w = planned_workload(plan)
    if w is None or not timed_everywhere(plan):
        return ""
    from launch.plan import split_text
    from model_parallel.split import place_layers
    seconds, k = workload_seconds(plan)
    one = place_layers(plan.num_layers, plan.costs)
    other = (f"; the one-stream split ({split_text(one)}): {workload_seconds(replace(plan, cuts=one))[0]:.1f} s"
             if one != plan.cuts else "")
    return (f"; planned for workload.streams={w.streams} at once, {w.prompt_tokens}-token prompts and "
            f"{w.answer_tokens}-token answers: model.split={split_text(plan.cuts)} ends them in {seconds:.1f} s "
            f"(K={k}){other}")


def timed_everywhere(plan) -> bool:
    return all(c.layer_ms > 0 for c in plan.costs)


def prediction_line(plan) -> str:
    """The start-up line: what the model predicts here (a prior acceptance until rounds measure it)."""
    if not timed_everywhere(plan):
        return "predicted: nothing (model.split was given, so the ranks were not timed; model.split=auto times them)"
    pred = plan_prediction(plan)
    s = pred.settings
    together = (f", {pred.aggregate_tokens_per_s:.1f} tokens/s for {pred.streams} at once in {s.batches} "
                f"batch{'es' if s.batches > 1 else ''}" if pred.streams > 1 else "")
    drafts = f" at acceptance {PRIOR_ACCEPTANCE:g} per draft until measured" if s.k else ""
    from model_parallel.split import CONTEXT
    long = (f"{pred.long_stream_tokens_per_s:.1f}" + (f" and {pred.long_aggregate_tokens_per_s:.1f}"
                                                       if pred.streams > 1 else ""))
    return (f"predicted: {pred.stream_tokens_per_s:.1f} tokens/s for one stream (K={s.k}, {s.depth} round"
            f"{'s' if s.depth > 1 else ''} on the way{drafts}){together}, {CONTEXT} tokens cached; {long} after "
            f"{pred.prompt_tokens}; TTFT of a {pred.prompt_tokens}-token prompt {pred.ttft_s:.2f} s"
            f"{workload_line(plan)} (speculative.cost_model)")
