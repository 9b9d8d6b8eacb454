"""The configuration tree: the dataclasses below hold every key's default and its meaning, once.

    defaults (these dataclasses) <- config=FILE (optional YAML) <- key=value overrides

Structured configs make omegaconf reject an unknown key at start; we turn its exception into one line
that lists the valid keys of the section the typo is in. `configs/default.yaml` spells the defaults
out as a documented example (a test keeps it equal to the dataclasses); `validate` is the one place
that checks values.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import math
import os
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from model_parallel.lines import one_line

MODELS = "${oc.env:TANDEM_CACHE,'~/.cache/tandem'}/models"  # where model_parallel.fetch_weights puts them
# transport.start_timeout_s: how long a rank waits for the others' timings at start-up (launch.handshake), as
# torchrun's rendezvous waits 900 s for its ranks to join
START_TIMEOUT_S = 900.0


class ConfigError(ValueError):
    """A configuration mistake; the message says what to change."""


class StdinError(ConfigError):
    """prompt_file=- (or system_file=-) that rank 0 alone read is empty or not UTF-8: the other ranks never read
    it, parse the same command line without it and go on to meet rank 0, which must tell them (the entry does)."""


class CapacityError(ConfigError):
    """A request that does not fit the caches (one-shot: at start; serving: a 400 for that request)."""


@dataclass
class ModelConfig:
    target: str = f"{MODELS}/qwen2.5-coder-1.5b-instruct"  # a local HF folder (config.json, *.safetensors, tokenizer), or a Hub id org/name[@revision]
    split: int | str | list[int] | None = "auto"  # first layer of rank 1 (N ranks: [first layer of ranks 1..N-1]); auto = of the splits that fit model.max_memory, the fastest (each rank times itself); None = even
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    max_len: int = 4096  # KV-cache capacity of each stage, in tokens (prompt + output + K)
    max_memory: Any = None  # bytes a rank may hold for weights + KV cache (+ the drafter on rank 0): 6GiB, 500MB, or a list, one per rank; None = free memory less 10%
    prefill_chunk: int = 512  # a longer prompt crosses in chunks of this many tokens, pipelined across the ranks
    quant: str = "none"  # none | int8 (weight-only, a scale per output channel) | nf4 (bitsandbytes 4-bit); each rank quantizes its own slice; lossy (docs/exactness.md)
    quant_compute_dtype: str = "bfloat16"  # NF4 matmuls compute in this; norms, embeddings, KV cache stay in model.dtype
    quant_double: bool = True  # NF4 double quantization
    quant_lm_head: bool = False  # quantize the target's LM head too (and an NF4 drafter's); it stays in full precision unless asked
    hub_cache: str | None = None  # where Hub ids (target and drafter) are cached; None = huggingface_hub's (HF_HUB_CACHE)


@dataclass
class DraftConfig:
    kind: str = "model"  # none (one token per round trip) | model (a small LM) | ngram (prompt lookup) | hybrid (lookup when the context recurs, else the model)
    model: str | None = f"{MODELS}/qwen2.5-coder-0.5b-instruct"  # a local HF folder or Hub id sharing the target's tokenizer
    device: str = "auto"  # auto = the target's device on rank 0 (its GPU when it has one), or e.g. cpu, cuda:1
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    graph: str = "auto"  # auto | on | off : capture the draft step as a CUDA graph (CUDA only)
    max_len: int = 4096  # drafter KV-cache capacity, in tokens
    top_k: int = 32  # sampled drafts come from the drafter's top-k: their probabilities travel with them
    quant: str = "auto"  # auto (rank 0 times a draft step in each format at start-up and keeps the fastest that keeps acceptance) | none | int8 (weight-only, head too) | nf4 (with model.quant_compute_dtype, quant_double, quant_lm_head); output unchanged
    ngram_max: int = 3  # n-gram drafter: longest suffix it looks up in the context
    ngram_min: int = 1  # n-gram drafter: shortest suffix it looks up
    lookup_min: int = 3  # hybrid: the round is a lookup (no model step) when the context's last this many tokens occurred earlier
    lookup_k: int = 32  # hybrid: a lookup proposes up to this many tokens, past spec.k (a copy costs no drafting; at most spec.k when lower)


@dataclass
class SpecConfig:
    k: int = 4  # draft tokens per round (0 = one token per round trip); the most with spec.adaptive
    adaptive: bool = True  # K grows by 2 after a fully accepted round, shrinks by 1 after a miss (1..k)
    overlap: bool = True  # while a round is in flight, draft (and run stage 0 on) the next one; output unchanged
    k_from_costs: bool = False  # K (0..k) maximises expected tokens/s (of the live streams together) from measured acceptance and costs; output unchanged
    in_flight: int | str = 1  # rounds of one stream on the way at once, sent on the bet that the ones before are fully accepted (1..8, or auto: from measured costs); output unchanged


@dataclass
class GenConfig:
    max_new_tokens: int = 256  # output never exceeds this many tokens
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling: 1.0 = the whole distribution
    seed: int = 0  # sampling is seeded: the same seed gives the same output
    stop: list[str] = field(default_factory=list)  # stop strings; the token that completes one is kept


@dataclass
class TransportConfig:
    kind: str = "gloo"  # gloo | relay: what carries the links between hosts
    local_links: str = "auto"  # auto | direct | transport: a link between two ranks of one host; auto = direct (loopback TCP), except one host with kind=relay (it emulates hosts through the relay)
    relay: str | None = None  # HOST:PORT of the relay (kind=relay); null = torchrun's tandem-relay --rdzv_endpoint
    session: str | None = None  # session id both ranks give the relay; null = torchrun's --rdzv_id
    secret: str | None = None  # the two nodes' pairing secret (keys their end-to-end encryption); prefer secret_file
    secret_file: str | None = None  # file holding the pairing secret (or set TANDEM_SECRET_FILE); never give it to the relay
    relay_token: str | None = None  # the relay's admission token (its --secret-file); prefer relay_token_file
    relay_token_file: str | None = None  # file holding the relay token (or set TANDEM_RELAY_TOKEN_FILE)
    timeout_s: float = 120.0  # per-operation timeout: a silent peer fails within this
    start_timeout_s: float = START_TIMEOUT_S  # the start-up's wait for the other ranks' timings (launch.handshake)
    reconnect_s: float = 60.0  # kind=relay: after a dropped link, re-dial and resume the session for up to this long
    emulate_delay_ms: float = 0.0  # emulated one-way delay added to every message of a link transport.kind carries (tests, benchmarks)
    emulate_mbps: float = 0.0  # emulated bandwidth cap; 0 = none


@dataclass
class OutputConfig:
    json: str | None = None  # rank 0 writes {"token_ids", "text", "stats"} here
    stream: bool = True  # print the text to stdout as tokens commit


@dataclass
class LogConfig:
    dir: str | None = None  # TensorBoard root; a run folder named by time and config goes under it
    trace: bool = True  # with dir: a merged Chrome trace, one row per rank
    profile: bool = False  # with dir: torch.profiler traces for a few rounds


@dataclass
class ServeConfig:
    port: int | None = None  # serve an OpenAI-compatible HTTP API on rank 0 instead of answering `prompt` once
    host: str = "127.0.0.1"  # 0.0.0.0 to accept other hosts (then set api_key_file)
    api_key_file: str | None = None  # a file holding the key clients must send (Authorization: Bearer KEY)
    api_key: str | None = None  # the key itself; prefer api_key_file (a command line shows in `ps`)
    model_name: str | None = None  # the model id clients send; null = the target folder's name
    max_concurrent: int | None = None  # requests served at once, each in its own KV slot on every stage (1..64); null = as many as every rank's model.max_memory holds, at most 8
    max_queue: int = 64  # requests waiting beyond this are refused with 429
    max_body_bytes: int = 1048576  # a request body beyond this is refused with 413 before it is read
    retry_window_s: float = 0.0  # under torchrun --max_restarts: a request that comes while the ranks restart waits up to this for the server, then 503 + Retry-After; 0 = the 503 at once
    via_relay: bool = False  # rank 0 also serves the API through the relay: clients reach it at `tandem-relay --api-port P` (needs api_key_file)
    ssl_certfile: str | None = None  # serve HTTPS (uvicorn's TLS) with this certificate chain (PEM); with ssl_keyfile; through the relay it is end to end
    ssl_keyfile: str | None = None  # the certificate's private key (PEM)


@dataclass
class CacheConfig:
    dir: str | None = None  # each rank saves its layers' KV of long prompts here and later requests and launches restore it (kvcache.disk); null = off
    min_tokens: int = 512  # prompts at least this long are looked up and saved
    max_bytes: Any = "20GiB"  # the folder's size bound (least recently used blocks go first): 20GiB, 500MB
    block_tokens: int = 256  # a prompt is saved in blocks of this many tokens; a shared prefix is reused to the last whole block


@dataclass
class WorkloadConfig:
    streams: int | None = None  # requests admitted at once (each a prompt_tokens prompt and an answer_tokens answer) that the split of model.split=auto is planned to end soonest, by the cost model; null = one stream's decode round (the busiest rank least busy)
    prompt_tokens: int = 2048  # ... each request's prompt
    answer_tokens: int = 256  # ... and its answer


@dataclass
class TandemConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    gen: GenConfig = field(default_factory=GenConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    log: LogConfig = field(default_factory=LogConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    prompt: str | None = None  # plain text, taken as typed (no YAML on the command line); the chat template is applied when the model has one
    prompt_file: str | None = None  # the prompt from this UTF-8 file, as it is (- = stdin, read by rank 0)
    prompt_ids: list[int] | None = None  # token ids, used as they are: a JSON list [1,2,3]
    prompt_ids_file: str | None = None  # token ids from this file (a JSON list)
    chat: bool = True  # false: the prompt goes in as plain text, without the chat template
    system: str | None = None  # system message for the chat template, taken as typed
    system_file: str | None = None  # the system message from this UTF-8 file, as it is
    allow_empty_prompt: bool = False  # true: an empty or all-whitespace prompt / system message is taken as given, not refused
    plan_only: bool = False  # true: the ranks meet and time themselves, print the split, memory per rank and the predicted speed, and exit before loading weights


def _valid_keys(node_cls, path: list[str]) -> list[str]:
    for name in path:
        f = {f.name: f for f in dataclasses.fields(node_cls)}.get(name)
        if f is None or not dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            break
        node_cls = f.default_factory
    return [f.name for f in dataclasses.fields(node_cls)]


def _expand(path: str | None) -> str | None:
    return None if path is None else os.path.expandvars(os.path.expanduser(path))


# Text a person writes is taken from the command line as typed: omegaconf's dotlist would parse it as YAML
# (`a: b` a mapping, `yes` True, ` #...` a comment, `${X}` an interpolation). A YAML file keeps YAML's rules.
VERBATIM = ("prompt", "system", "prompt_file", "system_file", "prompt_ids_file", "serve.api_key", "transport.secret",
            "transport.relay_token")
TEXT_FILES = {"prompt_file": "prompt", "system_file": "system"}  # the file's text becomes that key's

def load_config(overrides: list[str], config_file: str | Path | None = None, *, read_stdin: bool | None = None) -> TandemConfig:
    """Defaults <- YAML file (if any) <- `key=value` overrides. `config=PATH` among the overrides picks the file.
    `read_stdin`: whether `-` (prompt_file=-) reads stdin here; None = on rank 0 alone (`reads_stdin`)."""
    rest, typed = [], {}
    for item in overrides:
        key, _, value = item.partition("=")
        if item.startswith("config="):
            config_file = value
        elif item.startswith("--"):
            raise ConfigError(f"unexpected option {item!r}: settings are given as key=value (e.g. gen.max_new_tokens=64)")
        elif key in VERBATIM or key == "prompt_ids":
            typed[key] = value  # the last one given wins, as in the dotlist
        else:
            rest.append(item)
    layers = [OmegaConf.structured(TandemConfig)]
    where = "command line"
    if config_file:
        config_file = Path(config_file)
        if not config_file.is_file():
            raise ConfigError(f"config file {config_file} not found; pass config=PATH to a YAML file such as configs/default.yaml")
        layers.append(_load_yaml(config_file))
        where = f"{config_file.name} or command line"
    try:
        merged = OmegaConf.merge(*layers, _dotlist(rest))
        cfg: TandemConfig = OmegaConf.to_object(merged)
    except ConfigKeyError as e:
        key = str(getattr(e, "full_key", "") or "")
        parts = key.split(".")
        valid = _valid_keys(TandemConfig, parts[:-1])
        section = ".".join(parts[:-1]) or "top level"
        raise ConfigError(f"unknown config key {key!r} ({where}); valid keys in {section}: {', '.join(valid)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config value: {one_line(e, first=True)} (full key: {getattr(e, 'full_key', '?')})") from None
    _set_typed(cfg, typed, reads_stdin() if read_stdin is None else read_stdin)
    for name in ("target",):
        setattr(cfg.model, name, _expand(getattr(cfg.model, name)))
    cfg.draft.model = _expand(cfg.draft.model)
    cfg.model.hub_cache = _expand(cfg.model.hub_cache)
    cfg.transport.secret_file = _expand(cfg.transport.secret_file)
    cfg.serve.api_key_file = _expand(cfg.serve.api_key_file)
    cfg.serve.ssl_certfile = _expand(cfg.serve.ssl_certfile)
    cfg.serve.ssl_keyfile = _expand(cfg.serve.ssl_keyfile)
    cfg.cache.dir = _expand(cfg.cache.dir)
    cfg.transport.relay_token_file = _expand(cfg.transport.relay_token_file)
    # YAML 1.1 reads a bare on/off as a boolean, which omegaconf then stores in this str field as True/False
    cfg.draft.graph = {"True": "on", "False": "off"}.get(cfg.draft.graph, cfg.draft.graph)
    validate(cfg)
    return cfg


def _dotlist(items: list[str]):
    """The structured keys, through omegaconf; a value YAML cannot read is one line naming its key."""
    try:
        return OmegaConf.from_dotlist(items)
    except yaml.YAMLError:
        for item in items:  # which one
            try:
                OmegaConf.from_dotlist([item])
            except yaml.YAMLError as e:
                key, _, value = item.partition("=")
                raise ConfigError(f"{key}={value!r} is not a value YAML can read ({one_line(e, first=True)}); quote it as YAML "
                                  f"does, e.g. {key}='\"...\"'") from None
        raise


def _load_yaml(path: Path):
    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}); save it "
                          "as UTF-8") from None


def _set_typed(cfg: TandemConfig, typed: dict[str, str], read_stdin: bool) -> None:
    """The keys the dotlist does not parse: free text as typed, token ids as JSON (YAML's alias limit
    refuses a list of more than 10,000); then the text and ids the *_file keys name."""
    for key, value in typed.items():
        if key == "prompt_ids":
            cfg.prompt_ids = _token_ids(value, key)
        else:
            section, _, name = key.rpartition(".")
            setattr(getattr(cfg, section) if section else cfg, name, value)
    for key, text_key in TEXT_FILES.items():
        path = getattr(cfg, key)
        if path is not None:
            if getattr(cfg, text_key) is not None:
                raise ConfigError(f"give {text_key}=... or {key}=PATH, not both")
            setattr(cfg, text_key, _read_text(key, path, read_stdin, cfg.allow_empty_prompt))
    if cfg.prompt_ids_file is not None:
        if cfg.prompt_ids is not None:
            raise ConfigError("give prompt_ids=[...] or prompt_ids_file=PATH, not both")
        cfg.prompt_ids = _token_ids(_read_file("prompt_ids_file", cfg.prompt_ids_file).decode("utf-8", "replace"),
                                    f"prompt_ids_file={cfg.prompt_ids_file}")


def reads_stdin() -> bool:
    """`-` is stdin, read by rank 0 alone (torchrun's RANK; 0 outside torchrun): torchrun gives every worker of
    a host the launcher's stdin, and only rank 0 tokenizes the prompt."""
    return os.environ.get("RANK", "0") == "0"


def _read_text(key: str, path: str, read_stdin: bool, allow_empty: bool) -> str:
    """A file's text as it is (trailing newline and all), UTF-8 and not empty; `-` is stdin where `read_stdin`.
    The other ranks take an empty text in its place (they never read it)."""
    stdin = path == "-"
    if stdin and not read_stdin:
        return ""
    data = _read_file(key, path)
    error = StdinError if stdin else ConfigError  # stdin's are rank 0's alone: the entry tells the others
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{key}={path}: not UTF-8 text (byte {e.start} is 0x{data[e.start]:02x}); save it as UTF-8") from None
    if not allow_empty and not text.strip():
        raise error(_empty_line(TEXT_FILES[key], f"{key}=- (stdin)" if stdin else f"{key}={path}", text))
    return text


def _empty_line(text_key: str, where: str, text: str) -> str:
    """An empty prompt (an unset variable, an empty pipe such as an empty `git diff`) is a mistake far more
    often than a question: one line, with the opt-in."""
    what = "empty" if not text else "all whitespace"
    if text_key == "prompt":
        return (f"{where} is {what}: there is nothing to answer; give the prompt's text, or allow_empty_prompt=true to "
                "answer it as it is")
    return (f"{where} is {what}; give the system message, leave it out (the chat template's default), or "
            "allow_empty_prompt=true to send it as it is")


def _read_file(key: str, path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(_expand(path)).read_bytes()
    except OSError as e:
        raise ConfigError(f"{key}={path}: cannot read it ({e.strerror or e})") from None


def _token_ids(text: str, key: str) -> list[int]:
    try:
        ids = json.loads(text)
    except ValueError:
        ids = None
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):  # type(): a bool is not a token id
        raise ConfigError(f"{key}: expected a JSON list of token ids such as [1,2,3]")
    return ids


def _choice(value, allowed, key):
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}")


