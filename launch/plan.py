"""The launch's one decision, made once per rank and then only read: the model folders as resolved, the
layer cuts, the KV slots (requests served at once), the devices, every rank's budget and timing, this rank's
layers, how rank 0 speculates.

    models = open_models(cfg, rank)          # folders resolved (a Hub id's config, tokenizer and index
                                             # fetched), config.json parsed once per model
    models = with_draft_format(cfg, models)  # rank 0: draft.quant=auto timed (model_parallel.draft_format)
    costs, source = rank_costs(cfg, models, rank, ranks)   # what this rank may hold (+ rank_speed: how fast)
    ... launch.handshake gathers every rank's costs around the ring ...
    plan = settle(cfg, models, rank, every_costs, source, given, asked)   # the KV slots, then the cuts that
                                             # hold them, checked against every budget

The parsed config is never written after parsing: what the launch works out is in the Plan, and every later
step (launch.build, launch.ranks) takes the Plan. A script that builds every stage in one process plans every
rank here, timing each in turn (`plan_here`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from launch.config import ConfigError, TandemConfig, split_cuts
from model_parallel.draft_format import DraftFormat
from model_parallel.lines import human
from model_parallel.loader import DTYPES, ModelLoadError, ModelSource
from model_parallel.split import CONTEXT, RankCosts
from netbridge.link_probe import LinkProbe
from speculative.session import SpecSettings

AUTO_SLOTS = 8  # serve.max_concurrent=null: as many KV slots as every budget holds, at most this many
MEMORY_FIXES = ("would help: model.quant=nf4 or int8, a smaller model.max_len (less KV cache), the drafter elsewhere "
                "(draft.device, or draft.kind=ngram), or another machine")


@dataclass(frozen=True)
class Models:
    """This rank's models: each folder as resolved, its config.json parsed once (loader.ModelSource)."""
    target: ModelSource
    drafter: ModelSource | None  # rank 0 drafting with a model (draft.kind=model or hybrid, spec.k > 0), else None
    name: str  # the model id API clients send: serve.model_name, else the Hub id or the folder's name as given
    lines: tuple[str, ...]  # which folders were used, for the start-up lines
    draft_format: DraftFormat | None = None  # the drafter's weight format (draft.quant; auto: with_draft_format)

    @property
    def draft_quant(self):
        """The drafter's quant settings (model_parallel.quant; None: as stored, or no drafter)."""
        return None if self.draft_format is None else self.draft_format.settings


@dataclass(frozen=True)
class Plan:
    settings: TandemConfig  # as parsed: read, never written
    rank: int
    ranks: int
    models: Models
    cuts: list[int]  # the first layer of ranks 1..N-1: rank r runs [bounds[r], bounds[r+1]) of [0, *cuts, L]
    costs: list[RankCosts]  # every rank's, as the handshake gathered them
    budget_source: str  # where this rank's budget came from (model.max_memory, or the free memory)
    device: str  # this rank's target slice
    draft_device: str  # rank 0's drafter (draft.device; auto = `device`)
    spec: SpecSettings  # how rank 0 speculates
    slots: int = 1  # KV slots on every stage and in the drafter: requests served at once, the same on every rank
    links: tuple[LinkProbe, ...] = ()  # every ring link as measured at the handshake: i = rank i -> rank i+1 (none: plan_here)

    @property
    def num_layers(self) -> int:
        return self.models.target.num_layers

    def layers(self, rank: int | None = None) -> range:
        """The target layers rank `rank` (default: this one) runs."""
        bounds = [0, *self.cuts, self.num_layers]
        rank = self.rank if rank is None else rank
        return range(bounds[rank], bounds[rank + 1])


def drafts_with_model(cfg: TandemConfig) -> bool:
    return cfg.draft.kind in ("model", "hybrid") and cfg.spec.k > 0


def spec_settings(cfg: TandemConfig) -> SpecSettings:
    s = cfg.spec
    return SpecSettings(s.k, s.adaptive, s.overlap, s.k_from_costs, cfg.model.prefill_chunk, s.in_flight)


# --- the models: folders, config.json once ------------------------------------------------------

