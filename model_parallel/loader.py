"""Build a stage from a Hugging Face folder, materializing only the tensors that stage runs.

The full model is instantiated on the meta device (no memory), the stage's tensors are read one by
one from the safetensors files (sharded or single) and assigned in place, and the rest of the shell
is dropped. A rank therefore never holds the other rank's weights, not even briefly. With NF4 or int8
(`quant=`), each layer is quantized as soon as it arrived, before the next one is read.
"""
from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from model_parallel.lines import one_line
from model_parallel.stage import Stage

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "gemma3_text", "phi3", "smollm3")
# Layer kinds whose state a position cannot rewind. Speculative decoding rewinds every layer to the last
# accepted token after a miss; attention caches are indexed by position, so that is moving one number. A
# linear-attention or state-space layer folds each token into one recurrent state, in place: the state
# before a rejected draft is gone.
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv", "recurrent", "rwkv", "lstm", "deltanet", "lightning", "ssm")
RECURRENT_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "mamba", "mamba2",
                      "falcon_mamba", "falcon_h1", "jamba", "zamba", "zamba2", "bamba", "granitemoehybrid", "lfm2",
                      "lfm2_moe", "nemotron_h", "minimax", "recurrent_gemma", "rwkv", "xlstm", "olmo_hybrid", "kimi_linear")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# config.json fields without which the model's shape is unknown. transformers would fill a missing
# one with its class default (e.g. 32 layers) and fail later, far from the cause, or not at all.
REQUIRED_CONFIG_FIELDS = {"model_type": str, "num_hidden_layers": int, "hidden_size": int,
                          "num_attention_heads": int, "vocab_size": int}
# What fixes a damaged download. fetch_weights skips a folder it once completed, hence "delete".
REFETCH = "delete the folder and download or convert the model again (`python -m model_parallel.fetch_weights` for the bundled ones)"
# What safetensors raises for a file it cannot read: a bad header or data that does not cover it
# (SafetensorError), a missing or unreadable file (OSError), and, in some versions, ValueError.
SAFETENSORS_READ_ERRORS = (SafetensorError, OSError, ValueError)
# What AutoConfig.from_pretrained raises for a config.json it cannot make a config of: OSError for
# unreadable JSON, ValueError / TypeError / KeyError for unknown or malformed fields, and the hub's
# StrictDataclassError for values its validators refuse.
CONFIG_READ_ERRORS = (OSError, ValueError, TypeError, KeyError, StrictDataclassError)


class ModelLoadError(RuntimeError):
    """A model folder that cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """One model as a rank reads it: its folder, config.json parsed once, and (when first asked) the model
    built once on the meta device in `dtype`: the shapes model_parallel.memory counts, the classes
    model_parallel.split times, the tensor names a stage reads. load_stage fills the shell's share with
    the weights, so a source gives one stage (the drafter is a source of its own, even from the same folder)."""
    folder: Path
    config: object
    dtype: str = "float32"

    @classmethod
    def open(cls, folder: str | Path, dtype: str = "float32") -> ModelSource:
        return cls(Path(folder), load_config(folder), dtype)

    @cached_property
    def shell(self):
        return model_shell(self.folder, self.config, DTYPES[self.dtype])

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


def _source(model: str | Path | ModelSource, dtype: str = "float32") -> ModelSource:
    return model if isinstance(model, ModelSource) else ModelSource.open(model, dtype)


def load_config(folder: str | Path):
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        hint = fetch_hint(folder)
        raise ModelLoadError(f"model folder {folder} has no config.json ({'missing folder' if not folder.exists() else 'not a HF model folder'}); {hint}")
    check_config_fields(path, read_json(path))
    config = parse_config(folder, path)
    config._attn_implementation = "sdpa"  # our boolean position mask is an sdpa mask
    return config


def fetch_hint(folder: Path) -> str:
    """What to do about a missing model folder. One that fetch_weights makes (known by its folder name,
    wherever TANDEM_CACHE or the setting puts it) names the fetch command; anything else is the user's own."""
    from model_parallel.fetch_weights import DEFAULT_MODELS, MODELS, default_cache_dir, model_dir
    name = next((n for n, spec in MODELS.items() if spec.folder == folder.name), None)
    if name is None:
        return "pass a local Hugging Face folder (config.json, *.safetensors, tokenizer) or a Hub id (org/name[@revision])"
    command = "python -m model_parallel.fetch_weights" + ("" if name in DEFAULT_MODELS else f" --models {name}")
    if folder.parent.name != "models":
        return f"run `{command}` first and point the setting at {model_dir(name)}, where it puts the model"
    cache = folder.parent.parent
    if cache.resolve() != default_cache_dir().resolve():
        command += f" --cache {cache}"
    return f"run `{command}` first"


