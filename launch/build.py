"""Config -> the pieces a rank runs: its stage, (rank 0) the drafter, tokenizer and prompt ids.

Every stage is built here: the target's slices (one per rank) and the drafter's whole small model go through
`_load_stage`, with one rule for devices, dtypes and caches; the capacity rule is `check_capacity`."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from launch.config import ConfigError, TandemConfig
from model_parallel.loader import ModelLoadError, load_config, load_stage


def split_point(cfg: TandemConfig) -> tuple[int, int]:
    """(split, num_layers): rank 0 runs layers [0, split), rank 1 [split, num_layers)."""
    num_layers = load_config(cfg.model.target).num_hidden_layers
    split = num_layers // 2 if cfg.model.split is None else cfg.model.split
    if not isinstance(split, int):  # "auto" is resolved (resolve_split) before anyone asks
        raise ConfigError(f"model.split={split!r}: give a layer number (rank 1's first layer) or auto")
    if not 1 <= split <= num_layers - 1:
        raise ConfigError(f"model.split={split} is out of range: {Path(cfg.model.target).name} has {num_layers} layers, "
                          f"so the split must be 1..{num_layers - 1} (each rank needs at least one layer)")
    return split, num_layers


def layer_cuts(cfg: TandemConfig, ranks: int = 2) -> tuple[list[int], int]:
    """(cuts, num_layers): the first layer of ranks 1..N-1, so rank r runs layers [bounds[r], bounds[r+1])
    of bounds = [0, *cuts, num_layers]. model.split: an int (two ranks), a list of N-1 increasing layer
    numbers, or None (even)."""
    split = cfg.model.split
    if ranks == 2 and not isinstance(split, list):
        split, num_layers = split_point(cfg)
        return [split], num_layers
    num_layers = layers_for(cfg, ranks)
    name = Path(cfg.model.target).name
    if split is None:
        from model_parallel.split import even_cuts
        return even_cuts(num_layers, ranks), num_layers
    if not isinstance(split, list) or len(split) != ranks - 1:
        raise ConfigError(f"model.split={split!r} does not fit {ranks} ranks: give {ranks - 1} increasing layer numbers "
                          f"(the first layer of ranks 1..{ranks - 1}), e.g. model.split={_example(num_layers, ranks)}, or auto")
    increasing = all(isinstance(c, int) for c in split) and all(a < b for a, b in zip([0, *split], [*split, num_layers]))
    if not increasing:
        raise ConfigError(f"model.split={split} is not increasing within 1..{num_layers - 1}: {name} has {num_layers} "
                          f"layers and each rank needs at least one, e.g. model.split={_example(num_layers, ranks)}")
    return list(split), num_layers


def layers_for(cfg: TandemConfig, ranks: int) -> int:
    """The target's number of layers, which must give each of `ranks` ranks at least one."""
    num_layers = load_config(cfg.model.target).num_hidden_layers
    if num_layers < ranks:
        raise ConfigError(f"{Path(cfg.model.target).name} has {num_layers} layers, too few for {ranks} ranks (each "
                          "needs at least one); start fewer ranks")
    return num_layers


def _example(num_layers: int, ranks: int) -> str:
    from model_parallel.split import even_cuts
    return "[" + ",".join(map(str, even_cuts(num_layers, ranks))) + "]"


def resolve_models(cfg: TandemConfig, rank: int) -> list[str]:
    """model.target (and, on rank 0, draft.model) as local folders, before the split is settled: for a Hub
    id its config, tokenizer and index are fetched now, its weights only when the stage is built, and only
    the stage's (model_parallel.hub). Returns the lines that say which was used."""
    from model_parallel.hub import resolve
    here(cfg.model.target, "model.target", rank)
    if rank == 0 and _drafting(cfg):
        here(cfg.draft.model, "draft.model", rank)
    given = cfg.model.target
    cfg.model.target, line = resolve(given, "model.target", cfg.model.hub_cache, rank)
    if cfg.model.target != given and cfg.serve.model_name is None:
        cfg.serve.model_name = given  # clients name the model by its id, not by a cache folder
    lines = [line]
    if rank == 0 and cfg.draft.kind == "model" and cfg.spec.k > 0:  # the drafter is rank 0's alone
        cfg.draft.model, line = resolve(cfg.draft.model, "draft.model", cfg.model.hub_cache, rank)
        lines.append(line)
    return lines


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