def open_models(cfg: TandemConfig, rank: int) -> Models:
    """model.target (and, on rank 0, draft.model) as local folders, each config.json parsed once: for a Hub id
    its config, tokenizer and index are fetched now, its weights only when the stage is built, and only the
    stage's (model_parallel.hub)."""
    from model_parallel.hub import resolve
    drafting = rank == 0 and drafts_with_model(cfg)
    here(cfg.model.target, "model.target", rank)
    if drafting:
        here(cfg.draft.model, "draft.model", rank)
    given = cfg.model.target
    target, line = resolve(given, "model.target", cfg.model.hub_cache, rank)
    lines = [line]
    drafter = None
    if drafting:  # the drafter is rank 0's alone
        folder, line = resolve(cfg.draft.model, "draft.model", cfg.model.hub_cache, rank)
        lines.append(line)
        drafter = ModelSource.open(folder, cfg.draft.dtype)
    name = cfg.serve.model_name or (given if target != given else Path(given.rstrip("/")).name)  # a Hub id, not its cache folder
    draft_format = settle_draft_format(cfg, drafter) if drafter is not None and cfg.draft.quant != "auto" else None
    return Models(ModelSource.open(target, cfg.model.dtype), drafter, name, tuple(lines), draft_format)


def here(model: str, setting: str, rank: int) -> None:
    """A local model folder this rank's role needs must be on this host: one line naming the role and the fix
    (on several hosts, the fix may also be this host's node rank: each host fetches what its rank runs)."""
    from model_parallel.hub import is_hub_id
    from model_parallel.loader import fetch_hint
    folder = Path(model)
    if is_hub_id(model) or (folder / "config.json").is_file():
        return
    role = "rank 0 runs the drafter" if setting == "draft.model" else f"rank {rank} runs layers of the target"
    hosts = os.environ.get("LOCAL_WORLD_SIZE", "1") != os.environ.get("WORLD_SIZE", "1")
    other = (f"; or, if this host should run another rank, start it with that node rank (--rdzv_conf node_rank=R"
             f"{', now ' + os.environ['TANDEM_NODE_RANK'] if 'TANDEM_NODE_RANK' in os.environ else ''})") if hosts else ""
    raise ModelLoadError(f"{role} ({setting}) and its model folder {folder} has no config.json on this host "
                         f"({'missing folder' if not folder.exists() else 'not a HF model folder'}); {fetch_hint(folder)}{other}")


# --- devices and weight formats ---------------------------------------------------------------------

def this_device() -> str:
    """This rank's device: its GPU (LOCAL_RANK's, of those visible) when it has one."""
    import torch
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    return "cpu"


def draft_device(cfg: TandemConfig) -> str:
    """draft.device; auto = where this rank's target slice runs (its GPU when it has one)."""
    return this_device() if cfg.draft.device == "auto" else cfg.draft.device


# An int8 drafter's LM head is int8 too: the embedded 0.5B's head (untied) is 136M of its 630M weights, and an int8
# head over one row took 38 ms against 58 in bf16 on one thread here (AVX512-BF16, 2026-12-04, one quick run under
# load); over 8 rows it took longer (110 vs 83), which draft.quant=auto weighs when serving several requests at
# once. The target's head follows model.quant_lm_head (exactness: docs/exactness.md).
DRAFT_INT8_HEAD = True


def quantizer(cfg: TandemConfig, which: str, name: str | None = None):
    """Quant settings for the target's stages (which="model": model.quant) or the drafter ("draft": `name`, a
    format draft.quant=auto settled, else draft.quant); None = as stored. NF4 takes model.quant_compute_dtype /
    quant_double / quant_lm_head for both; an int8 drafter quantizes its head (DRAFT_INT8_HEAD)."""
    name = name or (cfg.model.quant if which == "model" else cfg.draft.quant)
    if name == "none":
        return None
    from model_parallel.quant import Int8Settings, NF4Settings
    m = cfg.model
    if name == "int8":
        return Int8Settings(lm_head=m.quant_lm_head if which == "model" else DRAFT_INT8_HEAD)
    if name != "nf4":
        raise ValueError(f"{which}.quant={name!r} is not a weight format (auto is settled at start-up: Models.draft_format)")
    return NF4Settings(compute_dtype=DTYPES[m.quant_compute_dtype], double_quant=m.quant_double, lm_head=m.quant_lm_head)


