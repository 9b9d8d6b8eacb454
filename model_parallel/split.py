"""Where the layers go: by memory first, by speed second, over N ranks.

Each rank says what it may hold and how fast it is (`RankCosts`: its model.max_memory budget, the
bytes it holds besides its layers, one layer's bytes, one layer's ms over a round's block and its
other ms per round), measured on its own device. `place_layers` then picks, among the splits whose
bytes fit every rank's budget, the one that makes the busiest rank least busy; on a tie, the most even.

Per round of K drafts (overlap or not, a round takes about the busiest rank's time):
    first rank:  the drafter's K+1 steps (launch.plan.draft_steps) + its layers over a block of K+1
    middle rank: its layers over the block
    last rank:   its layers + the final norm and LM head over the block
The costs are timed (`time_rank`) on the modules a run calls, built from config.json with placeholder weights
in the run's dtype (or NF4 / int8), in eval mode as a loaded stage is, through Stage.forward over a KV cache
holding a short context, with the threads this process runs with: every part in turn, after a warm-up (which
also takes bitsandbytes' one-time repack of a 4-bit weight), for about WINDOW_S, medians. `draft_step_ms` times
one drafter step the same way, for several formats and batch rows at once (model_parallel.draft_format).
"""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, field, replace

import torch

CONTEXT = 128  # cached tokens the timed block attends over (a short chat: prompt + some output)
MAX_HEAD_ROWS = 32768  # an LM head taller than this is timed on a slice and scaled (memory)


class NoFit(ValueError):
    """No split fits the budgets (or a given one does not); the message says by how much."""


@dataclass
class RankCosts:
    budget: int  # bytes this rank may hold (model.max_memory)
    fixed_bytes: int  # besides its layers: embeddings, drafter and its cache (first); norm + head (last)
    layer_bytes: int  # one layer: weights + its KV cache at this rank's max_len
    layer_ms: float = 0.0  # one layer over a round's block, timed on this rank (0: not timed)
    fixed_ms: float = 0.0  # besides its layers, per round: the drafter's steps (first); the head (last)
    slot_fixed_bytes: int = 0  # what each KV slot adds besides its layers' keys and values (the drafter's cache)
    slot_layer_bytes: int = 0  # what each KV slot adds per layer: its keys and values at max_len
    slots: int = 1  # the KV slots (requests served at once) fixed_bytes and layer_bytes count
    layer_token_ms: float = 0.0  # one layer's ms per token more than the block timed (prefill; 0: not timed)
    draft_step_ms: float = 0.0  # rank 0: one drafter step, of fixed_ms (the cost model's drafting apart)
    attend_ms: float = 0.0  # one layer's ms per token per earlier token (a long prompt's attention; 0: not timed)
    draft_token_ms: float = 0.0  # rank 0: the drafter's ms per token more than a step (catch-up; a row more)
    draft_attend_ms: float = 0.0  # rank 0: the drafter's attention ms per token per earlier token
    alone_layer_ms: float = 0.0  # spec.overlap: layer_ms timed again while the other ranks idle (0: not timed)
    alone_draft_step_ms: float = 0.0  # ... and rank 0's draft_step_ms (0: not timed)
    alone_layer_token_ms: float = 0.0  # ... and layer_token_ms (a prefill chunk's per token; 0: not timed)
    alone_attend_ms: float = 0.0  # ... and attend_ms (0: not timed)
    alone_prefill_ms: list = field(default_factory=list)  # ... and [tokens, one layer's ms over a chunk of them]
    # at each of prefill_sizes (time_alone; empty: not timed)
    alone_draft_prefill_ms: list = field(default_factory=list)  # rank 0: [tokens, the drafter's ms taking in a chunk
    # of them] at each of prefill_sizes, alone (time_intake; empty: not timed)
    context_ms: float = 0.0  # a decode block: one layer's ms per token per cached token beyond CONTEXT (0: not timed)
    draft_context_ms: float = 0.0  # rank 0: a drafter step's ms per cached token beyond CONTEXT (the whole drafter)
    context_row_ms: float = 0.0  # context_ms for each row more in a batch (0: not timed)
    draft_context_row_ms: float = 0.0  # rank 0: draft_context_ms for each row more in a batched step (0: not timed)
    layer_row_ms: float = 0.0  # one layer's ms per row more in a batch of streams' blocks, its tokens included
    head_row_ms: float = 0.0  # the last rank: the head's ms per row more (each row's K + 1 logits; 0: no head)
    draft_row_ms: float = 0.0  # rank 0: a drafter step's ms per row more (every layer and the head; 0: not timed)
    core_share: float = 0.0  # the share of its host's cores its work takes: its threads over them (0: on a GPU)
    host_rank: int = 0  # its place among its host's ranks (torchrun's LOCAL_RANK): ranks of one host share its cores

    def at(self, slots: int) -> RankCosts:
        """These costs with `slots` KV slots (serve.max_concurrent): each slot its own cache on every layer."""
        more = slots - self.slots
        return replace(self, fixed_bytes=self.fixed_bytes + more * self.slot_fixed_bytes,
                       layer_bytes=self.layer_bytes + more * self.slot_layer_bytes, slots=slots)

    def slot_bytes(self, layers: int) -> int:
        """One KV slot's bytes on this rank with `layers` layers."""
        return self.slot_fixed_bytes + layers * self.slot_layer_bytes

    def bytes_for(self, layers: int) -> int:
        return self.fixed_bytes + layers * self.layer_bytes

    def ms_for(self, layers: int) -> float:
        return self.fixed_ms + layers * self.layer_ms

    def max_layers(self) -> int:
        """The most layers that fit the budget (< 1: not even one)."""
        if self.budget < self.fixed_bytes:
            return -1
        return (self.budget - self.fixed_bytes) // max(self.layer_bytes, 1)


