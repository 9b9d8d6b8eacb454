"""model_parallel/: the two-rank layer split is token-identical to single-process transformers (fp32,
both architectures, every split point, EOS, seeded sampling); each rank materializes only its share;
NF4 stage slices (bitsandbytes): the bytes transformers makes, token-for-token parity with transformers
+ the same BitsAndBytesConfig, the pre-quantized checkpoint path, and each rank's peak RSS while
loading against its fp32 slice.

Both ranks run as two threads over an in-process channel (tests.support.tiny_models.run_pair); the same under
torchrun is tests/e2e/test_e2e.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from bitsandbytes.nn import Linear4bit
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config

from launch.build import build_stage
from launch.plan import plan_here
from launch.config import load_config as load_tandem_config
from model_parallel.loader import ModelLoadError, checkpoint_index, load_config, load_stage, stage_tensor_names
from model_parallel.quant import NF4Settings
from tests.support.tiny_models import REPO, ids_arg, load_reference, reference_greedy, run_pair, with_eos

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5]
LAYERS = 4


# --- the split: token-identical to transformers generate -----------------------------------------

@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("split", [1, LAYERS // 2, LAYERS - 1])
def test_split_matches_generate_to_max_new_tokens(family, split, tiny_qwen, tiny_llama):
    folder = tiny_qwen if family == "qwen2" else tiny_llama
    expected = reference_greedy(folder, PROMPT, 24)
    out = run_pair(f"model.target={folder}", "model.dtype=float32", f"model.split={split}",
                   "draft.kind=none", f"prompt_ids={ids_arg(PROMPT)}", "gen.max_new_tokens=24")
    assert out["token_ids"] == expected
    assert out["stats"]["stop_reason"] == "max_new_tokens" and len(out["token_ids"]) == 24


# --- model.split given on one rank, auto on the other (placement itself: tests/model_parallel/test_placement.py) ----

def test_rank1_auto_takes_rank0s_split_and_an_explicit_one_must_agree(tiny_qwen):
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=none", f"prompt_ids={ids_arg(PROMPT)}",
            "gen.max_new_tokens=8"]
    out = run_pair(*args, "model.split=1", rank1=("model.split=auto",))
    assert out["token_ids"] == reference_greedy(tiny_qwen, PROMPT, 8)
    with pytest.raises(Exception, match=r"the ranks disagree on split \(rank 0: 1, rank 1: 3\)"):
        run_pair(*args, "model.split=1", rank1=("model.split=3",))
    with pytest.raises(Exception, match=r"model.split='half': give a layer number .* or auto"):
        run_pair(*args, "model.split=half")


def first_new_token_at(tokens: list[int], index: int) -> int:
    """A token that first occurs at position >= index, so EOS falls mid-generation."""
    for i in range(index, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i]
    raise AssertionError("no fresh token to use as EOS")


@pytest.mark.parametrize("family,split", [("qwen2", 2), ("llama", 1), ("llama", 3)])
def test_split_stops_at_eos(family, split, tiny_qwen, tiny_llama, tmp_path):
    folder = tiny_qwen if family == "qwen2" else tiny_llama
    free_run = reference_greedy(folder, PROMPT, 30)
    eos = first_new_token_at(free_run, 6)
    folder = with_eos(folder, tmp_path / "with-eos", eos)
    expected = reference_greedy(folder, PROMPT, 30, eos=eos)
    assert expected[-1] == eos and len(expected) < 30
    out = run_pair(f"model.target={folder}", "model.dtype=float32", f"model.split={split}",
                   "draft.kind=none", f"prompt_ids={ids_arg(PROMPT)}", "gen.max_new_tokens=30")
    assert out["token_ids"] == expected
    assert out["stats"]["stop_reason"] == "eos"


def test_seeded_sampling_is_reproducible(tiny_qwen):
    args = [f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=none", f"prompt_ids={ids_arg(PROMPT)}",
            "gen.max_new_tokens=20", "gen.temperature=1.5"]
    first = run_pair(*args, "gen.seed=3")
    again = run_pair(*args, "gen.seed=3")
    other = run_pair(*args, "gen.seed=4")
    assert first["token_ids"] == again["token_ids"]
    assert first["token_ids"] != other["token_ids"]  # the seed is really used (20 draws at T=1.5)
    assert first["token_ids"] != reference_greedy(tiny_qwen, PROMPT, 20)


class HeldStorages(TorchDispatchMode):
    """Every storage a torch op returns off the meta device while the mode is on, by address: what a process
    allocates (or touches) in real memory, counted once however many views it has. Storages that lie on a
    safetensors file's mapping (a checkpoint tensor as read, before the loader copies it) are counted
    apart, in `mapped`: the loader opens per tensor, so each is unmapped once copied."""

    def __init__(self):
        super().__init__()
        self.nbytes: dict[int, int] = {}
        self.mapped: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                (self.mapped if ptr in self.mapped or on_checkpoint_mapping(ptr) else self.nbytes)[ptr] = storage.nbytes()
        return out

    def clear(self):
        self.nbytes.clear()
        self.mapped.clear()


def on_checkpoint_mapping(address: int) -> bool:
    """Whether `address` lies in a mapping of a .safetensors file (this process's /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return len(fields) > 5 and fields[5].endswith(".safetensors")
    return False


def share_of(folder, rank: int, split: int, num_layers: int) -> set[str]:
    """The checkpoint tensors a rank needs, from the definition: rank 0 the embeddings and layers [0, split),
    rank 1 layers [split, L), the final norm and the head (the embedding matrix when the head is tied to it)."""
    with safe_open(folder / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    layers = range(0, split) if rank == 0 else range(split, num_layers)
    share = {n for n in stored if n.startswith("model.layers.") and int(n.split(".")[2]) in layers}
    if rank == 0:
        return share | {"model.embed_tokens.weight"}
    return share | {"model.norm.weight", "lm_head.weight" if "lm_head.weight" in stored else "model.embed_tokens.weight"}


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_rank_materializes_only_its_share_not_even_briefly(family, tiny_qwen, tiny_llama, monkeypatch):
    """While a rank's stage loads: the checkpoint tensors it reads are exactly its share, and the memory torch ops
    give it (the model shell, casts, checks) stays within that share's size: the other rank's weights are never
    read, and the whole model is never built in real memory, not even for a moment."""
    import launch.build
    import model_parallel.loader as loader
    folder = tiny_qwen if family == "qwen2" else tiny_llama
    whole = sum(p.numel() * p.element_size() for p in load_reference(folder).parameters())
    cfg = load_tandem_config([f"model.target={folder}", "model.dtype=float32", "prompt_ids=[1]", "model.split=null"])
    num_layers = load_config(folder).num_hidden_layers
    read = []
    read_tensor = loader.read_tensor
    monkeypatch.setattr(loader, "read_tensor", lambda f, file, ckpt: read.append(ckpt) or read_tensor(f, file, ckpt))
    held = HeldStorages()

    def watched_load_stage(*args, **kwargs):  # the loading only: the KV cache build_stage allocates next is not weights
        with held:
            return loader.load_stage(*args, **kwargs)
    monkeypatch.setattr(launch.build, "load_stage", watched_load_stage)
    for rank in (0, 1):  # half the layers each
        read.clear()
        held.clear()
        stage = build_stage(plan_here(cfg, rank))
        mine = sum(p.numel() * p.element_size() for p in stage.parameters())
        allocated, mapped = sum(held.nbytes.values()), sum(held.mapped.values())
        print(f"{family} rank {rank}: {mine} of {whole} parameter bytes ({mine / whole:.0%}); torch ops held "
              f"{allocated} bytes while loading, and read {mapped} bytes off the checkpoint's mapping in "
              f"{len(read)} tensors")
        assert sorted(read) == sorted(share_of(folder, rank, num_layers // 2, num_layers))
        assert allocated <= mine * 1.05 + 64 * 1024, (allocated, mine)  # + the rotary tables and small scalars
        assert mapped <= mine * 1.05, (mapped, mine)
        assert mine <= 0.6 * whole
        assert not any(p.is_meta for p in stage.parameters())


def test_loaded_weights_are_in_memory_of_their_own(tiny_qwen):
    """A loaded stage's weights are copies, not views of the checkpoint's mapping (which run slower on
    CPU, and would keep the file's pages mapped): no parameter lies on a .safetensors mapping."""
    cfg = load_tandem_config([f"model.target={tiny_qwen}", "model.dtype=float32", "prompt_ids=[1]", "model.split=null"])
    stage = build_stage(plan_here(cfg, 0))
    on_mapping = [name for name, p in stage.named_parameters() if on_checkpoint_mapping(p.untyped_storage().data_ptr())]
    assert not on_mapping, on_mapping


# --- NF4 ----------------------------------------------------------------------------------------

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def bnb_config(compute: torch.dtype, double: bool = True, lm_head: bool = False) -> BitsAndBytesConfig:
    """What `model.quant=nf4` means, said the transformers way."""
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                              bnb_4bit_use_double_quant=double, llm_int8_skip_modules=[] if lm_head else ["lm_head"])


def load_bnb(folder, dtype=torch.float32, quantization_config=None):
    extra = {"quantization_config": quantization_config} if quantization_config is not None else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu", attn_implementation="sdpa",
                                                **extra).eval()


def bnb_greedy(folder, prompt: list[int], max_new_tokens: int, dtype=torch.float32, quantization_config=None) -> list[int]:
    """Single-process transformers generate(do_sample=False); a pre-quantized folder needs no config."""
    model = load_bnb(folder, dtype, quantization_config)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def nf4_overrides(compute: torch.dtype, double: bool = True, lm_head: bool = False) -> list[str]:
    return ["model.dtype=float32", "model.quant=nf4", f"model.quant_compute_dtype={DTYPE_NAMES[compute]}",
            f"model.quant_double={str(double).lower()}", f"model.quant_lm_head={str(lm_head).lower()}"]


@pytest.fixture(scope="module")
def prequantized_qwen(tiny_qwen, tmp_path_factory):
    """tiny_qwen quantized by transformers (NF4, double quant, fp32 compute, head kept) and saved."""
    folder = tmp_path_factory.mktemp("qwen2-nf4") / "model"
    load_bnb(tiny_qwen, quantization_config=bnb_config(torch.float32)).save_pretrained(folder)
    return folder


# --- NF4: the loader builds what transformers builds --------------------------------------

@pytest.mark.parametrize("double", [True, False])
def test_stage_holds_the_bytes_transformers_makes(tiny_qwen, double):
    settings = NF4Settings(torch.bfloat16, double_quant=double)
    ref = load_bnb(tiny_qwen, quantization_config=bnb_config(torch.bfloat16, double))
    stage = load_stage(tiny_qwen, 2, 4, embed=False, head=True, quant=settings)
    for name, module in stage.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            theirs = ref.model.layers[2:].get_submodule(name)
            assert isinstance(module, Linear4bit) and module.compute_dtype == torch.bfloat16, name
            assert torch.equal(module.weight.data, theirs.weight.data), name
            assert torch.equal(module.weight.quant_state.absmax, theirs.weight.quant_state.absmax), name
            assert module.weight.quant_state.nested == double
            assert (module.bias is None) == (theirs.bias is None), name
            if module.bias is not None:
                assert torch.equal(module.bias, theirs.bias), name
    assert type(stage.head) is torch.nn.Linear and stage.head.weight.dtype == torch.float32  # head kept by default
    assert stage.layers[0].input_layernorm.weight.dtype == torch.float32  # non-linears stay in model.dtype
    with_head = load_stage(tiny_qwen, 2, 4, embed=False, head=True, quant=NF4Settings(torch.bfloat16, lm_head=True))
    assert isinstance(with_head.head, Linear4bit)


def test_embeddings_stay_full_precision_and_tied_heads_stay_tied(tiny_llama):
    drafter = load_stage(tiny_llama, 0, 4, embed=True, head=True, quant=NF4Settings(torch.float32, lm_head=True))
    assert type(drafter.embed) is torch.nn.Embedding
    assert drafter.head.weight is drafter.embed.weight  # quantizing it would add a second copy
    rank1 = load_stage(tiny_llama, 2, 4, embed=False, head=True, quant=NF4Settings(torch.float32, lm_head=True))
    assert isinstance(rank1.head, Linear4bit)  # rank 1's head is its own copy of the embeddings


def test_prequantized_folder_needs_quant_nf4(prequantized_qwen):
    with pytest.raises(ModelLoadError, match="model.quant=nf4"):
        load_stage(prequantized_qwen, 0, 2, embed=True, head=False)


# --- end to end: the split (two ranks) vs single-process transformers ----------------------------

def test_split_nf4_matches_transformers_qwen_fp32_compute_quantized_head(tiny_qwen):
    prompt, n = [3, 17, 101, 44, 9, 250, 61], 24
    expected = bnb_greedy(tiny_qwen, prompt, n, quantization_config=bnb_config(torch.float32, lm_head=True))
    out = run_pair(f"model.target={tiny_qwen}", *nf4_overrides(torch.float32, lm_head=True),
                   "draft.kind=none", "spec.k=0", f"prompt_ids={ids_arg(prompt)}", f"gen.max_new_tokens={n}")
    assert out["token_ids"] == expected


def test_split_nf4_matches_transformers_llama_bf16_compute_speculative(tiny_llama):
    # bf16 4-bit matmuls, no double quant, tied head kept in full precision; K=3 prompt-lookup drafts
    # make rank 1 verify 4-token blocks, which must give what one-token decoding gives.
    prompt, n = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], 24
    expected = bnb_greedy(tiny_llama, prompt, n, quantization_config=bnb_config(torch.bfloat16, double=False))
    out = run_pair(f"model.target={tiny_llama}", *nf4_overrides(torch.bfloat16, double=False),
                   "draft.kind=ngram", "spec.k=3", f"prompt_ids={ids_arg(prompt)}", f"gen.max_new_tokens={n}")
    assert out["token_ids"] == expected


def test_split_loads_prequantized_checkpoint_with_nf4_drafter(tiny_qwen, tiny_qwen_draft, prequantized_qwen):
    prompt, n = [12, 200, 7, 7, 31], 24
    expected = bnb_greedy(prequantized_qwen, prompt, n)
    assert expected == bnb_greedy(tiny_qwen, prompt, n, quantization_config=bnb_config(torch.float32))
    out = run_pair(f"model.target={prequantized_qwen}", *nf4_overrides(torch.float32),
                   "draft.kind=model", f"draft.model={tiny_qwen_draft}", "draft.quant=nf4", "draft.dtype=float32",
                   "spec.k=3", f"prompt_ids={ids_arg(prompt)}", f"gen.max_new_tokens={n}")
    assert out["token_ids"] == expected


# --- memory: each rank's peak RSS while loading vs its fp32 slice --------------------------------

MEASURE = r"""
import json, os, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from model_parallel.loader import load_config, load_stage
from model_parallel.quant import NF4Settings, weight_bytes

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

def measure(folder, first, last, quant):
    config = load_config(folder)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from the current RSS
    except OSError:
        pass  # then the peak includes the imports': an overestimate
    base = status("VmRSS:")
    stage = load_stage(folder, first, last, embed=first == 0, head=last == config.num_hidden_layers, dtype="float32",
                       quant=NF4Settings(torch.float32) if quant == "nf4" else None)
    peak = status("VmHWM:") - base
    for p in stage.parameters():
        p.sum()  # fault in every page: safetensors maps the checkpoint, unread weights are not resident yet
    return {"peak": peak, "resident": status("VmRSS:") - base, "weights": weight_bytes(stage)}

# The imports (most of the time) once; each load in a fresh child forked from this state, so every
# measurement starts from the same interpreter with nothing of another load in its heap.
folder = Path(sys.argv[1])
with torch.device("meta"):
    AutoModelForCausalLM.from_config(load_config(folder))  # import the model's code before the baseline
results = []
for job in sys.argv[2:]:
    first, last, quant = job.split(":")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 1
        try:
            os.write(write, json.dumps(measure(folder, int(first), int(last), quant)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    _, status_code = os.waitpid(pid, 0)
    if status_code != 0:
        sys.exit(f"measuring {job} failed (wait status {status_code})")
    results.append(json.loads(out))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def random_qwen_fp32(tmp_path_factory):
    """A random 90M-parameter Qwen2 in fp32 (365 MB): weights dominate the interpreter's ~0.4 GB."""
    folder = tmp_path_factory.mktemp("qwen2-90m")
    config = Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=generator) * 0.02 for k, s in shapes.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    return folder


