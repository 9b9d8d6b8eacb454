"""Bad files and bad weights at load time: a ModelLoadError with one line naming the file (and the
tensor), never another exception type, never a model that loads and answers one token over and over.

Each test corrupts a copy of the tiny qwen2 model (tests/conftest.py: tiny_qwen) in tmp_path."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_parallel.loader import ModelLoadError, load_config, load_stage
from tests.support.tiny_models import run_pair

WEIGHT = "model.layers.1.mlp.up_proj.weight"  # any tensor rank 0 reads: layers [0, 2) of 4


def copy_of(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "model"))


def set_one_value(folder: Path, tensor: str, value: float, dtype: torch.dtype | None = None) -> Path:
    """Rewrite model.safetensors with `value` at one position of `tensor` (and all tensors in `dtype`)."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors[tensor][3, 5] = value
    if dtype is not None:
        tensors = {name: t.to(dtype) for name, t in tensors.items()}
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def edit_config(folder: Path, **fields) -> Path:
    """config.json with `fields` set; a field set to ... is removed."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update({k: v for k, v in fields.items() if v is not ...})
    for k in [k for k, v in fields.items() if v is ...]:
        del config[k]
    path.write_text(json.dumps(config))
    return path


def load_error(folder: Path, *needles: str, dtype: str = "float32") -> str:
    """load_stage's ModelLoadError for rank 0's share: one line that holds every needle."""
    with pytest.raises(ModelLoadError) as caught:
        load_stage(folder, 0, 2, embed=True, head=False, dtype=dtype)
    message = str(caught.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


# --- non-finite weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_non_finite_weight_is_refused(tiny_qwen, tmp_path, value, kind):
    file = set_one_value(copy_of(tiny_qwen, tmp_path), WEIGHT, value)
    load_error(file.parent, str(file), WEIGHT, kind, "corrupt")


def test_non_finite_weight_stored_in_bf16_is_refused(tiny_qwen, tmp_path):
    file = set_one_value(copy_of(tiny_qwen, tmp_path), "model.embed_tokens.weight", float("nan"), torch.bfloat16)
    load_error(file.parent, str(file), "model.embed_tokens.weight", "NaN", dtype="bfloat16")


def test_cast_that_overflows_names_the_dtype_not_corruption(tiny_qwen, tmp_path):
    file = set_one_value(copy_of(tiny_qwen, tmp_path), WEIGHT, 1e6)  # finite in float32, Inf in float16
    message = load_error(file.parent, str(file), WEIGHT, "float16", dtype="float16")
    assert "corrupt" not in message


def test_non_finite_weight_of_the_other_stage_is_not_read(tiny_qwen, tmp_path):
    """Only the stage's own tensors are read (and checked): rank 0 loads despite a NaN in layer 3."""
    folder = set_one_value(copy_of(tiny_qwen, tmp_path), "model.layers.3.mlp.up_proj.weight", float("nan")).parent
    load_stage(folder, 0, 2, embed=True, head=False)


# --- damaged safetensors files ----------------------------------------------------------------------

def cut(file: Path, keep: int) -> None:
    file.write_bytes(file.read_bytes()[:keep])


def header_length(file: Path) -> int:
    return int.from_bytes(file.read_bytes()[:8], "little")