def _memory_caps(num_layers: int, ranks: list[RankCosts]) -> list[int] | None:
    """The most layers each rank's budget holds (each leaving at least one to every other), or None when
    no split fits them all."""
    n = len(ranks)
    caps = [min(r.max_layers(), num_layers - n + 1) for r in ranks]
    return None if num_layers < n or min(caps) < 1 or sum(caps) < num_layers else caps


def place_layers(num_layers: int, ranks: list[RankCosts]) -> list[int]:
    """The N-1 cut points (rank r runs layers [cuts[r-1], cuts[r])) that fit every budget and make the
    busiest rank least busy; among those, the most even. Raises NoFit when no split fits."""
    n = len(ranks)
    memory_caps = _memory_caps(num_layers, ranks)
    if memory_caps is None:
        raise NoFit(no_fit_message(num_layers, ranks))
    candidates = sorted({r.ms_for(k) for r, cap in zip(ranks, memory_caps) for k in range(1, cap + 1)})
    low, high = 0, len(candidates) - 1  # the least busy-time bound some split meets (feasibility is monotone)
    while low < high:
        mid = (low + high) // 2
        if sum(_caps(ranks, memory_caps, candidates[mid])) >= num_layers and min(_caps(ranks, memory_caps, candidates[mid])) >= 1:
            high = mid
        else:
            low = mid + 1
    counts = _most_even(_caps(ranks, memory_caps, candidates[low]), num_layers)
    return [sum(counts[:i + 1]) for i in range(n - 1)]


MAX_SPLITS = 4000  # best_split tries every split that fits up to this many (two or three ranks); past it, steps


def best_split(num_layers: int, ranks: list[RankCosts], start: list[int], seconds) -> list[int]:
    """The cuts that fit every budget with the fewest `seconds(cuts)` (a workload's, from the cost model): every
    split when there are at most MAX_SPLITS, else from `start` (a split that fits) one cut one layer at a time while
    that ends sooner. Ties go to the earlier split tried (`start` first)."""
    fits = lambda cuts: all(a < b for a, b in zip([0, *cuts], [*cuts, num_layers])) and \
        not over_budget(num_layers, ranks, cuts)
    if math.comb(num_layers - 1, len(ranks) - 1) <= MAX_SPLITS:
        every = [list(c) for c in itertools.combinations(range(1, num_layers), len(ranks) - 1)]
        return min([start, *(c for c in every if c != start and fits(c))], key=seconds)
    best, best_s = list(start), seconds(start)
    while True:
        steps = [best[:i] + [best[i] + d] + best[i + 1:] for i in range(len(best)) for d in (-1, 1)]
        timed = [(seconds(c), c) for c in steps if fits(c)]
        if not timed or min(timed)[0] >= best_s:
            return best
        best_s, best = min(timed)


def _caps(ranks: list[RankCosts], memory_caps: list[int], bound_ms: float) -> list[int]:
    """The most layers each rank may take without exceeding its memory or `bound_ms` per round."""
    caps = []
    for r, cap in zip(ranks, memory_caps):
        if r.layer_ms <= 0:
            caps.append(cap if r.fixed_ms <= bound_ms else 0)
        else:
            caps.append(min(cap, math.floor((bound_ms - r.fixed_ms) / r.layer_ms + 1e-9)))
    return caps


def _most_even(caps: list[int], num_layers: int) -> list[int]:
    """Layer counts within 1..caps[r] that add up to num_layers, as even as the caps allow."""
    counts = [1] * len(caps)
    for _ in range(num_layers - len(caps)):
        r = min((c, r) for r, c in enumerate(counts) if c < caps[r])[1]
        counts[r] += 1
    return counts


def most_slots(num_layers: int, ranks: list[RankCosts], most: int, cuts: list[int] | None = None) -> int:
    """The most KV slots (<= `most`) every rank's budget holds at once, each slot its own cache on every layer:
    with `cuts`, on that split; without, on some split (place_layers then picks the fastest of those). 0: not
    one. Counted down from `most`: a few memory checks, and the slots go first (they are what serving asks
    for), the split is then the fastest that holds them."""
    for slots in range(most, 0, -1):
        at = [r.at(slots) for r in ranks]
        fits = _memory_caps(num_layers, at) is not None if cuts is None else not over_budget(num_layers, at, cuts)
        if fits:
            return slots
    return 0