def resolve_split(cfg: TandemConfig, ranks: int = 2) -> str | None:
    """model.split=auto for a script that builds every stage in one process: every rank's costs measured
    here, the split written into cfg; returns the start-up lines (None when the split was given).
    (The entry settles it in the handshake instead, each rank measuring itself: settle_split.)"""
    if cfg.model.split != "auto":
        return None
    measured = [rank_costs(cfg, rank, ranks) for rank in range(ranks)]
    costs = [c for c, _ in measured]
    settle_split(cfg, costs)
    return "\n".join(describe_rank(cfg, rank, costs, source, ranks) for rank, (_, source) in enumerate(measured))


# --- model.max_memory and model.split=auto: what each rank may hold, how fast it is ---------------

def rank_costs(cfg: TandemConfig, rank: int, world: int = 2, timed: bool | None = None):
    """(RankCosts, where the budget came from) for this rank, measured on its own device before any
    weight is read: its model.max_memory budget, the bytes it holds besides its layers, one layer's
    bytes and, when `timed` (default: model.split=auto), one layer's ms over a round's block and its
    other ms per round (the drafter's steps on rank 0, the head on the last rank)."""
    from model_parallel.memory import model_bytes, rank_budget
    from model_parallel.split import RankCosts
    device, first, last = device_for(cfg), rank == 0, rank == world - 1
    try:
        budget, source = rank_budget(cfg.model.max_memory, rank, world, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    target = model_bytes(cfg.model.target, cfg.model.dtype, quantizer(cfg, "model"), cfg.model.max_len)
    fixed = target.stage(0, 0, embed=first, head=last)
    if first and _drafting(cfg) and _same_memory(draft_device(cfg), device):
        d = cfg.draft
        drafter = model_bytes(d.model, d.dtype, quantizer(cfg, "draft"), d.max_len)
        fixed += drafter.stage(0, len(drafter.layers), embed=True, head=True)
    costs = RankCosts(budget, fixed, target.layer())
    if timed is None:
        timed = cfg.model.split == "auto"
    if timed:
        costs.layer_ms, costs.fixed_ms = rank_speed(cfg, rank, world)
    return costs, source


def rank_speed(cfg: TandemConfig, rank: int, world: int = 2) -> tuple[float, float]:
    """(one layer over a block of K+1, the rest of this rank's work per round), timed here."""
    from model_parallel.loader import DTYPES
    from model_parallel.split import Timed, time_rank
    device, first, last = device_for(cfg), rank == 0, rank == world - 1
    target = Timed(load_config(cfg.model.target), cfg.spec.k + 1, device, DTYPES[cfg.model.dtype],
                   quantizer(cfg, "model"), head=last)
    drafter = None
    if first and _drafting(cfg):
        d = cfg.draft
        drafter = Timed(load_config(d.model), 1, draft_device(cfg), DTYPES[d.dtype], quantizer(cfg, "draft"),
                        head=True, calls=draft_steps(cfg))
    return time_rank(target, drafter)


def _drafting(cfg: TandemConfig) -> bool:
    return cfg.draft.kind == "model" and cfg.spec.k > 0


def draft_steps(cfg: TandemConfig) -> int:
    """The drafter's forwards in a round of K drafts: K, and one more. With spec.overlap the one more is
    its guess of the target's token; without, taking in the last draft of a fully accepted round (the
    round before a round of K, when spec.adaptive grows K). Each forward is timed as a step of one token."""
    return cfg.spec.k + 1 if _drafting(cfg) else 0


def _same_memory(one: str, other: str) -> bool:
    import torch
    a, b = torch.device(one), torch.device(other)
    return a.type == b.type and (a.type == "cpu" or (a.index or 0) == (b.index or 0))


MEMORY_FIXES = ("would help: model.quant=nf4, a smaller model.max_len (less KV cache), the drafter elsewhere "
                "(draft.device, or draft.kind=ngram), or another machine")


def settle_split(cfg: TandemConfig, costs: list, given=None):
    """The split every rank runs, from every rank's costs (the same on every rank, so each settles the
    same): `given` (or model.split) if given, after checking it fits every budget; for auto, the fastest
    split that fits (model_parallel.split.place_layers over all the ranks). Written into cfg (an int for
    two ranks, the list of cuts for more); a split that does not fit is one ConfigError line naming
    model.max_memory, the bytes and what would help."""
    from model_parallel.memory import human
    from model_parallel.split import NoFit, fitting_splits, over_budget, place_layers
    ranks = len(costs)
    num_layers = layers_for(cfg, ranks)
    split = cfg.model.split if given is None else given
    if split == "auto":
        try:
            cuts = place_layers(num_layers, costs)
        except NoFit as e:
            raise ConfigError(f"{e}; {MEMORY_FIXES}") from None
        split = cuts[0] if ranks == 2 else cuts
    cfg.model.split = split
    cuts, _ = layer_cuts(cfg, ranks)
    over = over_budget(num_layers, costs, cuts)
    if over:
        rank, need, budget = over[0]
        fits = fitting_splits(num_layers, costs) if ranks == 2 else None
        where = (f"splits that fit: {fits.start}-{fits.stop - 1} (model.split=auto picks among them)" if fits
                 else "model.split=auto finds one if any fits" if ranks > 2 else "no split fits")
        shown = split if ranks == 2 else cuts
        raise ConfigError(f"model.split={shown} gives rank {rank} {human(need)}, over its model.max_memory of "
                          f"{human(budget)}; {where}; {MEMORY_FIXES}")
    return cfg.model.split


def describe_rank(cfg: TandemConfig, rank: int, costs: list, source: str, world: int = 2) -> str:
    """The start-up line of one rank: its layers, its bytes against its budget, its estimated ms per round."""
    from model_parallel.memory import human
    from model_parallel.split import layer_counts
    cuts, num_layers = layer_cuts(cfg, world)
    counts = layer_counts(num_layers, cuts)
    first = sum(counts[:rank])
    mine, n = costs[rank], counts[rank]
    extras = (["embeddings"] + (["the drafter"] if _drafting(cfg) else []) if rank == 0 else []) + \
        (["norm + head"] if rank == world - 1 else [])
    held = f" + {' + '.join(extras)}" if extras else ""
    asked = os.environ.get("TANDEM_NODE_RANK")  # set by Tandem's rendezvous backends when a node rank was given
    node = f" (this host: --rdzv_conf node_rank={asked}, as asked)" if asked is not None else ""
    line = (f"rank {rank}{node}: layers {first}-{first + n - 1} ({n} of {num_layers}){held}; "
            f"{human(mine.bytes_for(n))} of {human(mine.budget)} ({source}); ")
    if mine.layer_ms <= 0:
        return line + "ms per round not timed (model.split was given)"
    drafting = f", the drafter's {draft_steps(cfg)} steps" if rank == 0 and _drafting(cfg) else ""
    return line + (f"estimated {mine.ms_for(n):.0f} ms per round ({n} x {mine.layer_ms:.1f} ms per layer over blocks of "
                   f"{cfg.spec.k + 1}, {mine.fixed_ms:.0f} ms besides{drafting}; timed here)")


def quantizer(cfg: TandemConfig, which: str):
    """NF4 settings for the target's stages (which="model") or the drafter ("draft"); None = as stored.
    The drafter uses the target's model.quant_compute_dtype / quant_double / quant_lm_head."""
    kind = cfg.model.quant if which == "model" else cfg.draft.quant
    if kind == "none":
        return None
    from model_parallel.loader import DTYPES
    from model_parallel.quant import NF4Settings
    m = cfg.model
    return NF4Settings(compute_dtype=DTYPES[m.quant_compute_dtype], double_quant=m.quant_double, lm_head=m.quant_lm_head)


def build_stage(cfg: TandemConfig, rank: int, ranks: int = 2):
    """Rank 0: embeddings + layers [0, split); rank 1: layers [split, L), the final norm and the head.
    With more than two ranks the middle ones hold only their layers, and the last one the head.
    (The entry settles model.split=auto in the handshake first; a script building every stage from one
    config settles it here, once.)"""
    resolve_split(cfg, ranks)
    cuts, num_layers = layer_cuts(cfg, ranks)
    bounds = [0, *cuts, num_layers]
    first, last = bounds[rank], bounds[rank + 1]
    return _load_stage(cfg.model.target, first, last, embed=rank == 0, head=rank == ranks - 1, dtype=cfg.model.dtype,
                       device=device_for(cfg), quant=quantizer(cfg, "model"), max_len=cfg.model.max_len,
                       setting="model.max_len", progress=f"rank {rank} layers {first}-{last - 1}", rank=rank)


def build_draft_stage(cfg: TandemConfig):
    """The drafter's whole model (embeddings, every layer, head) as one stage on draft.device."""
    d = cfg.draft
    return _load_stage(d.model, 0, load_config(d.model).num_hidden_layers, embed=True, head=True, dtype=d.dtype,
                       device=draft_device(cfg), quant=quantizer(cfg, "draft"), max_len=d.max_len, setting="draft.max_len",
                       progress="rank 0 drafter", rank=0)


def _load_stage(folder, first, last, *, embed, head, dtype, device, quant, max_len, setting, progress, rank):
    from model_parallel.hub import fetch_stage
    fetched = fetch_stage(folder, first, last, embed, head, rank, progress=f"{progress}: fetching")  # Hub ids only
    if fetched is not None:
        print(f"[{progress}: {fetched.describe()}]", file=sys.stderr, flush=True)
    stage = load_stage(folder, first, last, embed=embed, head=head, dtype=dtype, device=device, progress=progress,
                       quant=quant)
    stage.allocate_cache(max_len, compute_dtype(stage), setting=setting)
    return stage


def device_for(cfg: TandemConfig) -> str:
    import os
    import torch
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    return "cpu"


def draft_device(cfg: TandemConfig) -> str:
    """draft.device; auto = where this rank's target slice runs (its GPU when it has one)."""
    return device_for(cfg) if cfg.draft.device == "auto" else cfg.draft.device


def compute_dtype(stage):
    import torch
    for p in stage.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def load_tokenizer(folder: str):
    """The tokenizer, or None for a folder without one (tiny test models driven by prompt_ids)."""
    from transformers import AutoTokenizer
    if not any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:  # transformers reads the files with json.load: garbage is a ValueError
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ModelLoadError(f"{folder}: the tokenizer files (tokenizer.json, tokenizer_config.json) cannot be read "
                             f"({type(e).__name__}: {first}); re-download or re-convert the model folder") from None


def eos_ids(folder: str) -> set[int]:
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:
        eos = load_config(folder).eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def prompt_ids(cfg: TandemConfig, tokenizer, vocab_size: int) -> list[int]:
    if cfg.prompt_ids is not None:
        ids = list(cfg.prompt_ids)
    elif tokenizer is None:
        raise ConfigError(f"{cfg.model.target} has no tokenizer: give prompt_ids=[...] instead of prompt")
    elif cfg.chat and tokenizer.chat_template:
        messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [{"role": "user", "content": cfg.prompt}]
        ids = chat_ids(tokenizer, messages)
    else:
        ids = tokenizer(cfg.prompt)["input_ids"]
    check_ids(ids, vocab_size)
    check_capacity(cfg, len(ids), cfg.gen.max_new_tokens)
    return ids


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation through the model's chat template, ready for the assistant's answer."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def check_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise ConfigError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"prompt_ids holds {bad[0]}, outside the model's vocabulary of {vocab_size}")


def output_room(cfg: TandemConfig, prompt_tokens: int) -> tuple[int, str]:
    """(new tokens that fit every cache after this prompt, the setting that bounds it). Every cache must
    hold prompt + output + the drafts of the last round."""
    caches = [(cfg.model.max_len, "model.max_len")]
    if cfg.draft.kind == "model" and cfg.spec.k > 0:
        caches.append((cfg.draft.max_len, "draft.max_len"))
    capacity, setting = min(caches, key=lambda c: c[0])  # on a tie, the target's setting
    return capacity - prompt_tokens - cfg.spec.k, setting


def check_capacity(cfg: TandemConfig, prompt_tokens: int, max_new_tokens: int) -> None:
    """Checked before any round, so a generation never fails half-way for want of room."""
    room, setting = output_room(cfg, prompt_tokens)
    if max_new_tokens > room:
        raise CapacityError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) + spec.k ({cfg.spec.k}) "
                            f"exceed {setting}={room + prompt_tokens + cfg.spec.k}; raise {setting} or shorten")