def with_draft_format(cfg: TandemConfig, models: Models) -> Models:
    """`models` with the drafter's format settled: draft.quant=auto is timed here (seconds on a real drafter), when the
    ranks meet (launch.handshake), after rank 0 has checked what can be checked from the files."""
    if models.drafter is None or models.draft_format is not None:
        return models
    return replace(models, draft_format=settle_draft_format(cfg, models.drafter))


def settle_draft_format(cfg: TandemConfig, drafter: ModelSource) -> DraftFormat:
    """draft.quant as given, or (auto) the format whose draft step is fastest here among those that keep
    acceptance, timed on rank 0 now (model_parallel.draft_format: the rule and the figures behind it). With
    several requests served at once, a step of that many rows is timed too."""
    if cfg.draft.quant != "auto":
        return DraftFormat(cfg.draft.quant, quantizer(cfg, "draft"), f"draft.quant={cfg.draft.quant}")
    from model_parallel.draft_format import FORMATS, MAX_ROWS, choose
    from model_parallel.memory import model_bytes
    stored = model_bytes(drafter, None, 1)
    weights = sum(stored.layers) + stored.head
    rows = min(asked_slots(cfg) or AUTO_SLOTS, MAX_ROWS)
    settings = {name: quantizer(cfg, "draft", name) for name in FORMATS}
    name, why, step_ms = choose(drafter, draft_device(cfg), DTYPES[cfg.draft.dtype], settings,
                                (1, rows) if rows > 1 else (1,), weights)
    return DraftFormat(name, settings[name], why, step_ms)


def _same_memory(one: str, other: str) -> bool:
    import torch
    a, b = torch.device(one), torch.device(other)
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


# --- what each rank may hold, how fast it is -----------------------------------------------------