def layer_counts(num_layers: int, cuts: list[int]) -> list[int]:
    bounds = [0, *cuts, num_layers]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def over_budget(num_layers: int, ranks: list[RankCosts], cuts: list[int]) -> list[tuple[int, int, int]]:
    """(rank, bytes it would hold, its budget) for each rank the split puts over its budget."""
    counts = layer_counts(num_layers, cuts)
    return [(i, r.bytes_for(c), r.budget) for i, (r, c) in enumerate(zip(ranks, counts)) if r.bytes_for(c) > r.budget]


def fitting_splits(num_layers: int, ranks: list[RankCosts]) -> range | None:
    """The single cuts (rank 1's first layer) whose bytes fit both budgets of two ranks; None when none fits,
    or for more ranks (whose fitting cuts are no range)."""
    if len(ranks) != 2:
        return None
    first, second = (min(r.max_layers(), num_layers - 1) for r in ranks)
    low, high = max(1, num_layers - second), first
    return range(low, high + 1) if low <= high else None


def no_fit_message(num_layers: int, ranks: list[RankCosts]) -> str:
    from model_parallel.lines import human
    per_rank = "; ".join(f"rank {i} may hold {human(r.budget)} and needs {human(r.fixed_bytes)} before its layers"
                         for i, r in enumerate(ranks))
    need = sum(r.fixed_bytes for r in ranks) + num_layers * min(r.layer_bytes for r in ranks)
    return (f"model.max_memory: no split of the {num_layers} layers fits ({per_rank}; a layer with its KV cache needs "
            f"{human(max(r.layer_bytes for r in ranks))}; all together need {human(need)}, the budgets add up to "
            f"{human(sum(r.budget for r in ranks))})")


# --- timing, on this rank's device --------------------------------------------------------------

STAGE_SIZES = (1, 3)  # layers in the two stages timed: one layer is their difference / 2, the rest the call's
PROBE_TOKENS = 128  # a one-layer stage is also timed over a block this long: its slope is a layer's ms per token
# (from a block of 128 on: a CPU's matrix products run near their full rate there, as over a 512-token chunk)
# ... and timed alone over chunks of these many tokens besides the round's block, 128 and a whole chunk (time_alone):
# a chunk's cost is no line in its size. A one-layer 1.5B stage here (Intel Xeon, avx512_bf16 + AMX, one thread,
# 2026-12-06, freed memory reused: launch.distributed.reuse_freed_memory) read 11.2 ms over 5 tokens, 12.7 over 32,
# 14.8 over 33 (its matrix products change kernel past 32 rows), 16.5 over 40, 17.7 over 48, 18.4 over 64, 22.5 over
# 128, 32.8 over 256 and 63.8 over 512: rising steeply past 33 and slowly to 128, then faster again. A line through
# 33 and 128 gave 15.4 at 40 (-7%), one through 128 and 512 gave 36.3 at 256 (+11%); with 48, 64 and 256 timed too,
# within 2%.
PREFILL_SIZES = (32, 33, 48, 64, 256)
LONG_CONTEXT = 1024  # ... and after this many cached tokens: the slope is attention's ms per token per earlier one
DECODE_CONTEXT = 2048  # ... and a round's block after this many: its slope is a decode round's cost per cached token
ROW_PROBE = 4  # ... and over this many rows of the block (several streams' in one forward): its slope is a row's cost
WINDOW_S = 1.5  # each run is repeated, in turn with the others, for about this long after its warm-up
MIN_SAMPLES, MAX_SAMPLES, WARMUP = 5, 25, 2
STEP_REPS = 10  # steps_ms: tries of a round's drafter steps back to back
QUICK_S = 0.5  # MIN_SAMPLES cycles this quick are enough: a GPU's times hold still (and tests' tiny models: their
# time_alone's ten runs, a three-layer stage over 512 tokens among them, take 36-50 ms a cycle; the 1.5B's ~900)
SLOW_SAMPLES = 3  # a warm-up cycle over WINDOW_S is warm-up enough and this many cycles after it: a big model on a
# host without fast kernels for its dtype (the embedded pair's 1.5B target in bf16 on a CPU without avx512_bf16:
# time_alone's cycle ~14 s, its seven cycles ~100 s on each rank, one rank after another at start-up)


def median_ms(runs: dict, window_s: float = WINDOW_S) -> dict:
    """Median ms of each of `runs` (sample_ms)."""
    return {name: statistics.median(ms) for name, ms in sample_ms(runs, window_s).items()}


def sample_ms(runs: dict, window_s: float = WINDOW_S) -> dict:
    """Every ms of each of `runs` (callables that end synchronised with their device). They run in
    turn, one each per cycle, so load that comes and goes in the meantime falls on all of them alike,
    for `window_s` (at least MIN_SAMPLES cycles, at most MAX_SAMPLES; MIN_SAMPLES when those took under
    QUICK_S) after WARMUP cycles; after one warm-up cycle slower than `window_s`, SLOW_SAMPLES cycles."""
    least = MIN_SAMPLES
    for warmup in range(WARMUP):
        start = time.perf_counter()
        for run in runs.values():
            run()
        if warmup == 0 and time.perf_counter() - start > window_s:
            least = SLOW_SAMPLES
            break
    times = {name: [] for name in runs}
    start = time.perf_counter()
    for cycle in range(MAX_SAMPLES):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1000)
        elapsed = time.perf_counter() - start
        if cycle + 1 >= least and (elapsed >= window_s or elapsed < QUICK_S):
            break
    return times


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def _classes(model):
    """The model's own decoder-layer, rotary and norm classes (from its meta-device shell, loader.ModelSource)
    and its config cut to as many layers as the largest stage timed."""
    import copy
    small = copy.deepcopy(model.config)
    small.num_hidden_layers = max(STAGE_SIZES)
    if getattr(small, "layer_types", None):  # (repeated where the model has fewer layers)
        small.layer_types = (small.layer_types * max(STAGE_SIZES))[:max(STAGE_SIZES)]
    shell = model.shell
    return type(shell.model.layers[0]), type(shell.model.rotary_emb), type(shell.model.norm), small