def validate(cfg: TandemConfig) -> None:
    _choice(cfg.model.dtype, ("float32", "bfloat16", "float16"), "model.dtype")
    _choice(cfg.draft.dtype, ("float32", "bfloat16", "float16"), "draft.dtype")
    _choice(cfg.model.quant_compute_dtype, ("float32", "bfloat16", "float16"), "model.quant_compute_dtype")
    _choice(cfg.model.quant, ("none", "int8", "nf4"), "model.quant")
    _choice(cfg.draft.quant, ("auto", "none", "int8", "nf4"), "draft.quant")
    _choice(cfg.draft.kind, ("none", "model", "ngram", "hybrid"), "draft.kind")
    _choice(cfg.draft.graph, ("auto", "on", "off"), "draft.graph")
    _choice(cfg.transport.kind, ("gloo", "relay"), "transport.kind")
    _choice(cfg.transport.local_links, ("auto", "direct", "transport"), "transport.local_links")
    _check_sizes(cfg.model.max_memory)
    _check_sizes(cfg.cache.max_bytes if cfg.cache.max_bytes is not None else "null", "cache.max_bytes")
    for key, low, high in BOUNDS:
        _bounded(cfg, key, low, high)
    if cfg.spec.in_flight != "auto" and (isinstance(cfg.spec.in_flight, str) or not 1 <= cfg.spec.in_flight <= 8):
        raise ConfigError(f"spec.in_flight={cfg.spec.in_flight!r} must be 1..8 or auto (rounds of a stream on the way at once)")
    if cfg.draft.ngram_min > cfg.draft.ngram_max:
        raise ConfigError(f"draft.ngram_min={cfg.draft.ngram_min} must be <= draft.ngram_max={cfg.draft.ngram_max}")
    if cfg.draft.kind in ("model", "hybrid") and not cfg.draft.model:
        raise ConfigError(f"draft.kind={cfg.draft.kind} needs draft.model=PATH or a Hub id (a model sharing the target's "
                          "tokenizer)")
    if not in_range("temperature", cfg.gen.temperature):
        raise ConfigError("gen.temperature must be a finite number >= 0 (0 = greedy)")
    if not in_range("top_p", cfg.gen.top_p):
        raise ConfigError("gen.top_p must be in (0, 1]")
    if not in_range("seed", cfg.gen.seed):
        raise ConfigError(f"gen.seed={cfg.gen.seed} does not fit in 64 bits")
    split_cuts(cfg.model.split)
    _check_workload(cfg)
    _check_prompt(cfg)
    if cfg.serve.port is not None and not 0 <= cfg.serve.port <= 65535:
        raise ConfigError(f"serve.port={cfg.serve.port} is not a TCP port (0..65535)")
    if cfg.serve.api_key is not None and cfg.serve.api_key_file is not None:
        raise ConfigError("give serve.api_key_file or serve.api_key, not both")
    _check_exposed_api(cfg.serve)
    _check_room(cfg)