class CapacityError(ConfigError):
    """A request that does not fit the caches (one-shot: at start; serving: a 400 for that request)."""


def check_tokenizer(tokenizer, config, folder: str) -> None:
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        raise ModelLoadError(f"{folder}: the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is "
                             f"{config.vocab_size}; tokenizer and model are from different checkpoints")


def build_drafter(cfg: TandemConfig, target_tokenizer, target_config):
    from speculative.drafters import NgramDrafter, NoDrafter
    d = cfg.draft
    if d.kind == "none" or cfg.spec.k == 0:
        return NoDrafter()
    if d.kind == "ngram":
        return NgramDrafter(d.ngram_max, d.ngram_min)
    return model_drafter(cfg)  # its vocabulary was checked before any weights loaded (check_vocabularies)


def model_drafter(cfg: TandemConfig):
    """draft.model as a ModelDrafter (what build_drafter gives once the vocabularies are checked)."""
    from speculative.drafters import ModelDrafter
    return ModelDrafter(build_draft_stage(cfg), max_k=max(cfg.spec.k, 1), top_k=cfg.draft.top_k,
                        use_graph=use_graph(cfg.draft, draft_device(cfg)))


def use_graph(d, device: str) -> bool:
    """draft.graph: auto = capture on CUDA; on = insist (and say why it cannot be)."""
    import torch
    on_cuda = device.startswith("cuda")
    if d.graph == "on" and not (on_cuda and torch.cuda.is_available()):
        raise ConfigError(f"draft.graph=on needs a CUDA draft.device (got {device!r}"
                          f"{'' if torch.cuda.is_available() else ', no CUDA here'}); use draft.graph=auto")
    return d.graph == "on" or (d.graph == "auto" and on_cuda)