def _placeholder(module: torch.nn.Module, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """`module` (built on meta) on `device` in `dtype` with small weights: the values do not change a
    forward's time, only its shapes and dtype do, and a constant is the cheapest to write (a 7B layer's
    normal_ takes ~1 s on a CPU core)."""
    module = module.to(dtype).to_empty(device=device)  # the cast on meta: no full-precision copy first
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(0.02)
    return module.eval().requires_grad_(False)


def _layers(model, n: int, device: str, dtype: torch.dtype, quant=None) -> list[torch.nn.Module]:
    """`n` decoder layers of `model`'s shapes with placeholder weights (`dtype`; NF4 or int8 with `quant`), every
    layer its own weights, as in a real stage."""
    layer_cls, _, _, small = _classes(model)

    def layer(i: int):
        with torch.device("meta"):
            built = layer_cls(small, i)
        built = _placeholder(built, device, dtype)
        if quant is not None:
            from model_parallel.quant import quantize_linears
            quantize_linears(built, quant)  # each quantized module in eval mode, as the layer it went into
        return built
    return [layer(i) for i in range(n)]


def _stage(model, layers: list[torch.nn.Module], device: str, capacity: int, dtype: torch.dtype, rows: int = 1):
    from model_parallel.stage import Stage
    _, rotary_cls, _, small = _classes(model)
    stage = Stage(small, layers, 0, rotary_cls(config=small).to(device)).eval()
    stage.allocate_cache(capacity, dtype, slots=rows)
    return stage


def _forward(stage, hidden: torch.Tensor, context: int, device: str):
    """A forward of `hidden` (rows x tokens) through `stage` after `context` cached tokens in each row's slot: its
    first `context` slots stand for cached tokens, which attention reads whatever they hold, so nothing need
    compute them."""
    slots = list(range(hidden.shape[0]))

    def block():
        for slot in slots:
            stage.cache.rewind(context, slot)
        stage(hidden, live=context + hidden.shape[1], rows=slots)
        _sync(device)
    return block


def _hidden(model, rows: int, tokens: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, tokens, _classes(model)[3].hidden_size, dtype=dtype, device=device) * 0.1


def stage_runs(model, tokens: int, device: str, dtype: torch.dtype, quant=None, context: int = CONTEXT,
               rows: int = 1, sizes: tuple[int, ...] = STAGE_SIZES) -> dict:
    """{layers: a forward of `tokens` tokens after `context` cached ones} for a stage of each size in
    STAGE_SIZES, through Stage.forward as a round calls it (placeholder weights of `model`'s shapes, `dtype`,
    NF4 or int8 with `quant`; every layer its own weights, as in a real stage); `rows` requests at once, each in
    its own KV slot (a batched draft step)."""
    hidden = _hidden(model, rows, tokens, device, dtype)
    runs = {}
    for n in sizes:  # each stage its own layers: none is still in a CPU cache from the other's call
        stage = _stage(model, _layers(model, n, device, dtype, quant), device, context + tokens, dtype, rows)
        runs[n] = _forward(stage, hidden, context, device)
    return runs


def chunk_runs(model, shapes: list[tuple[int, int]], device: str, dtype: torch.dtype, quant=None) -> dict:
    """{(tokens, context): a forward of a chunk of `tokens` after `context` cached} through one stage of
    STAGE_SIZES[-1] layers for all of `shapes`: its layers' weights stream from memory on every call, as in a
    stage of many. A one-layer stage called again and again keeps part of its layer in the CPU's caches: its
    chunks' costs beyond the block's read 4.5 ms over 40 tokens where a 12-layer stage's read 5.9 a layer (one
    1.5B layer, 2026-12-06)."""
    stage = _stage(model, _layers(model, STAGE_SIZES[-1], device, dtype, quant), device,
                   max(tokens + context for tokens, context in shapes), dtype)
    return {(tokens, context): _forward(stage, _hidden(model, 1, tokens, device, dtype), context, device)
            for tokens, context in shapes}


def layer_and_call_ms(ms: dict) -> tuple[float, float]:
    """(ms per layer, ms per stage call besides its layers: positions, mask, rotary) from the medians of
    the stages of STAGE_SIZES layers."""
    one, many = STAGE_SIZES
    layer_ms = (ms[many] - ms[one]) / (many - one)
    if layer_ms <= 0:  # noise larger than a layer (tiny models): count the larger stage as its layers
        return ms[many] / many, 0.0
    return layer_ms, max(ms[one] - layer_ms, 0.0)


def head_run(model, tokens: int, device: str, dtype: torch.dtype, quant=None, rows: int = 1):
    """(the final norm + LM head over `tokens` positions of `rows` requests, logits to fp32 as Stage.forward
    returns them; the factor from its ms to the whole head's): a head taller than MAX_HEAD_ROWS runs on a slice."""
    _, _, norm_cls, small = _classes(model)
    config = model.config
    height = min(config.vocab_size, MAX_HEAD_ROWS)
    with torch.device("meta"):
        norm = norm_cls(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6))
        head = torch.nn.Linear(config.hidden_size, height, bias=False)
    norm, head = _placeholder(norm, device, dtype), _placeholder(head, device, dtype)
    if quant is not None and quant.lm_head:
        head = quant.linear(head)  # in eval mode, as the placeholder was
    hidden = torch.randn(rows, tokens, config.hidden_size, dtype=dtype, device=device) * 0.1

    @torch.inference_mode()
    def run():
        head(norm(hidden)).float().argmax(-1)
        _sync(device)
    return run, config.vocab_size / height