def _check_workload(cfg: TandemConfig) -> None:
    """workload.* plans model.split=auto's split: a given split leaves nothing to plan."""
    if cfg.workload.streams is not None and cfg.model.split != "auto":
        raise ConfigError(f"workload.streams={cfg.workload.streams} plans model.split=auto's split, but "
                          f"model.split={cfg.model.split} fixes it: leave one of the two out")


def _check_exposed_api(serve: ServeConfig) -> None:
    """serve.via_relay exposes the API to whoever reaches the relay: only with a key; TLS files come in pairs."""
    if serve.via_relay and serve.port is None:
        raise ConfigError("serve.via_relay=true serves the API through the relay: give serve.port=PORT too")
    if serve.via_relay and serve.api_key_file is None and serve.api_key is None:
        raise ConfigError("serve.via_relay=true makes the API reachable by anyone who reaches the relay: set "
                          "serve.api_key_file=FILE (create it: python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE)")
    if (serve.ssl_certfile is None) != (serve.ssl_keyfile is None):
        raise ConfigError("give serve.ssl_certfile and serve.ssl_keyfile together (uvicorn's TLS needs both)")
    for key in ("ssl_certfile", "ssl_keyfile"):
        path = getattr(serve, key)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"serve.{key}={path} is not a file")


def _check_prompt(cfg: TandemConfig) -> None:
    """The prompt keys, before anything loads: text that is UTF-8, no two keys of which the run would use one
    and drop the other, a prompt unless serving, and not an empty one (unless allow_empty_prompt)."""
    for key in ("prompt", "system"):
        bad = _not_utf8(getattr(cfg, key))
        if bad:
            fix = "or give the exact token ids as prompt_ids=[...]" if key == "prompt" else "or leave it out"
            raise ConfigError(f"{key}= is not UTF-8 text ({bad}): the tokenizer takes text; convert it (e.g. iconv -f "
                              f"LATIN1 -t UTF-8), {fix}")
    _check_conflicts(cfg)
    if cfg.prompt is None and cfg.prompt_ids is None and cfg.serve.port is None and not cfg.plan_only:
        raise ConfigError('give a prompt: prompt="..." (or prompt_ids=[1,2,3]), or serve.port=PORT to serve an API')
    for key in ("prompt", "system"):  # a *_file's text was checked as it was read (stdin on rank 0 alone)
        text = getattr(cfg, key)
        if text is not None and getattr(cfg, f"{key}_file") is None and not text.strip() and not cfg.allow_empty_prompt:
            raise ConfigError(_empty_line(key, f"{key}=", text))
    if cfg.prompt_ids == []:
        raise ConfigError(f"{_given(cfg, 'prompt_ids').replace('[...]', '[]')} holds no token id; the model needs at "
                          "least one")