def read_json(path: Path) -> dict:
    """A JSON object from a model folder's file; anything else is a damaged file, said in one line."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise ModelLoadError(f"{path} cannot be read ({one_line(e)}); check the file and its permissions") from e
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        raise ModelLoadError(f"{path} is not valid JSON ({one_line(e)}); the file is damaged: {REFETCH}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, not an object; the file is damaged: {REFETCH}")
    return data


def check_config_fields(path: Path, raw: dict) -> None:
    """Checked on the raw JSON, before transformers fills gaps with defaults of some other model."""
    for field, kind in REQUIRED_CONFIG_FIELDS.items():
        value = raw.get(field)
        if value is None:
            raise ModelLoadError(f"{path} {'lacks' if field not in raw else 'has null for'} {field!r}; the file is incomplete: {REFETCH}")
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value <= 0):
            raise ModelLoadError(f"{path}: {field}={value!r} is not a {'positive integer' if kind is int else 'string'}; "
                                 f"the file is damaged: {REFETCH}")
    if not isinstance(raw.get("quantization_config", {}), dict):  # transformers would fail on it deep inside to_dict()
        raise ModelLoadError(f"{path}: quantization_config is not an object; the file is damaged: {REFETCH}")
    kinds = raw.get("layer_types") if isinstance(raw.get("layer_types"), list) else []
    recurrent = [k for k in kinds if isinstance(k, str) and any(word in k for word in RECURRENT_LAYER_TYPES)]
    if raw["model_type"] in RECURRENT_FAMILIES or recurrent:
        kind = f" ({recurrent[0]} layers)" if recurrent else ""
        raise ModelLoadError(f"{path.parent}: architecture {raw['model_type']!r}{kind} is not supported: its linear-attention / "
                             f"state-space layers keep a recurrent state updated in place token by token, which cannot be rewound "
                             f"to a position after a rejected draft; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    if raw["model_type"] not in SUPPORTED_FAMILIES:
        raise ModelLoadError(f"{path.parent}: architecture {raw['model_type']!r} is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}")


def parse_config(folder: Path, path: Path):
    """transformers' config for the folder; the fields it refuses become one line naming config.json."""
    try:
        return AutoConfig.from_pretrained(folder)
    except CONFIG_READ_ERRORS as e:
        raise ModelLoadError(f"{path}: transformers cannot read it ({one_line(e)}); fix the field it names or {REFETCH}") from e


def checkpoint_index(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sharded_index(folder, index)
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{folder} has no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are read)")
    with open_checkpoint(single) as f:
        return {name: single for name in f.keys()}


def sharded_index(folder: Path, index: Path) -> dict[str, Path]:
    """The index's weight_map. The shards it names are not checked here but when a stage opens them:
    a host may hold only the shards its own stage reads."""
    return {name: folder / file for name, file in read_weight_map(index).items()}


def read_weight_map(index: Path) -> dict[str, str]:
    """tensor name -> shard file, each file a plain name in the index's own folder. Every reader of the index
    comes here: a name is joined to a folder and the file opened (and, for a Hub id, created and written at
    offsets the server gives), so `../x` or `/abs/x` would reach outside the checkpoint."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise ModelLoadError(f"{index} has no \"weight_map\" object (tensor name -> file name); the file is damaged: {REFETCH}")
    for name, file in weight_map.items():
        if not is_plain_shard_name(file):
            raise ModelLoadError(f"{index}: weight_map entry {name!r} names {file!r}, not a plain *.safetensors file name in "
                                 f"the checkpoint's folder (no '/', '\\', '..' or absolute path); the index is broken or "
                                 f"hostile: refusing it")
    return weight_map


def is_plain_shard_name(file: str) -> bool:
    """A file name the Hub's repo root can hold and the index's folder joins to a file inside itself."""
    return file.endswith(".safetensors") and not file.startswith(".") and not any(c in file for c in "/\\\0")


@contextmanager
def open_checkpoint(file: Path):
    """safe_open, with a missing, truncated or damaged file as a ModelLoadError naming it. safetensors
    checks on open that the header parses and that the data covers every tensor it lists.
    Only the open is guarded: errors raised in the caller's `with` body pass through unchanged."""
    try:
        handle = safe_open(file, "pt", device="cpu")
    except SAFETENSORS_READ_ERRORS as e:
        raise unreadable_checkpoint(file, e) from e
    with handle as f:
        yield f