@dataclass
class Timed:
    """A model (loader.ModelSource) whose forward a rank times: `tokens` per call (a round's block, or one
    for a drafter step), `calls` per round, and whether the call ends in the head."""
    model: object
    tokens: int
    device: str
    dtype: torch.dtype
    quant: object = None
    head: bool = False
    calls: int = 1


@dataclass(frozen=True)
class Speed:
    """A rank's timing (time_rank): what RankCosts' *_ms fields hold."""
    layer_ms: float  # one target layer over the round's block
    fixed_ms: float  # the rest of the rank's work per round (the drafter's steps, the head)
    layer_token_ms: float = 0.0  # one target layer's ms per token more than the block
    draft_step_ms: float = 0.0  # one drafter step
    attend_ms: float = 0.0  # one target layer's ms per token per earlier token (attention over a long context)
    draft_token_ms: float = 0.0  # the whole drafter's ms per token more (a prompt's catch-up, or one more row)
    draft_attend_ms: float = 0.0  # the whole drafter's attention ms per token per earlier token
    context_ms: float = 0.0  # one target layer's ms per token of the round's block per cached token beyond CONTEXT
    draft_context_ms: float = 0.0  # the whole drafter's step, ms per cached token beyond CONTEXT
    context_row_ms: float = 0.0  # context_ms for each row more (a batch of ROW_PROBE rows' blocks)
    draft_context_row_ms: float = 0.0  # draft_context_ms for each row more (a step over ROW_PROBE rows)
    layer_row_ms: float = 0.0  # one target layer's ms per row more than one (a batch of streams' blocks)
    head_row_ms: float = 0.0  # the head's ms per row more (0: no head)
    draft_row_ms: float = 0.0  # a drafter step's ms per row more (its every layer and its head)


def probe_size(target: Timed) -> int:
    """The tokens time_rank's prefill probe runs over: PROBE_TOKENS, or twice the round's block where that is longer
    (a slope from a difference of sizes; time_alone times chunks of prefill_sizes instead)."""
    return max(PROBE_TOKENS, 2 * target.tokens)


def prefill_sizes(target: Timed, chunk: int) -> tuple[int, ...]:
    """The chunk sizes time_alone times a layer over: the round's block, PREFILL_SIZES, PROBE_TOKENS and a whole
    chunk, none longer than a chunk (no longer one crosses)."""
    return tuple(sorted({n for n in (target.tokens, *PREFILL_SIZES, PROBE_TOKENS) if n < chunk} | {chunk}))


def probe_runs(runs: dict, name, model: Timed, probe: int) -> None:
    """A one-layer stage of `model` over `probe` tokens after CONTEXT and after LONG_CONTEXT cached ones."""
    for context in (CONTEXT, LONG_CONTEXT):
        runs[name, context] = stage_runs(model.model, probe, model.device, model.dtype, model.quant, context=context,
                                         sizes=(1,))[1]


def long_runs(runs: dict, name, model: Timed) -> None:
    """A one-layer stage of `model` timed (no head) over its block after DECODE_CONTEXT cached tokens: beside the
    same after CONTEXT, its slope is what a decode round's attention costs per cached token. The prefill probe's
    slope does not give it: over a few tokens the attention's work per cached token is a few times a 128-token
    chunk's per token, its fixed parts (reading the cache, the grouped heads' copy) shared by fewer tokens (three
    1.5B layers over 5 tokens, 40 -> 2,000 cached, timed directly: +10 to +14 ms; the prefill slope said +3 to +9,
    this one +12 to +15; the tiny model's four over one token: +0.17 to +0.22, +0.05 and +0.27 to +0.34). And the
    same over ROW_PROBE rows (rows_runs' after CONTEXT beside it): a row more's cost per cached token, which is not
    the first row's (the rows share each read of the weights; a step's rows each read their own slot)."""
    runs[name, "long"] = stage_runs(model.model, model.tokens, model.device, model.dtype, model.quant,
                                    context=DECODE_CONTEXT, sizes=(1,))[1]
    runs[name, "rows long"] = stage_runs(model.model, model.tokens, model.device, model.dtype, model.quant,
                                         context=DECODE_CONTEXT, rows=ROW_PROBE, sizes=(1,))[1]