def measure_loads(folder, *jobs: tuple[int, int, str]) -> list[dict]:
    """Each (first, last, quant) stage loaded in a fresh process (forked after the imports, which
    take most of the time): {"peak", "resident", "weights"} in bytes above the interpreter."""
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(folder), *(f"{a}:{b}:{q}" for a, b, q in jobs)],
                          capture_output=True, text=True, timeout=180, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fp32_slice_bytes(folder, first: int, last: int) -> int:
    """What the stage's tensors take in fp32, from the checkpoint's header (nothing is read)."""
    config = load_config(folder)
    index = checkpoint_index(folder)
    names = stage_tensor_names(config, first, last, first == 0, last == config.num_hidden_layers, index)
    with safe_open(index[next(iter(names.values()))], "pt") as f:
        return sum(4 * torch.Size(f.get_slice(ckpt).get_shape()).numel() for ckpt in names.values())


@pytest.mark.slow  # a torchrun / multi-process case of several seconds: the default suite's 5 minutes (issue 39's wave)
def test_peak_rss_while_loading_nf4_stays_below_the_fp32_slice(random_qwen_fp32):
    mb = 2 ** 20
    full, *nf4s = measure_loads(random_qwen_fp32, (0, 12, "none"), (0, 12, "nf4"), (12, 24, "nf4"))
    assert full["resident"] > 0.9 * fp32_slice_bytes(random_qwen_fp32, 0, 12)  # the probe does see weights
    print(f"\nrank 0 in fp32, every weight read: {full['resident'] / mb:.0f} MB resident above the interpreter")
    for rank, ((first, last), nf4) in enumerate(zip([(0, 12), (12, 24)], nf4s)):
        fp32 = fp32_slice_bytes(random_qwen_fp32, first, last)
        print(f"rank {rank} (layers {first}-{last - 1}): fp32 slice {fp32 / mb:.0f} MB; nf4 peak RSS while loading "
              f"{nf4['peak'] / mb:.0f} MB, weights {nf4['weights'] / mb:.0f} MB, resident after {nf4['resident'] / mb:.0f} MB")
        assert nf4["weights"] < fp32 / 4  # really quantized
        assert nf4["peak"] < fp32