def check_vocabularies(cfg: TandemConfig, target_tokenizer, target_config) -> None:
    """Rank 0, from config.json, the tokenizers and the checkpoints' headers, before any weights load:
    the target's embedding and head rows match its vocab_size, and a model drafter shares its vocabulary."""
    check_tokenizer(target_tokenizer, target_config, cfg.model.target)
    check_vocabulary_rows(cfg.model.target, target_config)
    if cfg.draft.kind == "model" and cfg.spec.k > 0:
        draft_config = load_config(cfg.draft.model)
        check_vocabulary_rows(cfg.draft.model, draft_config)
        check_same_vocabulary(cfg.model.target, cfg.draft.model, target_tokenizer, target_config, draft_config)


def check_vocabulary_rows(folder: str, config) -> None:
    """The embedding's and the head's rows, as the safetensors headers give them (nothing is read), must be
    config.json's vocab_size: otherwise an id the tokenizer gives indexes past the embedding, or the head
    scores a vocabulary the tokenizer does not have. Quantized (packed) matrices are left to the loader."""
    from model_parallel.loader import checkpoint_index, open_checkpoint
    index = checkpoint_index(Path(folder))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        file = index.get(name)
        if file is None or not file.is_file():  # tied head, or a shard this host does not hold
            continue
        with open_checkpoint(file) as f:
            shape = f.get_slice(name).get_shape()
        if len(shape) == 2 and shape[1] == config.hidden_size and shape[0] != config.vocab_size:
            raise ModelLoadError(f"{folder}: {name} has {shape[0]} rows but config.json's vocab_size is {config.vocab_size}; "
                                 "config and weights are from different checkpoints")