def rank_costs(cfg: TandemConfig, models: Models, rank: int, ranks: int) -> tuple[RankCosts, str]:
    """(RankCosts, where the budget came from) for this rank, from shapes alone, before any weight is read:
    its model.max_memory budget, the bytes it holds besides its layers, one layer's bytes (not yet timed)."""
    from model_parallel.memory import model_bytes, rank_budget
    device = this_device()
    try:
        budget, source = rank_budget(cfg.model.max_memory, rank, ranks, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    target = model_bytes(models.target, quantizer(cfg, "model"), cfg.model.max_len)
    fixed = target.stage(0, 0, embed=rank == 0, head=rank == ranks - 1)
    slot = target.slot(0, 0)
    if models.drafter is not None and _same_memory(draft_device(cfg), device):
        drafter = model_bytes(models.drafter, models.draft_quant, cfg.draft.max_len)
        fixed += drafter.stage(0, len(drafter.layers), embed=True, head=True)
        slot += drafter.slot(0, len(drafter.layers))  # every request drafts in its own slot of the drafter's cache
    return RankCosts(budget, fixed, target.layer(), slot_fixed_bytes=slot, slot_layer_bytes=target.cache_per_layer,
                     core_share=core_share(device), host_rank=int(os.environ.get("LOCAL_RANK", 0))), source


def core_share(device: str) -> float:
    """The share of this host's cores a rank computing on `device` takes: its threads over the cores it may run on
    (torchrun gives each of several ranks one thread); 0 on a GPU (its work is not the host's cores')."""
    if device.startswith("cuda"):
        return 0.0
    import torch
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(torch.get_num_threads(), cores) / cores


def use_graph(d, device: str) -> bool:
    """draft.graph: auto = capture on CUDA; on = insist (and say why it cannot be)."""
    import torch
    on_cuda = device.startswith("cuda")
    if d.graph == "on" and not (on_cuda and torch.cuda.is_available()):
        raise ConfigError(f"draft.graph=on needs a CUDA draft.device (got {device!r}"
                          f"{'' if torch.cuda.is_available() else ', no CUDA here'}); use draft.graph=auto")
    return d.graph == "on" or (d.graph == "auto" and on_cuda)


def rank_speed(cfg: TandemConfig, models: Models, rank: int, ranks: int):
    """This rank's model_parallel.split.Speed (one layer over a block of K+1, the rest of its work per round, the
    per-token, attention and drafter parts), timed here (model_parallel.split.time_rank)."""
    from model_parallel.split import Timed, time_rank
    target = Timed(models.target, cfg.spec.k + 1, this_device(), DTYPES[cfg.model.dtype], quantizer(cfg, "model"),
                   head=rank == ranks - 1)
    drafter = None
    if models.drafter is not None:
        drafter = Timed(models.drafter, 1, draft_device(cfg), DTYPES[cfg.draft.dtype], models.draft_quant,
                        head=True, calls=draft_steps(cfg))
    speed = time_rank(target, drafter)
    if drafter is not None and use_graph(cfg.draft, drafter.device):  # a captured step attends over the whole cache
        # (static shapes): no dearer after a long prompt
        speed = replace(speed, draft_context_ms=0.0, draft_context_row_ms=0.0)
    return speed


def rank_alone_ms(cfg: TandemConfig, models: Models, rank: int, ranks: int) -> dict:
    """RankCosts' figures timed again while the other ranks idle: one of this rank's target layers over a block of
    K+1 and over prefill chunks (model_parallel.split.time_alone) and, on rank 0, one drafter step
    (split.draft_step_ms): beside the same timed with every rank at once, what the ranks sharing a host cost each
    other: at 0 ms one stream's round is mostly rank 0 drafting while the others idle: on a 2-core host the tiny
    drafter's step read 1.69-2.05 ms timed at once, 1.47-1.71 alone (10th-90th percentiles of 66 launches' start-up
    lines), its real steps 1.6-1.7."""
    from model_parallel.split import Timed, draft_step_ms, time_alone, time_intake
    alone = time_alone(Timed(models.target, cfg.spec.k + 1, this_device(), DTYPES[cfg.model.dtype],
                             quantizer(cfg, "model")), cfg.model.prefill_chunk)
    if models.drafter is not None:
        drafter = Timed(models.drafter, 1, draft_device(cfg), DTYPES[cfg.draft.dtype], models.draft_quant, head=True)
        steps, _ = draft_step_ms({"alone": (drafter, 1)})
        alone["alone_draft_step_ms"] = steps.get("alone", 0.0)
        alone["alone_draft_prefill_ms"] = time_intake(drafter, cfg.model.prefill_chunk, alone["alone_draft_step_ms"])
    return alone


def timed(costs: RankCosts, speed) -> RankCosts:
    """`costs` with rank_speed's figures (a model_parallel.split.Speed: its fields are RankCosts')."""
    return replace(costs, **asdict(speed))


def draft_steps(cfg: TandemConfig) -> int:
    """The drafter's forwards in a round of K drafts: K, and one more. With spec.overlap the one more is
    its guess of the target's token; without, taking in the last draft of a fully accepted round (the
    round before a round of K, when spec.adaptive grows K). Each forward is timed as a step of one token."""
    return cfg.spec.k + 1 if drafts_with_model(cfg) else 0


# --- the cuts ----------------------------------------------------------------------------------

def given_cuts(cfg: TandemConfig, num_layers: int, ranks: int) -> list[int] | None:
    """model.split's cuts for `ranks` ranks, checked against the target's layers (None: auto, settled from
    every rank's costs). Each rank names its own config's mistake, before it waits for the others."""
    from model_parallel.split import even_cuts
    split, typed, name = split_cuts(cfg.model.split), cfg.model.split, Path(cfg.model.target).name
    if num_layers < ranks:
        raise ConfigError(f"{name} has {num_layers} layers, too few for {ranks} ranks (each needs at least one); "
                          "start fewer ranks")
    if split == "auto":
        return None
    if split is None:
        return even_cuts(num_layers, ranks)
    example = split_text(even_cuts(num_layers, ranks))
    if len(split) != ranks - 1:
        raise ConfigError(f"model.split={typed!r} does not fit {ranks} ranks: give {ranks - 1} increasing layer numbers "
                          f"(the first layer of ranks 1..{ranks - 1}), e.g. model.split={example}, or auto")
    if not all(type(c) is int and 1 <= c <= num_layers - 1 for c in split):
        raise ConfigError(f"model.split={typed} is out of range: {name} has {num_layers} layers, so each cut must be "
                          f"within 1..{num_layers - 1} (each rank needs at least one layer), e.g. model.split={example}")
    if not all(a < b for a, b in zip(split, split[1:])):
        raise ConfigError(f"model.split={typed} is not increasing within 1..{num_layers - 1}: {name} has {num_layers} "
                          f"layers and each rank needs at least one, e.g. model.split={example}")
    return split


def split_text(cuts: list[int]) -> str:
    """Cuts as model.split is written on a command line: one cut as its number (14), several as a list ([10,19])."""
    return str(cuts[0]) if len(cuts) == 1 else "[" + ",".join(map(str, cuts)) + "]"


def settle_cuts(num_layers: int, costs: list[RankCosts], given: list[int] | None) -> list[int]:
    """The cuts every rank runs, from every rank's costs (the same on every rank, so each settles the same):
    `given` after checking it fits every budget; None (auto): the fastest that fits (split.place_layers). A
    split that does not fit is one ConfigError line naming model.max_memory, the bytes and what would help."""
    from model_parallel.split import NoFit, fitting_splits, over_budget, place_layers
    try:
        fastest = place_layers(num_layers, costs)
    except NoFit as e:
        if given is None:
            raise ConfigError(f"{e}; {MEMORY_FIXES}") from None
        fastest = None
    cuts = fastest if given is None else given
    over = over_budget(num_layers, costs, cuts)
    if over:
        rank, need, budget = over[0]
        fits = fitting_splits(num_layers, costs)
        where = (f"splits that fit: {fits.start}-{fits.stop - 1} (model.split=auto picks among them)" if fits
                 else "model.split=auto finds one that fits" if fastest else "no split fits")
        raise ConfigError(f"model.split={split_text(cuts)} gives rank {rank} {human(need)}, over its model.max_memory of "
                          f"{human(budget)}; {where}; {MEMORY_FIXES}")
    return list(cuts)


# --- the KV slots: requests served at once --------------------------------------------------------

def asked_slots(cfg: TandemConfig) -> int:
    """The KV slots this rank's config asks for: 1 for a one-shot run; serving, serve.max_concurrent, or 0:
    as many as every rank's budget holds (at most AUTO_SLOTS)."""
    if cfg.serve.port is None:
        return 1
    return cfg.serve.max_concurrent or 0


def settle_slots(cfg: TandemConfig, num_layers: int, costs: list[RankCosts], given: list[int] | None,
                 asked: list[int]) -> int:
    """The KV slots every rank holds, from every rank's costs and ask (the same on every rank, so each settles
    the same): the fewest any rank asked for; none asked (0 on every rank), the most every budget holds, at most
    AUTO_SLOTS. Asked slots that do not fit are one ConfigError line naming what fits; when not even one fits,
    settle_cuts says why at one slot."""
    from model_parallel.split import most_slots
    exact = [a for a in asked if a > 0]
    want = min(exact) if exact else AUTO_SLOTS
    fit = most_slots(num_layers, costs, want, given)
    if fit == want or not exact or fit == 0:
        return max(fit, 1)
    one = sum(c.slot_fixed_bytes for c in costs) + num_layers * max(c.slot_layer_bytes for c in costs)
    drafter = f" and the drafter's at draft.max_len={cfg.draft.max_len}" if drafts_with_model(cfg) else ""
    split = f"model.split={split_text(given)}" if given else "any split"
    raise ConfigError(f"serve.max_concurrent={want}: {want} KV slots do not fit model.max_memory with {split} (a slot is "
                      f"{human(one)} across the ranks: every layer's keys and values at model.max_len={cfg.model.max_len}"
                      f"{drafter}); {fit} fit: give serve.max_concurrent={fit} (or null: as many as fit, at most {AUTO_SLOTS}), or a smaller "
                      f"model.max_len, model.quant=nf4, the drafter elsewhere (draft.device, or draft.kind=ngram), "
                      f"or another machine")


def settle(cfg: TandemConfig, models: Models, rank: int, costs: list[RankCosts], source: str,
           given: list[int] | None, asked: list[int], links: tuple[LinkProbe, ...] = ()) -> Plan:
    """The Plan, once every rank's costs (at one KV slot) and asked slots are known (and the cuts given on any
    rank, if any): the slots first, then the cuts that hold them; workload.streams: of those, the cuts that end
    that workload soonest by the cost model."""
    from launch.prediction import timed_everywhere, workload_cuts
    num_layers = models.target.num_layers
    slots = settle_slots(cfg, num_layers, costs, given, asked)
    costs = [c.at(slots) for c in costs]
    cuts = settle_cuts(num_layers, costs, given)
    plan = Plan(cfg, rank, len(costs), models, cuts, costs, source, this_device(), draft_device(cfg),
                spec_settings(cfg), slots, tuple(links))
    if given is None and cfg.workload.streams is not None and timed_everywhere(plan):
        plan = replace(plan, cuts=workload_cuts(plan))
    return plan


def plan_here(cfg: TandemConfig, rank: int, ranks: int = 2) -> Plan:
    """Rank `rank`'s Plan for a script that builds every stage in one process: every rank's costs measured
    here (timed here, rank after rank, for model.split=auto), no handshake."""
    every = [with_draft_format(cfg, open_models(cfg, r)) for r in range(ranks)]
    given = given_cuts(cfg, every[rank].target.num_layers, ranks)
    measured = [rank_costs(cfg, models, r, ranks) for r, models in enumerate(every)]
    costs = [timed(c, rank_speed(cfg, every[r], r, ranks)) if given is None else c for r, (c, _) in enumerate(measured)]
    return settle(cfg, every[rank], rank, costs, measured[rank][1], given, [asked_slots(cfg)] * ranks)


def describe(plan: Plan) -> str:
    """This rank's start-up line: its layers, its bytes against its budget, its estimated ms per round."""
    cfg, rank, mine = plan.settings, plan.rank, plan.costs[plan.rank]
    layers, n = plan.layers(), len(plan.layers())
    extras = (["embeddings"] + (["the drafter"] if drafts_with_model(cfg) else []) if rank == 0 else []) + \
        (["norm + head"] if rank == plan.ranks - 1 else [])
    held = f" + {' + '.join(extras)}" if extras else ""
    asked = os.environ.get("TANDEM_NODE_RANK")  # set by Tandem's rendezvous backends when a node rank was given
    node = f" (this host: --rdzv_conf node_rank={asked}, as asked)" if asked is not None else ""
    line = (f"rank {rank}{node}: layers {layers.start}-{layers.stop - 1} ({n} of {plan.num_layers}){held}; "
            f"{human(mine.bytes_for(n))} of {human(mine.budget)} ({plan.budget_source}); ")
    if mine.layer_ms <= 0:
        line += "ms per round not timed (model.split was given)"
    else:
        drafting = f", the drafter's {draft_steps(cfg)} steps" if rank == 0 and drafts_with_model(cfg) else ""
        if drafting and mine.draft_row_ms > 0:
            drafting += f" ({mine.draft_row_ms:.2f} ms more a step per stream batched beside)"
        alone = (f" with every rank at once; {mine.alone_layer_ms:.1f} ms a layer alone"
                 if mine.alone_layer_ms > 0 else "")
        if mine.alone_prefill_ms:  # the chunk sizes timed alone: what a prompt's prefill costs (TTFT)
            tokens, chunk_ms = mine.alone_prefill_ms[-1]
            alone += f" ({chunk_ms:.1f} over a {tokens}-token prompt chunk)"
        if mine.alone_draft_step_ms > 0:
            alone += f", a drafter step {mine.alone_draft_step_ms:.2f} ms alone, {mine.draft_step_ms:.2f} at once"
        if mine.alone_draft_prefill_ms:  # the drafter taking a prompt in (TTFT at K > 0)
            tokens, intake_ms = mine.alone_draft_prefill_ms[-1]
            alone += f", taking in a {tokens}-token prompt chunk {intake_ms:.0f} ms"
        context = (f", {1000 * (cfg.spec.k + 1) * mine.context_ms:.2f} ms a layer more per 1k tokens cached beyond "
                   f"{CONTEXT}" if mine.context_ms > 0 else "")
        rows = (f", {n * mine.layer_row_ms + mine.head_row_ms:.2f} ms more per stream batched beside"
                if mine.layer_row_ms > 0 or mine.head_row_ms > 0 else "")
        cores = f"; its work takes {mine.core_share:.0%} of this host's cores" if mine.core_share > 0 else ""
        line += (f"estimated {mine.ms_for(n):.0f} ms per round ({n} x {mine.layer_ms:.1f} ms per layer over blocks of "
                 f"{cfg.spec.k + 1}{context}{rows}, {mine.fixed_ms:.0f} ms besides{drafting}; timed here{alone}{cores})")
    if rank == 0 and drafts_with_model(cfg):
        line += "; " + drafter_place(cfg.draft.device, plan.draft_device, plan.device,
                                     int(os.environ.get("LOCAL_WORLD_SIZE", plan.ranks)))
    if plan.models.draft_format is not None:
        line += f"; the drafter's weights: {plan.models.draft_format.why}"
    if plan.links:
        line += f"; its link to rank {(rank + 1) % plan.ranks}: {plan.links[rank].text()}"
    return line + slots_text(plan) if cfg.serve.port is not None or plan.slots > 1 else line


def drafter_place(asked: str, device: str, target: str, local_ranks: int) -> str:
    """Where rank 0's drafter runs and why, for its start-up line: beside rank 0's layers (counted in its budget),
    on a GPU of its own, or on a GPU another rank of this host holds layers on (not counted in that rank's budget,
    which was read before the drafter loaded: memory first, so the line says to leave room)."""
    given = f"draft.device={asked}"
    if _same_memory(device, target):
        return f"the drafter beside rank 0's layers on {device} ({given}), counted in its budget"
    index = int(device.split(":")[1]) if device.startswith("cuda:") else None
    if index is not None and index < local_ranks:
        return (f"the drafter on {device} ({given}), where rank {index} of this host holds its layers: its memory is not "
                f"in that rank's budget; leave room (model.max_memory for that rank)")
    return f"the drafter on {device}, memory of its own ({given}): rank 0's budget holds its layers only"


def ring_text(links: tuple[LinkProbe, ...], hosts: int = 2) -> str:
    """Rank 0's line on the ring's links: how many cross between hosts (each round crosses every link once) and
    their round trips, and how many stay on one host. `hosts` 1 (one torchrun): every link is on this host, even
    those transport.kind carries (one host emulating several)."""
    far = [link for link in links if link.kind != "local"]
    near = [link for link in links if link.kind == "local"]

    def rtts(group):
        return "/".join(f"{link.rtt_ms:.1f}" for link in group)
    if hosts < 2 and far:
        return f"ring of {len(links)} links, all on this host ({far[0].kind}, RTT {rtts(far)} ms)"
    parts = [f"{len(far)} between hosts ({far[0].kind}, RTT {rtts(far)} ms)"] if far else []
    parts += [f"{len(near)} on one host (direct, RTT {rtts(near)} ms)"] if near else []
    return f"ring of {len(links)} links: {', '.join(parts)}; a round crosses between hosts {len(far)} times"


def slots_text(plan: Plan) -> str:
    """The start-up line's KV slots: how many requests are served at once, why that many, what one costs here."""
    cfg, mine, n = plan.settings, plan.costs[plan.rank], len(plan.layers())
    asked = asked_slots(cfg)
    why = (f"serve.max_concurrent={asked}" if asked else f"serve.max_concurrent=null: as many as every rank's budget "
           f"holds, at most {AUTO_SLOTS}")
    drafter = plan.rank == 0 and drafts_with_model(cfg) and _same_memory(plan.draft_device, plan.device)
    tokens = f"{cfg.model.max_len} tokens" + (f" (the drafter's: {cfg.draft.max_len})" if drafter else "")
    return (f"; serving up to {plan.slots} request{'s' if plan.slots > 1 else ''} at once ({why}): {plan.slots} KV "
            f"slot{'s' if plan.slots > 1 else ''} of {tokens}, {human(mine.slot_bytes(n))} each on rank {plan.rank}")