def read_tensor(f, file: Path, ckpt: str) -> torch.Tensor:
    try:
        return f.get_tensor(ckpt)
    except SAFETENSORS_READ_ERRORS as e:
        raise unreadable_checkpoint(file, e) from e


def unreadable_checkpoint(file: Path, error: Exception) -> ModelLoadError:
    if isinstance(error, FileNotFoundError):  # a shard the index names but the folder lacks
        return ModelLoadError(f"{file} is missing, though model.safetensors.index.json lists it; the download is incomplete: {REFETCH}")
    if isinstance(error, PermissionError):
        return ModelLoadError(f"{file} cannot be read ({one_line(error)}); fix its permissions")
    return ModelLoadError(f"{file} is not a readable safetensors file ({one_line(error)}); it is truncated or damaged: {REFETCH}")


def non_finite_kind(tensor: torch.Tensor) -> str | None:
    """"NaN" or "Inf" if the tensor holds one, else None. aminmax rather than isfinite(t).all(): NaN
    propagates into min and max and an Inf is one of them, so one pass decides, with no bool temporary
    as big as the tensor. On CPU, for a 151936x1536 bf16 embedding: ~80 ms, against ~3.4 s for isfinite."""
    if not tensor.is_floating_point() or tensor.numel() == 0:  # 4-bit packed weights are uint8
        return None
    low, high = torch.aminmax(tensor)
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return None
    return "NaN" if bool(torch.isnan(low) | torch.isnan(high)) else "Inf"


def stage_tensor_names(config, first: int, last: int, embed: bool, head: bool, available) -> dict[str, str]:
    """Parameter name in the model -> tensor name in the checkpoint, for the stage's share (a checkpoint
    whose names are the model's own; `stage_sources` is the general form)."""
    sources = stage_sources(config, first, last, embed, head, {name: [name] for name in available})
    return {param: ckpts[0] for param, ckpts in sources.items()}


def stage_sources(config, first: int, last: int, embed: bool, head: bool, sources: dict[str, list[str]]) -> dict[str, list[str]]:
    """The stage's share of `sources` (parameter name -> checkpoint tensors it is made of, see
    `checkpoint_sources`): layers [first, last), the embeddings and/or the final norm + head."""
    wanted = {}
    prefixes = tuple(f"model.layers.{i}." for i in range(first, last))
    for param, ckpts in sources.items():
        if param.startswith(prefixes):
            wanted[param] = ckpts
    if embed:
        wanted["model.embed_tokens.weight"] = ["model.embed_tokens.weight"]
    if head:
        wanted["model.norm.weight"] = ["model.norm.weight"]
        tied = getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in sources
        # With tied embeddings the head *is* the embedding matrix: the last rank reads it for its head
        # (a stage holding both, a drafter, shares one copy: see load_stage).
        if not (tied and embed):
            wanted["lm_head.weight"] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return wanted


def checkpoint_sources(shell, available) -> tuple[dict[str, list[str]], dict[str, tuple]]:
    """Parameter name -> the checkpoint tensors it is made of, by transformers' own loading rules
    (`get_model_conversion_mapping`, what from_pretrained applies): most parameters are one tensor under
    their own name; a fused one (qwen3_moe's experts: one 3-D tensor for all experts' gate+up) is many,
    joined by the library's WeightConverter. Returns (sources, fused: param -> (converter, {ckpt: pattern}))."""
    mapping = get_model_conversion_mapping(shell)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    params = shell.state_dict()
    sources: dict[str, list[str]] = {}
    fused: dict[str, tuple] = {}
    for ckpt in sorted(available, key=dot_natural_key):  # the order from_pretrained hands tensors to a converter
        param, pattern = rename_source_key(ckpt, renamings, converters, shell.base_model_prefix, params)
        if param not in params and ckpt in params:
            param, pattern = ckpt, None
        sources.setdefault(param, []).append(ckpt)
        if pattern is not None:
            fused.setdefault(param, (by_pattern[pattern], {}))[1][ckpt] = pattern
    return sources, fused