def step_runs(model: Timed) -> dict:
    """A one-layer stage of the drafter over its step's token after CONTEXT and after DECODE_CONTEXT cached ones,
    over one row and over ROW_PROBE rows (a batch's step, its slots in order as the scheduler gives them), keyed by
    (rows, context): timed back to back (steps_ms), their slopes are what a step costs per cached token and per
    row more."""
    return {(rows, context): stage_runs(model.model, model.tokens, model.device, model.dtype, model.quant,
                                        context=context, rows=rows, sizes=(1,))[1]
            for rows in (1, ROW_PROBE) for context in (CONTEXT, DECODE_CONTEXT)}


def steps_ms(runs: dict, calls: int, reps: int = STEP_REPS) -> dict:
    """{name: the fastest of `reps` means of `calls` back-to-back calls} for each of `runs`, one run after the other
    (not in turn with every other part): a round's drafter steps run back to back over the same cache. Timed in turn
    with the rest, a small drafter's step read 0.068 ms more per 1,000 cached tokens a layer where its real steps
    cost 0.029 (back to back 0.026: bench/draft_context.py; the embedded 0.5B drafter's figures move 2-6x between
    runs every way)."""
    return {name: min(means) for name, means in step_means_ms(runs, calls, reps).items()}


def step_means_ms(runs: dict, calls: int, reps: int = STEP_REPS) -> dict:
    """{name: every one of `reps` means of `calls` back-to-back calls} for each of `runs`, one run after the other
    (steps_ms keeps the fastest)."""
    out = {}
    for name, run in runs.items():
        run()  # its first call after the others' is no step of a round
        out[name] = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            out[name].append((time.perf_counter() - t0) * 1000 / calls)
    return out


def rows_runs(runs: dict, name, model: Timed, layer: bool = True) -> None:
    """A one-layer stage of `model` over ROW_PROBE rows of its block (several streams' blocks as one forward, each
    in its own slot; not with `layer` False), and its head over them too where it has one: beside the same over one
    row, the slope is what a batch pays per stream (the tiny model's four layers: 0.8 ms timed over one row of one
    token, 1.55 ms over four rows in a traced round; a batch of rows is not a longer block: each row attends over
    its own slot). A drafter's layer over several rows is timed with its steps instead (step_runs)."""
    if layer:
        runs[name, "rows"] = stage_runs(model.model, model.tokens, model.device, model.dtype, model.quant,
                                        rows=ROW_PROBE, sizes=(1,))[1]
    if model.head:
        runs[name, "rows head"] = head_run(model.model, model.tokens, model.device, model.dtype, model.quant,
                                           rows=ROW_PROBE)[0]


def layer_row_slope(ms: dict, name) -> float:
    """One layer's ms per row more from rows_runs' and the same over one row (their fastest runs: a small
    difference, which load only adds to)."""
    return max(ms[name, "rows"] - ms[name, 1], 0.0) / (ROW_PROBE - 1)


def head_row_slope(ms: dict, name, model: Timed, scale: float) -> float:
    """The head's ms per row more (0: no head), as layer_row_slope."""
    return max(ms[name, "rows head"] - ms[name, "head"], 0.0) * scale / (ROW_PROBE - 1) if model.head else 0.0


def context_row_slope(ms: dict, name, tokens: int) -> float:
    """context_slope for each row more: the ROW_PROBE rows' slope (rows_runs', long_runs') less one row's, over
    the rows more."""
    rows = ms[name, "rows long"] - ms[name, "rows"]
    return max(rows - (ms[name, "long"] - ms[name, 1]), 0.0) / ((ROW_PROBE - 1) * tokens * (DECODE_CONTEXT - CONTEXT))


def context_slope(ms: dict, name, tokens: int) -> float:
    """One layer's ms per token of a decode block per cached token, from long_runs' and the same stage after
    CONTEXT (their fastest runs: a difference of a tenth of a millisecond on a small model, where a run the
    scheduler paused once reads milliseconds slower: medians of the few runs a quick window takes gave 1.2 ms a
    layer per 1k tokens where 0.03 is right, on a loaded host)."""
    return max(ms[name, "long"] - ms[name, 1], 0.0) / (tokens * (DECODE_CONTEXT - CONTEXT))


def step_slopes(drafter: Timed) -> tuple[float, float, float]:
    """(One drafter layer's ms per row more in a step, its ms per cached token over one row, the same for each row
    more), its `calls` steps back to back as a round runs them. A row more timed in turn with the rest read three
    times what it costs a round: the tiny drafter's 0.40 ms a step (every layer and the head; rank 0's start-up
    line in bench.cost_grid's launches), where its rounds over four rows cost 0.13 ms a row a step more than over
    one (bench/draft_context.py --rows 4)."""
    ms = steps_ms(step_runs(drafter), max(drafter.calls, 1))
    span = drafter.tokens * (DECODE_CONTEXT - CONTEXT)
    one = max(ms[1, DECODE_CONTEXT] - ms[1, CONTEXT], 0.0)
    rows = max(ms[ROW_PROBE, DECODE_CONTEXT] - ms[ROW_PROBE, CONTEXT], 0.0)
    row = max(ms[ROW_PROBE, CONTEXT] - ms[1, CONTEXT], 0.0) / (ROW_PROBE - 1)
    return row, one / span, max(rows - one, 0.0) / ((ROW_PROBE - 1) * span)


