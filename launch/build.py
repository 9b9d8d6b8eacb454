"""The Plan -> the pieces a rank runs: its stage, (rank 0) the drafter, tokenizer and prompt ids.

Every stage is built here: the target's slices (one per rank) and the drafter's whole small model go through
`_load_stage`, with one rule for devices, dtypes and caches (plan.slots KV slots: one per request served at
once); the capacity rule is `check_capacity`."""
from __future__ import annotations

import sys
from pathlib import Path

from launch.config import CapacityError, ConfigError, TandemConfig, output_room
from launch.plan import Models, Plan, quantizer, use_graph
from model_parallel.lines import one_line
from model_parallel.loader import ModelLoadError, ModelSource, load_stage


def build_stage(plan: Plan):
    """This rank's slice of the target: rank 0 the embeddings and its layers, a middle rank its layers, the
    last rank its layers, the final norm and the head."""
    m, layers = plan.settings.model, plan.layers()
    return _load_stage(plan.models.target, layers.start, layers.stop, embed=plan.rank == 0,
                       head=plan.rank == plan.ranks - 1, dtype=m.dtype, device=plan.device, quant=quantizer(plan.settings, "model"),
                       max_len=m.max_len, setting="model.max_len",
                       progress=f"rank {plan.rank} layers {layers.start}-{layers.stop - 1}", rank=plan.rank, slots=plan.slots)


def build_draft_stage(plan: Plan):
    """The drafter's whole model (embeddings, every layer, head) as one stage on draft.device."""
    d, drafter = plan.settings.draft, plan.models.drafter
    return _load_stage(drafter, 0, drafter.num_layers, embed=True, head=True, dtype=d.dtype, device=plan.draft_device,
                       quant=plan.models.draft_quant, max_len=d.max_len, setting="draft.max_len",
                       progress="rank 0 drafter", rank=0, slots=plan.slots)


def _load_stage(model: ModelSource, first, last, *, embed, head, dtype, device, quant, max_len, setting, progress, rank,
                slots):
    from model_parallel.hub import fetch_stage
    fetched = fetch_stage(model, first, last, embed, head, rank, progress=f"{progress}: fetching")  # Hub ids only
    if fetched is not None:
        print(f"[{progress}: {fetched.describe()}]", file=sys.stderr, flush=True)
    stage = load_stage(model, first, last, embed=embed, head=head, dtype=dtype, device=device, progress=progress,
                       quant=quant)
    stage.allocate_cache(max_len, compute_dtype(stage), setting=setting, slots=slots)  # one slot per request at once
    return stage


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
        raise ModelLoadError(f"{folder}: the tokenizer files (tokenizer.json, tokenizer_config.json) cannot be read "
                             f"({one_line(e, 200, named=True)}); re-download or re-convert the model folder") from None


def eos_ids(model: ModelSource) -> set[int]:
    """The ids that end an answer: generation_config.json's, else config.json's."""
    from transformers import GenerationConfig
    try:
        eos = GenerationConfig.from_pretrained(model.folder).eos_token_id
    except OSError:
        eos = model.config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def prompt_ids(cfg: TandemConfig, tokenizer, vocab_size: int) -> list[int]:
    """The one-shot prompt (prompt, prompt_ids, chat, system of the parsed config) as token ids, checked."""
    if cfg.prompt_ids is not None:
        ids = list(cfg.prompt_ids)
    elif tokenizer is None:
        raise ConfigError(f"{cfg.model.target} has no tokenizer: give prompt_ids=[...] instead of prompt")
    elif cfg.chat and tokenizer.chat_template:
        ids = chat_ids(cfg, tokenizer)
    elif cfg.system is not None:  # (chat=false with system= is refused at parse)
        raise ConfigError(f"system= goes in through the chat template, and {cfg.model.target} has none: put the system "
                          "message in the prompt")
    else:
        ids = tokenizer(cfg.prompt)["input_ids"]
    check_ids(ids, vocab_size)
    check_capacity(cfg, len(ids), cfg.gen.max_new_tokens)
    return ids


def chat_ids(cfg: TandemConfig, tokenizer) -> list[int]:
    """system (if given) and prompt through the model's chat template, ready for the assistant's answer, as the
    server sends a conversation (chat_template_ids, which launch.serve.prompts.template_ids calls); a template that
    refuses them (some refuse a system role) is one line."""
    system = [{"role": "system", "content": cfg.system}] if cfg.system is not None else []
    try:
        return chat_template_ids(tokenizer, [*system, {"role": "user", "content": cfg.prompt}])
    except TemplateRefused as e:
        fix = "leave system= out (or put it in the prompt)" if system else "give chat=false to send the prompt without it"
        raise ConfigError(f"{cfg.model.target}: {e}; {fix}") from None


class TemplateRefused(ValueError):
    """The model's chat template raised on a conversation (the server's 400, the entry's one line)."""