def _not_utf8(text: str | None) -> str | None:
    """Where `text` is not UTF-8: bytes the command line could not decode reach Python as lone surrogates
    (surrogateescape), which no tokenizer takes. There is no lossless way to send them as text."""
    try:
        (text or "").encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        at, char = len(text[:e.start].encode("utf-8")), ord(text[e.start])
        if 0xDC80 <= char <= 0xDCFF:  # the byte the command line held
            return f"byte {at} is 0x{char - 0xDC00:02x}"
        return f"byte {at} starts a lone surrogate U+{char:04X}"


def _given(cfg: TandemConfig, key: str) -> str | None:
    """How the text or ids of `key` (prompt, prompt_ids, system) were given, as the user wrote it; None if not."""
    path = getattr(cfg, f"{key}_file")
    if path is not None:
        return f"{key}_file={path}"
    return None if getattr(cfg, key) is None else f"{key}=[...]" if key == "prompt_ids" else f"{key}=..."


def _check_conflicts(cfg: TandemConfig) -> None:
    """Two keys of which the run would use one and silently drop the other: one line naming both."""
    text, ids, system = (_given(cfg, key) for key in ("prompt", "prompt_ids", "system"))
    if cfg.serve.port is not None:
        one_answer = [key for key in (text, ids, system) if key] + ([f"output.json={cfg.output.json}"] if cfg.output.json else [])
        if one_answer:
            raise ConfigError(f"serve.port={cfg.serve.port} serves requests that bring their own prompts, and {one_answer[0]} "
                              "is for one answer (a server ignores it): give one or the other")
    if text and ids:
        raise ConfigError(f"give {text} (text) or {ids} (token ids), not both")
    if system and ids:
        raise ConfigError(f"{ids} is used as it is, without the chat template, so {system} would be dropped: give "
                          "prompt=... as text instead, or put the system message's tokens in the ids")
    if system and not cfg.chat:
        raise ConfigError(f"{system} goes in through the chat template and chat=false leaves the template out: drop one "
                          "(or put the system message in the prompt)")