def check_same_vocabulary(target: str, draft: str, target_tokenizer, target_config, draft_config) -> None:
    """A drafter with another vocabulary proposes ids that mean other words, or ids past the target's
    embedding: refuse it at start. Its vocab_size may be smaller than the target's (padding rows differ
    within a family) but must cover the tokenizer."""
    draft_tokenizer = load_tokenizer(draft)
    fix = "draft.model must share the target's tokenizer (e.g. a smaller model of the same family)"
    if (target_tokenizer is None) != (draft_tokenizer is None):
        raise ConfigError(f"only one of model.target and draft.model has a tokenizer; {fix}")
    if target_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ConfigError(f"the drafter's tokenizer ({draft}) differs from the target's ({target}); {fix}")
        if not len(target_tokenizer) <= draft_config.vocab_size <= target_config.vocab_size:
            raise ConfigError(f"draft vocab_size {draft_config.vocab_size} does not fit the target's: it must cover the "
                              f"tokenizer's {len(target_tokenizer)} tokens and not exceed the target's vocab_size "
                              f"{target_config.vocab_size}; {fix}")
    elif draft_config.vocab_size != target_config.vocab_size:
        raise ConfigError(f"draft vocab_size {draft_config.vocab_size} != target vocab_size {target_config.vocab_size}; {fix}")