def chat_template_ids(tokenizer, conversation: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The conversation (and the tools) through the model's chat template, ready for the assistant's answer."""
    try:
        out = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)
    except Exception as e:  # noqa: BLE001 - a template may raise anything on a conversation it does not expect
        raise TemplateRefused(f"the chat template refused these messages ({type(e).__name__}: {str(e)[:200]})") from None
    return list(out["input_ids"])


def check_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:  # an empty text (allow_empty_prompt) without the chat template, and no BOS of the tokenizer's
        raise ConfigError("the prompt has no tokens (an empty text without the chat template, and the tokenizer adds "
                          "none of its own); give some text, or prompt_ids=[...]")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"prompt_ids holds {bad[0]}, outside the model's vocabulary of {vocab_size}")


def check_capacity(cfg: TandemConfig, prompt_tokens: int, max_new_tokens: int) -> None:
    """Checked before any round, so a generation never fails half-way for want of room."""
    room, setting = output_room(cfg, prompt_tokens)
    if max_new_tokens > room:
        raise CapacityError(f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) + spec.k ({cfg.spec.k}) "
                            f"exceed {setting}={room + prompt_tokens + cfg.spec.k}; raise {setting} or shorten")


def check_tokenizer(tokenizer, config, folder: str) -> None:
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        raise ModelLoadError(f"{folder}: the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is "
                             f"{config.vocab_size}; tokenizer and model are from different checkpoints")


def build_drafter(plan: Plan):
    """Rank 0's drafter as draft.kind says (none with spec.k=0)."""
    from speculative.drafters import NgramDrafter, NoDrafter
    cfg = plan.settings
    if cfg.draft.kind == "none" or cfg.spec.k == 0:
        return NoDrafter()
    if cfg.draft.kind == "ngram":
        return NgramDrafter(cfg.draft.ngram_max, cfg.draft.ngram_min)
    return model_drafter(plan)  # its vocabulary was checked before any weights loaded (check_vocabularies)


def model_drafter(plan: Plan):
    """draft.model as a ModelDrafter (what build_drafter gives once the vocabularies are checked); with
    draft.kind=hybrid, one that looks the context up first (draft.lookup_min) and drafts only when that fails."""
    from speculative.drafters import HybridDrafter, ModelDrafter
    cfg = plan.settings
    model = dict(max_k=max(cfg.spec.k, 1), top_k=cfg.draft.top_k, use_graph=use_graph(cfg.draft, plan.draft_device),
                 slots=plan.slots)
    if cfg.draft.kind == "hybrid":
        return HybridDrafter(build_draft_stage(plan), cfg.draft.lookup_min, cfg.draft.ngram_max, cfg.draft.lookup_k,
                             **model)
    return ModelDrafter(build_draft_stage(plan), **model)


def build_prefixes(plan: Plan, stage, drafter=None):
    """cache.dir: this rank's saved prefixes (speculative.prefixes), rank 0's model drafter's too; None when off.
    A folder that cannot be made or written is one line now, not a failure at the first long prompt."""
    c = plan.settings.cache
    if c.dir is None:
        return None
    import os
    from model_parallel.identity import numerics, stage_identity
    from speculative.prefixes import CacheSettings, RankPrefixes
    from model_parallel.memory import parse_size
    from speculative.drafters import ModelDrafter
    try:
        Path(c.dir).mkdir(parents=True, exist_ok=True)
        if not os.access(c.dir, os.W_OK | os.X_OK):
            raise PermissionError("not writable by this user")
    except OSError as e:
        raise ConfigError(f"cache.dir={c.dir} cannot be used on rank {plan.rank} ({one_line(e)}); give a writable folder, "
                          "or leave cache.dir unset") from None
    settings = CacheSettings(c.dir, c.min_tokens, parse_size(c.max_bytes, "cache.max_bytes"), c.block_tokens)
    cfg, layers, rank = plan.settings, plan.layers(), plan.rank
    identity = stage_identity(plan.models.target.folder, layers.start, layers.stop, rank == 0, rank == plan.ranks - 1,
                              numerics(dtype=cfg.model.dtype, quant=str(quantizer(cfg, "model"))), cache_dir=c.dir)
    draft = None
    if isinstance(drafter, ModelDrafter):
        model = plan.models.drafter
        draft = (stage_identity(model.folder, 0, model.num_layers, True, True,
                                numerics(dtype=cfg.draft.dtype, quant=str(plan.models.draft_quant)), cache_dir=c.dir), drafter)
    warn = (lambda line: print(f"[rank {rank}] warning: {line}", file=sys.stderr, flush=True))
    return RankPrefixes(settings, identity, stage.cache, draft, warn)


def check_vocabularies(models: Models, target_tokenizer) -> None:
    """Rank 0, from config.json, the tokenizers and the checkpoints' headers, before any weights load:
    the target's embedding and head rows match its vocab_size, and a model drafter shares its vocabulary."""
    target, drafter = models.target, models.drafter
    check_tokenizer(target_tokenizer, target.config, str(target.folder))
    check_vocabulary_rows(target.folder, target.config)
    if drafter is not None:
        check_vocabulary_rows(drafter.folder, drafter.config)
        check_same_vocabulary(str(target.folder), str(drafter.folder), target_tokenizer, target.config, drafter.config)


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