def read_tensors(names: dict[str, str], index: dict[str, Path], dtype, device, bar=None):
    """Yield (name, tensor) reading only the named tensors (dtype None: as stored), each in memory of its own.

    safetensors maps the file per open, and a tensor it reads on CPU is a view of that mapping, which
    keeps the mapping (with each page read so far) alive. Running from the mapping is also slower: on
    the 2-core CPU of bench/README.md a drafter step over the mapped pages took 1.21x the same step over
    the process's own memory (bench/mapped_weights.py). So a tensor still on the mapping after its cast (same dtype, CPU) is
    copied, and the file is opened per tensor: the mapping and its pages go once the copy is made."""
    for name, ckpt in names.items():
        file = index[ckpt]
        with open_checkpoint(file) as f:
            stored = read_tensor(f, file, ckpt)
            tensor = finite_tensor(stored, file, ckpt, dtype, device)
            if tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
                tensor = tensor.clone()
            del stored
        yield name, tensor
        if bar is not None:
            bar.update()


def finite_tensor(stored: torch.Tensor, file: Path, ckpt: str, dtype, device) -> torch.Tensor:
    """The stored tensor in `dtype` on `device`, refused if it holds NaN or Inf: such weights run
    without an error and answer one token over and over. Checked after the cast, so the check runs on
    the device, before a quantizer sees the tensor, and catches a cast that overflows."""
    tensor = stored.to(device=device, dtype=dtype)
    kind = non_finite_kind(tensor)
    if kind is None:
        return tensor
    if tensor.dtype != stored.dtype and non_finite_kind(stored) is None:  # only on this failure path: free otherwise
        raise ModelLoadError(f"{file}: tensor {ckpt} holds values beyond {str(tensor.dtype).removeprefix('torch.')}'s range "
                             f"(stored as {str(stored.dtype).removeprefix('torch.')}); load it in a wider dtype "
                             f"(model.dtype / draft.dtype = bfloat16 or float32)")
    raise ModelLoadError(f"{file}: tensor {ckpt} holds {kind} values; the checkpoint is corrupt or was saved from a "
                         f"diverged model: {REFETCH}")


def quantized_stats(available) -> dict[str, dict[str, str]]:
    """In a checkpoint saved in 4-bit by transformers + bitsandbytes, each packed weight comes with
    tensors named `<weight>.<stat>` (absmax, quant_map, quant_state.bitsandbytes__nf4, ...).
    Returns packed weight name -> {stat: tensor name}; empty for a plain checkpoint."""
    stats: dict[str, dict[str, str]] = {}
    for name in available:
        module, sep, stat = name.partition(".weight.")
        if sep:
            stats.setdefault(module + ".weight", {})[stat] = name
    return stats


def check_quantization(folder: Path, config, stats: dict, quant) -> None:
    """Refuse checkpoints we would misread: other quantization formats, or NF4 without model.quant=nf4."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        is_nf4 = qc.get("quant_method") == "bitsandbytes" and qc.get("load_in_4bit") and qc.get("bnb_4bit_quant_type") == "nf4"
        if not is_nf4:
            kind = qc.get("quant_method", "?") + (" 8-bit" if qc.get("load_in_8bit") else "") + \
                (f" {qc['bnb_4bit_quant_type']}" if qc.get("load_in_4bit") else "")
            raise ModelLoadError(f"{folder} is quantized ({kind}); Tandem reads plain safetensors checkpoints and "
                                 f"bitsandbytes NF4 ones: use the full-precision checkpoint (and model.quant=nf4 to quantize on load)")
    if stats and (quant is None or getattr(quant, "name", "nf4") != "nf4"):  # (quant=True: any, to list names)
        raise ModelLoadError(f"{folder} is stored in 4-bit NF4 (bitsandbytes); load it with model.quant=nf4 "
                             f"(draft.quant=nf4 for a drafter), or use the full-precision checkpoint")


def stage_parts(names: dict[str, str]) -> list[tuple[int | str, list[str]]]:
    """The stage's parameters in load order, grouped: ("embeddings", ...), (i, layer i's)..., ("head",
    norm + head). Loading part by part bounds what is in memory at full precision at any time."""
    front, layers, back = [], {}, []
    for param in names:
        if param.startswith("model.layers."):
            layers.setdefault(int(param.split(".")[2]), []).append(param)
        else:
            (front if param.startswith("model.embed_tokens.") else back).append(param)
    return [("embeddings", front), *sorted(layers.items()), ("head", back)]


def model_shell(folder: Path, config, torch_dtype):
    """The whole model on the meta device. Building it is where transformers first uses config.json's
    optional fields (rope_scaling, ...): a value it cannot use is the config's fault, said so."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    except CONFIG_READ_ERRORS as e:
        raise ModelLoadError(f"{folder / 'config.json'}: transformers cannot build the model from it ({one_line(e)}); "
                             f"fix the field it names or {REFETCH}") from e