@pytest.mark.parametrize("damage", ["header cut", "data cut", "empty", "garbage", "header not JSON"])
def test_damaged_safetensors_file(tiny_qwen, tmp_path, damage):
    folder = copy_of(tiny_qwen, tmp_path)
    file = folder / "model.safetensors"
    size, header = file.stat().st_size, header_length(file)
    if damage == "header cut":
        cut(file, 8 + header // 2)
    elif damage == "data cut":
        cut(file, size - size // 3)
    elif damage == "empty":
        cut(file, 0)
    elif damage == "garbage":
        file.write_bytes(b"\x00not a safetensors file" * 500)
    else:
        data = file.read_bytes()
        file.write_bytes(data[:8] + b"!" * header + data[8 + header:])
    load_error(folder, str(file), "truncated or damaged")


def test_garbage_in_the_data_reads_as_non_finite(tiny_qwen, tmp_path):
    """Bytes 0xff in every weight: the header is intact, every bf16/fp32 value is a NaN."""
    folder = copy_of(tiny_qwen, tmp_path)
    file = folder / "model.safetensors"
    data, start = file.read_bytes(), 8 + header_length(file)
    file.write_bytes(data[:start] + b"\xff" * (len(data) - start))
    load_error(folder, str(file), "NaN")


# --- sharded checkpoints: the index and the files it lists ------------------------------------------

def shard(folder: Path) -> list[str]:
    """Split model.safetensors into two shards and an index, like save_pretrained does for big models."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, folder / file, metadata={"format": "pt"})
    weight_map = {n: file for file, part in files.items() for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return list(files)


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_copy_loads_the_same_tensors(tiny_qwen, tmp_path, rank):
    """Each rank's share is spread over both shards (they alternate by name); loaded through the index it is the
    same tensors, name for name and bit for bit, as loaded from the single file."""
    folder = copy_of(tiny_qwen, tmp_path)
    shard(folder)
    first, last = (0, 2) if rank == 0 else (2, 4)
    sharded = dict(load_stage(folder, first, last, embed=rank == 0, head=rank == 1).named_parameters())
    single = dict(load_stage(tiny_qwen, first, last, embed=rank == 0, head=rank == 1).named_parameters())
    assert sorted(sharded) == sorted(single) and len(single) > 10
    for name, tensor in single.items():
        assert torch.equal(sharded[name], tensor), name


def test_file_listed_in_the_index_is_missing(tiny_qwen, tmp_path):
    folder = copy_of(tiny_qwen, tmp_path)
    missing = folder / shard(folder)[1]
    missing.unlink()
    load_error(folder, str(missing), "missing", "model.safetensors.index.json")


def test_truncated_shard(tiny_qwen, tmp_path):
    folder = copy_of(tiny_qwen, tmp_path)
    file = folder / shard(folder)[0]
    cut(file, file.stat().st_size // 2)
    load_error(folder, str(file), "truncated or damaged")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "{}", '{"weight_map": {"model.norm.weight": 5}}'])
def test_invalid_index(tiny_qwen, tmp_path, text):
    folder = copy_of(tiny_qwen, tmp_path)
    shard(folder)
    (folder / "model.safetensors.index.json").write_text(text)
    load_error(folder, str(folder / "model.safetensors.index.json"))


# --- config.json --------------------------------------------------------------------------------------

def assert_config_refused(folder: Path, *needles: str) -> None:
    """Both entry points refuse it: load_config (the Plan, the drafter) and load_stage."""
    path = str(folder / "config.json")
    with pytest.raises(ModelLoadError) as caught:
        load_config(folder)
    assert "\n" not in str(caught.value) and path in str(caught.value), str(caught.value)
    for needle in needles:
        assert needle in str(caught.value), (needle, str(caught.value))
    load_error(folder, path, *needles)


@pytest.mark.parametrize("content, needle", [(b"{not json", "not valid JSON"), (b"\xff\xfe\x00\x01garbage", "not valid JSON"),
                                             (b"", "not valid JSON"), (b"[1, 2]", "not an object")])
def test_config_not_json(tiny_qwen, tmp_path, content, needle):
    folder = copy_of(tiny_qwen, tmp_path)
    (folder / "config.json").write_bytes(content)
    assert_config_refused(folder, needle)


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "model_type", "vocab_size"])
def test_config_missing_required_field(tiny_qwen, tmp_path, field):
    folder = copy_of(tiny_qwen, tmp_path)
    edit_config(folder, **{field: ...})
    assert_config_refused(folder, field)


@pytest.mark.parametrize("fields, needle", [({"num_hidden_layers": "four"}, "num_hidden_layers"),
                                            ({"num_attention_heads": None}, "num_attention_heads"),
                                            ({"intermediate_size": "big"}, "intermediate_size"),
                                            ({"layer_types": ["nonsense"]}, "layer_types"),
                                            ({"quantization_config": "bad"}, "quantization_config")])
def test_config_invalid_field(tiny_qwen, tmp_path, fields, needle):
    folder = copy_of(tiny_qwen, tmp_path)
    edit_config(folder, **fields)
    assert_config_refused(folder, needle)


def test_config_field_transformers_cannot_build_from(tiny_qwen, tmp_path):
    """rope_scaling of an unknown type passes AutoConfig and fails building the model (KeyError)."""
    folder = copy_of(tiny_qwen, tmp_path)
    edit_config(folder, rope_scaling={"type": "nonsense"})
    load_error(folder, str(folder / "config.json"), "nonsense")


# --- end to end: the entry's ranks, in process -----------------------------------------------------

def test_entry_refuses_a_nan_checkpoint(tiny_qwen, tmp_path):
    """Before: exit 0, a normal summary and one token repeated. Now the rank's ModelLoadError."""
    file = set_one_value(copy_of(tiny_qwen, tmp_path), "model.embed_tokens.weight", float("nan"))
    with pytest.raises(ModelLoadError, match="NaN"):
        run_pair(f"model.target={file.parent}", "model.dtype=float32", "draft.kind=none", "prompt_ids=[1,2,3]",
                 "gen.max_new_tokens=4")