# The sampling fields of a generation, as gen.* at launch and as an API request's fields (launch/serve/fields.py): their ranges,
# once. top_p's lower end is open (0 keeps no token); every value finite (NaN fails every comparison).
REQUEST_RANGES = {"temperature": (0.0, math.inf),
                  "top_p": (0.0, 1.0),
                  "seed": (-2**63, 2**63 - 1)}  # torch.Generator takes -2**63..2**64-1, so the drafter's seed + 1 fits too


def in_range(field: str, value) -> bool:
    low, high = REQUEST_RANGES[field]
    return math.isfinite(value) and low <= value <= high and not (field == "top_p" and value == low)


def split_cuts(split) -> list[int] | str | None:
    """model.split as layer cuts (the first layer of ranks 1..N-1), read once at parse: a number is the one cut
    of two ranks ([N]), a list is every cut; None (even) and "auto" are settled by launch.plan. Anything else
    is one line."""
    if split is None or split == "auto":
        return split
    if isinstance(split, int) and not isinstance(split, bool):
        return [split]
    if isinstance(split, list) or OmegaConf.is_list(split):
        return list(split)
    raise ConfigError(f"model.split={split!r}: give a layer number (rank 1's first layer), a list of them (the first "
                      f"layer of ranks 1..N-1), or auto")