def slopes(ms: dict, name, block_ms: float, block: int, probe: int) -> tuple[float, float]:
    """(a layer's ms per token more than a block of `block`, its ms per token per earlier token) from probe_runs'."""
    token_ms = max(ms[name, CONTEXT] - block_ms, 0.0) / (probe - block)
    return token_ms, max(ms[name, LONG_CONTEXT] - ms[name, CONTEXT], 0.0) / (probe * (LONG_CONTEXT - CONTEXT))


def time_rank(target: Timed, drafter: Timed | None = None, window_s: float = WINDOW_S) -> Speed:
    """The target's stage call (and head, if `target.head`), plus `drafter.calls` drafter steps (every layer, the
    norm and the head over one token); a one-layer stage of each also over PROBE_TOKENS tokens, after a short and a
    long context: their slopes are the per-token and attention costs a prefill chunk adds (speculative.cost_model);
    and a one-layer stage of each over its block after DECODE_CONTEXT: a decode round's cost per cached token; each
    also over ROW_PROBE rows: a row more's. Every part is timed here, in turn with the others, in one window
    (median_ms), but the drafter's steps after the two contexts over one row and over ROW_PROBE rows: back to back,
    as a round runs them (steps_ms)."""
    runs, scale = {}, {}
    for name, model in (("target", target), ("drafter", drafter)):
        if model is not None:
            scale[name] = add_runs(runs, name, model)
    probe = probe_size(target)
    probe_runs(runs, "probe", target, probe)
    long_runs(runs, "target", target)
    rows_runs(runs, "target", target)
    if drafter is not None:
        probe_runs(runs, "drafter probe", drafter, probe)
        rows_runs(runs, "drafter", drafter, layer=False)
    samples = sample_ms(runs, window_s)
    ms = {name: statistics.median(v) for name, v in samples.items()}
    fastest = {name: min(v) for name, v in samples.items()}  # a slope from a small difference: load only adds
    layer_ms, call_ms = layer_and_call_ms({n: ms["target", n] for n in STAGE_SIZES})
    other_ms = call_ms + (ms["target", "head"] * scale["target"] if target.head else 0.0)
    token_ms, attend_ms = slopes(ms, "probe", ms["target", 1], target.tokens, probe)
    layer_row_ms = layer_row_slope(fastest, "target")
    head_row_ms = head_row_slope(fastest, "target", target, scale["target"])
    speed = Speed(layer_ms, other_ms, token_ms, attend_ms=attend_ms,
                  context_ms=context_slope(fastest, "target", target.tokens),
                  context_row_ms=context_row_slope(fastest, "target", target.tokens), layer_row_ms=layer_row_ms,
                  head_row_ms=head_row_ms)
    if drafter is not None:
        step_ms = model_ms(ms, "drafter", drafter, scale["drafter"])
        layers = drafter.model.config.num_hidden_layers
        draft_token, draft_attend = slopes(ms, "drafter probe", ms["drafter", 1], drafter.tokens, probe)
        draft_layer_row, draft_context, draft_context_row = step_slopes(drafter)
        draft_head_row = head_row_slope(fastest, "drafter", drafter, scale["drafter"])
        speed = replace(speed, fixed_ms=other_ms + drafter.calls * step_ms, draft_step_ms=step_ms,
                        draft_token_ms=layers * draft_token, draft_attend_ms=layers * draft_attend,
                        draft_context_ms=layers * draft_context, draft_context_row_ms=layers * draft_context_row,
                        draft_row_ms=layers * draft_layer_row + draft_head_row)
    _release(target, drafter)
    return speed


def time_alone(target: Timed, chunk: int, window_s: float = WINDOW_S) -> dict:
    """RankCosts' alone_* figures of the target, timed by themselves (no head, drafter or other probes): one layer
    over the round's block (time_rank's layer_ms), and over a prefill chunk of each of prefill_sizes after CONTEXT
    cached tokens (alone_prefill_ms) and a whole chunk after LONG_CONTEXT too: attention's slope (alone_attend_ms),
    the chunks through one stage of STAGE_SIZES[-1] layers (chunk_runs), each layer's share of its more over the
    stage as deep over the block added to the block's layer; the line through the block and PROBE_TOKENS
    (alone_layer_token_ms) prices a block of another size. This is the handshake's second timing, alone, beside
    the one with every rank at once: a chunk's slopes at once read 1.4-2.8x these where three ranks shared two cores
    (the embedded pair's target, 2026-12-06), though its chunks run at once only while the pipe is full, and the
    host's cores bound that (cost_model.host_ms). A whole chunk's
    difference of contexts, not the 128-token probe's: one 1.5B layer's attention slope from the probe read 1.9e-5
    to 5.4e-5 ms in three timings a minute apart, where 512-token chunks after 0 to 1,536 tokens cost 1.7e-5."""
    runs: dict = {}
    add_runs(runs, "target", replace(target, head=False))
    sizes, depth = prefill_sizes(target, chunk), STAGE_SIZES[-1]
    shapes = [(n, CONTEXT) for n in sizes if n != target.tokens] + [(chunk, LONG_CONTEXT)]  # (the block's: add_runs')
    for (n, context), run in chunk_runs(target.model, shapes, target.device, target.dtype, target.quant).items():
        runs["chunk", n if context == CONTEXT else "long"] = run
    ms = median_ms(runs, window_s)
    _release(target)
    layer_ms = layer_and_call_ms({n: ms["target", n] for n in STAGE_SIZES})[0]
    block = ms["target", depth]  # a stage as deep over the block: each size's more over `depth` layers
    over = {n: block if n == target.tokens else ms["chunk", n] for n in sizes}
    probe = min(PROBE_TOKENS, chunk)
    token_ms = max(over[probe] - block, 0.0) / (depth * (probe - target.tokens)) if probe > target.tokens else 0.0
    attend_ms = max(ms["chunk", "long"] - over[chunk], 0.0) / (depth * chunk * (LONG_CONTEXT - CONTEXT))
    return {"alone_layer_ms": layer_ms, "alone_layer_token_ms": token_ms, "alone_attend_ms": attend_ms,
            "alone_prefill_ms": [[n, layer_ms + (over[n] - block) / depth] for n in sizes]}