def place(shell, param: str, tensor: torch.Tensor, expected, folder: Path, ckpt: str) -> None:
    if tensor.shape != expected:
        raise ModelLoadError(f"{folder}: tensor {ckpt} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected)}; config and weights disagree")
    module_name, _, leaf = param.rpartition(".")
    setattr(shell.get_submodule(module_name), leaf, torch.nn.Parameter(tensor, requires_grad=False))


def load_part(shell, part: list[str], names: dict[str, list[str]], fused: dict, params: dict, index: dict[str, Path],
              stats: dict, dtype, device, quant, folder: Path, bar) -> None:
    """Read one part's tensors into the shell. Tensors stored in 4-bit become Linear4bit modules as
    they are; fused parameters go through transformers' converter; the rest are cast to `dtype`.
    Returns with no reference to what it read but the shell's."""
    plain = {p: names[p][0] for p in part if p not in fused and names[p][0] not in stats}
    for param, tensor in read_tensors(plain, index, dtype, device, bar):
        place(shell, param, tensor, params[param].shape, folder, names[param][0])
    for param in (p for p in part if p in fused):
        place_fused(shell, param, names[param], fused[param], params, index, dtype, device, folder, bar)
    packed = [p for p in part if p not in fused and names[p][0] in stats]
    if packed:
        from model_parallel.quant import prequantized_linear, quantized_shape
    for param in packed:
        ckpt = names[param][0]
        raw = dict(read_tensors({"weight": ckpt, **stats[ckpt]}, index, None, device, bar))
        module_name = param.rpartition(".")[0]
        like = shell.get_submodule(module_name)
        linear = prequantized_linear(like, raw.pop("weight"), raw, like.bias, quant, device)
        if quantized_shape(linear) != tuple(like.weight.shape):
            raise ModelLoadError(f"{folder}: 4-bit tensor {ckpt} stands for shape {quantized_shape(linear)}, config.json implies "
                                 f"{tuple(like.weight.shape)}; config and weights disagree")
        shell.set_submodule(module_name, linear)


def place_fused(shell, param: str, ckpts: list[str], fused: tuple, params: dict, index, dtype, device, folder, bar) -> None:
    """A parameter transformers builds from several checkpoint tensors: its own converter (a fresh copy,
    as from_pretrained makes per parameter) joins them, in checkpoint order."""
    converter, patterns = fused
    converter = copy.deepcopy(converter)
    for ckpt, tensor in read_tensors({c: c for c in ckpts}, index, dtype, device, bar):
        converter.add_tensor(param, ckpt, patterns[ckpt], tensor)
    for name, tensor in converter.convert(param, model=shell, config=shell.config).items():
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        if name not in params:
            raise ModelLoadError(f"{folder}: transformers' conversion of {ckpts[0]} gave {name!r}, which has no place in the model")
        place(shell, name, tensor.contiguous(), params[name].shape, folder, ckpts[0])


def quantize_part(shell, part: int | str, names: dict[str, str], quant) -> None:
    """Quantize the linears a part just brought: a layer's always, the head if asked (and only when
    it has its own weight here: a head tied to embeddings this stage holds stays tied). Embeddings never."""
    from model_parallel.quant import quantize_linears, return_freed_heap
    if isinstance(part, int):
        quantize_linears(shell.model.layers[part], quant)
    elif part == "head" and quant.lm_head and "lm_head.weight" in names:
        shell.lm_head = quant.linear(shell.lm_head)
    return_freed_heap()