# (key, least, most) of every numeric key: a value out of range, NaN or infinite is one line at start, before
# anything is loaded or timed. The upper bounds are far beyond any real setting: past them it is a typo.
MAX_TOKENS = 2**24  # a KV cache, a prompt chunk, an answer: 16M tokens
BOUNDS = [("model.max_len", 1, MAX_TOKENS), ("draft.max_len", 1, MAX_TOKENS), ("model.prefill_chunk", 1, MAX_TOKENS),
          ("spec.k", 0, 1024), ("draft.top_k", 1, 2**20), ("draft.ngram_max", 1, 1024), ("draft.ngram_min", 1, 1024),
          ("draft.lookup_min", 1, 1024), ("draft.lookup_k", 1, 1024),
          ("gen.max_new_tokens", 1, MAX_TOKENS), ("serve.max_concurrent", 1, 64), ("serve.max_queue", 0, 2**20),
          ("serve.max_body_bytes", 1, 2**31), ("serve.retry_window_s", 0, 3600),
          ("transport.timeout_s", 0.001, 7 * 86400), ("transport.start_timeout_s", 0.001, 7 * 86400),
          ("transport.reconnect_s", 0, 7 * 86400),
          ("transport.emulate_delay_ms", 0, 3600_000), ("transport.emulate_mbps", 0, 10**9),
          ("cache.min_tokens", 1, MAX_TOKENS), ("cache.block_tokens", 1, MAX_TOKENS), ("workload.streams", 1, 64),
          ("workload.prompt_tokens", 1, MAX_TOKENS), ("workload.answer_tokens", 1, MAX_TOKENS)]