def time_intake(drafter: Timed, chunk: int, step_ms: float, window_s: float = WINDOW_S) -> list:
    """[tokens, ms] for the drafter taking in a prompt chunk of each of prefill_sizes after CONTEXT cached tokens, timed
    by itself: a step (`step_ms`) and each layer's more over the chunk than over one token, through one stage of
    STAGE_SIZES[-1] layers (chunk_runs). A line through a step and PROBE_TOKENS misses a quantized drafter's kernels,
    which change at a size (INT8_KERNEL_MAX_ROWS): the embedded pair's int8 drafter, one layer over 40 tokens, 8.4 ms
    where the line through 1 and 128 tokens said 5.8."""
    sizes = prefill_sizes(drafter, chunk)  # a step's one token (drafter.tokens), then the chunks'
    runs = {n: run for (n, _), run in chunk_runs(drafter.model, [(n, CONTEXT) for n in sizes], drafter.device,
                                                  drafter.dtype, drafter.quant).items()}
    ms = median_ms(runs, window_s)
    _release(drafter)
    layers = drafter.model.config.num_hidden_layers
    return [[n, step_ms + layers * max(ms[n] - ms[1], 0.0) / STAGE_SIZES[-1]] for n in sizes]


def add_runs(runs: dict, name, model: Timed, rows: int = 1) -> float:
    """Add `model`'s stage calls (and head) to `runs` under (name, n) and (name, "head"); returns the head's scale."""
    for n, run in stage_runs(model.model, model.tokens, model.device, model.dtype, model.quant, rows=rows).items():
        runs[name, n] = run
    if not model.head:
        return 1.0
    runs[name, "head"], scale = head_run(model.model, model.tokens, model.device, model.dtype, model.quant, rows=rows)
    return scale


def model_ms(ms: dict, name, model: Timed, scale: float) -> float:
    """One call of the whole model (every layer, and the head) from its parts' medians under `name`."""
    layer, call = layer_and_call_ms({n: ms[name, n] for n in STAGE_SIZES})
    return call + model.model.config.num_hidden_layers * layer + (ms[name, "head"] * scale if model.head else 0.0)


def draft_step_ms(steps: dict, window_s: float = WINDOW_S) -> tuple[dict, dict]:
    """({key: ms of one drafter step}, {key: why it could not run}) for `steps` {key: (Timed, rows)}: a step of
    every layer, the norm and the head over one token for `rows` requests (or over the Timed's tokens without the
    head: a prompt chunk's intake), each key its own modules (a format
    and a batch size, say), all timed in turn in one window after warm-up steps. A key whose trial step raises
    (a format this device cannot run) is left out, its reason kept."""
    runs, scale, failed = {}, {}, {}
    for key, (model, rows) in steps.items():
        mine = {}
        try:
            scale[key] = add_runs(mine, key, model, rows)
            for run in mine.values():
                run()
        except Exception as e:  # noqa: BLE001 - a format this device cannot run is a finding, not a failed launch
            failed[key] = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
            continue
        runs.update(mine)
    ms = median_ms(runs, window_s) if runs else {}
    _release(*(model for model, _ in steps.values()))
    return {key: model_ms(ms, key, model, scale[key]) for key, (model, _) in steps.items() if key not in failed}, failed


def _release(*models) -> None:
    if any(str(m.device).startswith("cuda") for m in models if m is not None):
        torch.cuda.empty_cache()  # the placeholder weights go back before the real ones load


def even_cuts(num_layers: int, ranks: int) -> list[int]:
    """model.split=null: the first layer of ranks 1..N-1 when the layers are shared out evenly; a layer
    left over goes to a middle rank first (rank 0 also drafts, the last rank also runs the head)."""
    sizes = [num_layers // ranks] * ranks
    for r in [*range(1, ranks - 1), ranks - 1, 0][:num_layers % ranks]:
        sizes[r] += 1
    return [sum(sizes[:r]) for r in range(1, ranks)]