def stage_plan(folder: Path, config, shell, first: int, last: int, embed: bool, head: bool, quant=None):
    """What the stage reads: (names: parameter -> checkpoint tensors, fused, index, stats). Nothing but the
    index (or a single file's header) is read."""
    num_layers = config.num_hidden_layers
    if not 0 <= first < last <= num_layers:
        raise ModelLoadError(f"layer range [{first}, {last}) is outside the model's {num_layers} layers")
    index = checkpoint_index(folder)
    stats = quantized_stats(index)
    check_quantization(folder, config, stats, quant)
    stat_names = {name for per_weight in stats.values() for name in per_weight.values()}
    sources, fused = checkpoint_sources(shell, [n for n in index if n not in stat_names])
    names = stage_sources(config, first, last, embed, head, sources)
    params = dict(shell.named_parameters(remove_duplicate=False))
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ModelLoadError(f"{folder}: checkpoint tensor {names[unknown[0]][0]!r} has no place in a {config.model_type} model; "
                             f"is config.json from the same model?")
    missing = [ckpt for ckpts in names.values() for ckpt in ckpts if ckpt not in index]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors this stage needs, e.g. {missing[0]!r}; is the folder complete?")
    return names, fused, index, stats


def stage_checkpoint_tensors(model: str | Path | ModelSource, first: int, last: int, embed: bool, head: bool) -> set[str]:
    """The checkpoint tensor names a stage reads (its 4-bit statistics included): what a host must hold
    of the checkpoint to run it (model_parallel.hub fetches just these)."""
    model = _source(model)
    names, _, _, stats = stage_plan(model.folder, model.config, model.shell, first, last, embed, head, quant=True)
    return {n for ckpts in names.values() for ckpt in ckpts for n in (ckpt, *stats.get(ckpt, {}).values())}


def materialize_buffers(shell, modules, device) -> None:
    """Buffers no checkpoint holds (rotary inv_freq, Gemma's embed_scale) are still on the meta device in
    the shell. As from_pretrained does: a real placeholder, then the model's own _init_weights fills it;
    the loaded parameters are flagged as initialized, which transformers' init functions respect."""
    for module in modules:
        for sub in module.modules():
            meta = [name for name, buf in sub._buffers.items() if buf is not None and buf.is_meta]
            if not meta:
                continue
            for name in meta:
                sub._buffers[name] = torch.empty_like(sub._buffers[name], device=device)
            for p in sub.parameters(recurse=False):
                p._is_hf_initialized = True
            shell._init_weights(sub)


def load_stage(model: str | Path | ModelSource, first: int, last: int, embed: bool, head: bool,
               dtype: str = "float32", device: str = "cpu", progress: str | None = None,
               quant=None) -> Stage:
    """A stage with layers [first, last), plus the embeddings and/or norm + head.

    `quant` (optional, `model_parallel.quant.NF4Settings` or `Int8Settings`) stores the linears in NF4 or int8. The stage is
    read part by part (embeddings, one layer, ..., norm + head) and each part's linears are quantized
    before the next part is read, so at most one layer exists in full precision at a time. A
    checkpoint already saved in NF4 (transformers + BitsAndBytesConfig) is taken as saved. `model`: a folder,
    or the ModelSource the launch parsed (its meta-device shell becomes the stage)."""
    model = _source(model, dtype)
    folder, config, torch_dtype, shell = model.folder, model.config, DTYPES[dtype], model.shell
    names, fused, index, stats = stage_plan(folder, config, shell, first, last, embed, head, quant)
    params = dict(shell.named_parameters(remove_duplicate=False))
    total = sum(len(ckpts) for ckpts in names.values()) + sum(len(stats.get(c[0], ())) for c in names.values())
    with tqdm(total=total, desc=progress, unit="tensor", disable=progress is None, leave=False) as bar:
        for part, part_names in stage_parts(names):
            load_part(shell, part_names, names, fused, params, index, stats, torch_dtype, device, quant, folder, bar)
            if quant is not None and not stats:  # a pre-quantized checkpoint is taken as saved
                quantize_part(shell, part, names, quant)
    if head and embed and "lm_head.weight" not in names:
        shell.lm_head.weight = shell.model.embed_tokens.weight
    layers = list(shell.model.layers[first:last])
    rotary = type(shell.model.rotary_emb)(config=config).to(device)  # built anew: its buffers are not in checkpoints
    stage = Stage(config, layers, first, rotary,
                  embed=shell.model.embed_tokens if embed else None,
                  norm=shell.model.norm if head else None,
                  head=shell.lm_head if head else None)
    materialize_buffers(shell, [m for m in (stage.embed, stage.norm, stage.head, *layers) if m is not None], device)
    still_meta = [n for n, p in stage.named_parameters() if p.is_meta] + [n for n, b in stage.named_buffers() if b.is_meta]
    if still_meta:
        raise ModelLoadError(f"{folder}: no tensor in the checkpoint for {still_meta[0]}")
    return stage.eval()