def _bounded(cfg: TandemConfig, key: str, low, high) -> None:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    if value is None:  # an optional key left to the launch (serve.max_concurrent: as many as fit)
        return
    if not low <= value <= high:  # NaN fails every comparison
        raise ConfigError(f"{key}={value} must be between {low} and {high}")


def _check_room(cfg: TandemConfig) -> None:
    """The capacity rule (launch.build.check_capacity) for the shortest prompt, at start: before the split is
    timed or a weight is read. One-shot runs need gen.max_new_tokens of room; a server at least one token
    (each request's max_tokens is cut to the room its prompt leaves)."""
    room, setting = output_room(cfg, 1)
    need = 1 if cfg.serve.port is not None else cfg.gen.max_new_tokens
    if room < need:
        raise CapacityError(f"a 1-token prompt + {'one new token' if need == 1 else f'gen.max_new_tokens ({need})'} + spec.k "
                          f"({cfg.spec.k}) exceed {setting}={room + 1 + cfg.spec.k}; raise {setting}, or lower spec.k"
                          f"{'' if need == 1 else ' or gen.max_new_tokens'}")


def output_room(cfg: TandemConfig, prompt_tokens: int) -> tuple[int, str]:
    """(new tokens that fit every cache after this prompt, the setting that bounds it). Every cache must
    hold prompt + output + the drafts of the last round."""
    caches = [(cfg.model.max_len, "model.max_len")]
    if cfg.draft.kind in ("model", "hybrid") and cfg.spec.k > 0:
        caches.append((cfg.draft.max_len, "draft.max_len"))
    capacity, setting = min(caches, key=lambda c: c[0])  # on a tie, the target's setting
    return capacity - prompt_tokens - cfg.spec.k, setting


def _check_sizes(max_memory, key: str = "model.max_memory") -> None:
    from model_parallel.memory import parse_size
    values = list(max_memory) if OmegaConf.is_list(max_memory) or isinstance(max_memory, list) else [max_memory]
    for i, value in enumerate(values):
        if value is not None:  # None: that rank's free memory
            try:
                parse_size(value, key + (f"[{i}]" if len(values) > 1 else ""))
            except ValueError as e:
                raise ConfigError(str(e)) from None


USAGE = """usage: torchrun --nproc_per_node=2 train_free_infer.py [config=FILE.yaml] [key=value ...]

Settings are key=value (omegaconf dotlist), over the defaults and an optional YAML file (config=PATH,
e.g. configs/smollm2.yaml). Every key, with its default and meaning (from launch/config.py):"""


def help_text() -> str:
    """Every key as `key=default` and its meaning: the dataclasses above and their comments, read here
    so that the one place a key is defined is also the one place it is explained."""
    defaults = OmegaConf.to_container(OmegaConf.structured(TandemConfig), resolve=True)
    lines = [USAGE]
    for key, meaning in key_meanings(TandemConfig):
        value = defaults
        for part in key.split("."):
            value = value[part]
        setting = f"  {key}={_shown(value)}"
        lines.append(f"{setting:<34} {meaning}" if len(setting) < 34 else f"{setting}\n{'':<34} {meaning}")
    return "\n".join(lines)


def _shown(value) -> str:
    """A default as it is typed on the command line."""
    if isinstance(value, str):
        return _expand(value) if value else '""'
    return json.dumps(value)  # null, true, 4, [] ...


def key_meanings(node_cls, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, the comment on its line) for every leaf field, sections in order."""
    comments = _field_comments(node_cls)
    out = []
    for f in dataclasses.fields(node_cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out += key_meanings(f.default_factory, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, comments.get(f.name, "")))
    return out


def _field_comments(node_cls) -> dict[str, str]:
    source = inspect.getsource(node_cls)
    lines = {tok.start[0]: tok.string.lstrip("# ") for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT}
    fields = [node for node in ast.parse(source).body[0].body if isinstance(node, ast.AnnAssign)]
    return {node.target.id: lines[node.end_lineno] for node in fields if node.end_lineno in lines}


def config_from_argv(argv: list[str] | None = None, read_stdin: bool | None = None) -> TandemConfig:
    """The command line's config (a ConfigError if it is wrong); `--help` / `-h` prints the keys and exits 0."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        sys.exit(0)
    return load_config(argv, read_stdin=read_stdin)
