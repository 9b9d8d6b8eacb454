"""Tiny random decoders built offline, saved with save_pretrained and loaded back through the real
loader; a runner for `torchrun --nproc_per_node=2 train_free_infer.py`; the single-process reference;
in-process runners of every rank as threads (run_pair, run_ranks for N)."""
from __future__ import annotations

import functools
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
VOCAB = 320


def tiny_config(family: str, layers: int = 4, hidden: int = 64, seed_vocab: int = VOCAB, **extra):
    common = dict(vocab_size=seed_vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None, initializer_range=0.3,
                  bos_token_id=None, pad_token_id=None)
    common.update(extra)
    if family == "qwen2":  # GQA, untied head (like Qwen2.5-Coder)
        return Qwen2ForCausalLM, Qwen2Config(tie_word_embeddings=False, **common)
    if family == "llama":  # tied embeddings (like SmolLM2)
        return LlamaForCausalLM, LlamaConfig(tie_word_embeddings=True, **common)
    raise ValueError(family)


def randomize_norms(model) -> None:
    """Every norm weight moved off its neutral value (1.0, or 0.0 where a family stores 1 + w) by a random amount per
    channel: a loader that skips a norm weight, or puts one in another layer, then changes the output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.empty_like(param).uniform_(-0.5, 0.5))


def save_tiny(folder: Path, family: str, seed: int = 0, eos: int | None = None, head_scale: float | None = None,
              **extra) -> Path:
    """`head_scale`: what the head (or the tied embeddings) is multiplied by; the default makes greedy choices decisive,
    a sampling test wants 1.0 (flatter distributions, so every token path is drawn often)."""
    torch.manual_seed(seed)
    cls, config = tiny_config(family, **extra)
    model = cls(config).eval()
    randomize_norms(model)
    # Random weights of this size give flat logits; scaling the head makes greedy choices decisive
    # (fewer near-ties), so fp32 parity tests test the code, not rounding.
    with torch.no_grad():
        if head_scale is None:
            head_scale = 4.0 if not config.tie_word_embeddings else 2.0
        model.get_output_embeddings().weight.mul_(head_scale)
    model.generation_config = GenerationConfig(eos_token_id=eos, do_sample=False)
    model.save_pretrained(folder)
    return folder


def load_reference(folder: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def reference_greedy(folder: Path, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Single-process transformers generate(do_sample=False) of the same model in fp32. Memoized per
    (folder, prompt, max_new_tokens, eos): test folders are written once and never changed."""
    return list(_reference_greedy(str(folder), tuple(prompt), max_new_tokens, eos))


@functools.lru_cache(maxsize=None)
def _reference_greedy(folder: str, prompt: tuple[int, ...], max_new_tokens: int, eos: int | None) -> tuple[int, ...]:
    folder, prompt = Path(folder), list(prompt)
    model = load_reference(folder)
    ids = torch.tensor([prompt])  # explicit mask: generate would otherwise mask tokens equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    return tuple(tokens)


def kill_launch(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun started with start_new_session=True and its ranks. torchrun starts each rank in a session
    of its own (torch's SubprocessHandler), so killing torchrun's group alone leaves the ranks running, orphaned
    (a served one forever); they are found as torchrun's children first."""
    if proc.poll() is not None:
        return
    ranks = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _parent(d) == proc.pid]
    for pid in ranks:
        try:
            os.killpg(pid, 9)  # the rank's own session (and anything it started)
        except (ProcessLookupError, PermissionError):
            pass
    os.killpg(proc.pid, 9)
    proc.wait(30)


def _parent(proc_dir: Path) -> int | None:
    try:  # /proc/PID/stat: "pid (name) state ppid ...": the name may hold spaces, so split after its ')'
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a port the kernel handed out (bind to 0) may be
    handed out again, to gloo or torchrun's store, between this check and the bind under test."""
    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def run_tandem(tmp: Path, *overrides: str, timeout: float = 240, expect_ok: bool = True, env: dict | None = None,
               nproc: int = 2):
    """Run the real entry under torchrun (`nproc` ranks; `env`: extra environment); returns (output json or
    None, completed process)."""
    out = tmp / f"out-{free_port()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(REPO / "train_free_infer.py"), f"output.json={out}",
           "output.stream=false", "chat=false", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if expect_ok:
        assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        return json.loads(out.read_text()), proc
    return (json.loads(out.read_text()) if out.exists() else None), proc


def ids_arg(ids: list[int]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


def save_tiny_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer trained offline on a few sentences (with multi-byte characters),
    saved beside a tiny model so the text paths (streaming, stop strings, chat=false prompts) run."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    corpus = ["def reverse(s): return s[::-1]", "héllo wörld, naïve café", "print('ok')\n\n", "日本語のテキスト"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=vocab_size - 1, min_frequency=1, special_tokens=["<eos>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    tok.save_pretrained(folder)


def emulated_local_pair(cfg, timeout_s: float):
    """local_pair with the config's EMULATED delay and bandwidth, as open_channel applies them."""
    from netbridge.channel import local_pair
    t = cfg.transport
    return local_pair(timeout_s, emulate_delay_ms=t.emulate_delay_ms, emulate_mbps=t.emulate_mbps)


def run_pair(*overrides: str, timeout_s: float = 60.0, rank1: tuple[str, ...] = ()) -> dict:
    """Both ranks (launch.ranks, as train_free_infer runs them) in this process, as two threads over an in-process channel pair
    (netbridge.channel.local_pair): the whole entry path but torchrun, in seconds. Each rank has its own
    config (as on two hosts); `rank1`: overrides for rank 1 alone. Returns rank 0's result (the output
    JSON); an exception on either rank is raised here."""
    import train_free_infer as entry
    from launch import ranks as lives
    from launch.config import load_config

    cfgs = [load_config(["output.stream=false", "chat=false", *overrides, *(rank1 if r else ())]) for r in (0, 1)]
    channels = emulated_local_pair(cfgs[0], timeout_s)
    results, errors = {}, {}

    def rank(r: int) -> None:
        try:
            results[r] = (entry.rank_zero if r == 0 else lives.last_rank)(cfgs[r], channels[r])
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors[r] = e
            channels[r].close()  # the other rank fails at once instead of waiting out its timeout
    run_both(rank, timeout_s * 4)
    if errors:  # the root cause: the other rank then only lost its peer; rank 0's first when both have their own
        from netbridge.channel import PeerError
        raise next((errors[r] for r in sorted(errors) if not isinstance(errors[r], PeerError)), errors.get(0) or errors.get(1))
    return results[0]


def run_ranks(ranks: int, *overrides: str, timeout_s: float = 60.0, only: dict[int, tuple[str, ...]] | None = None) -> dict:
    """run_pair for N ranks: every rank (launch.ranks) in this process, as N threads on a ring of
    in-process channels (netbridge.channel.local_ring: 0 -> 1 -> ... -> N-1 -> 0). `only`: overrides
    for one rank alone ({rank: (...)}). Returns rank 0's result; the root cause of a failure on any
    rank is raised here."""
    import train_free_infer as entry
    from launch import ranks as lives
    from launch.config import load_config
    from netbridge.channel import PeerError, local_ring

    cfgs = [load_config(["output.stream=false", "chat=false", *overrides, *(only or {}).get(r, ())]) for r in range(ranks)]
    t = cfgs[0].transport
    links = local_ring(ranks, timeout_s, emulate_delay_ms=t.emulate_delay_ms, emulate_mbps=t.emulate_mbps)
    results, errors = {}, {}

    def rank(r: int) -> None:
        prev, next = links[r]
        try:
            if r == 0:
                results[r] = entry.rank_zero(cfgs[r], next, replies=prev, ranks=ranks)
            elif r == ranks - 1:
                lives.last_rank(cfgs[r], prev, reply_to=next, ranks=ranks)
            else:
                lives.middle_rank(cfgs[r], prev, next, r, ranks)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors[r] = e
            prev.close()  # the ranks waiting on this one fail at once instead of waiting out their timeout
            next.close()
    run_both(rank, timeout_s * 4, ranks)
    if errors:
        raise next(iter(e for e in errors.values() if not isinstance(e, PeerError)), errors.get(0) or errors[min(errors)])
    return results[0]


def with_eos(folder: Path, dest: Path, eos: int) -> Path:
    """A copy of a model folder whose generation_config names `eos` as its end-of-sequence token."""
    import shutil
    shutil.copytree(folder, dest)
    gen = json.loads((dest / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (dest / "generation_config.json").write_text(json.dumps(gen))
    return dest


def run_entry_pair(monkeypatch, *argv: str, timeout_s: float = 30.0, ranks: int = 2) -> dict[int, object]:
    """train_free_infer.main(argv) on both ranks (or `ranks` of them) in this process, as threads over
    local_pair (local_ring): the entry's own error handling (report, telling the peer, exit status)
    without torchrun. torchrun's rank lookup and the gloo channels are replaced for the threads (the
    entry installs signal handlers only on the main thread); everything else is the real path.
    Returns each rank's outcome: SystemExit's code, None for a clean return, or the exception raised."""
    import threading

    import train_free_infer
    from netbridge.channel import local_ring

    links = local_ring(ranks, timeout_s)
    local = threading.local()
    monkeypatch.setattr(train_free_infer, "torchrun_rank", lambda: (local.rank, ranks))
    monkeypatch.setattr(train_free_infer, "open_links", lambda cfg, rank, ranks: links[rank])
    monkeypatch.setattr(train_free_infer, "close_channel", lambda *links: [link.close() for link in set(links)])
    outcome: dict[int, object] = {}

    def rank(r: int) -> None:
        local.rank = r
        try:
            train_free_infer.main(["output.stream=false", "chat=false", *argv])
            outcome[r] = None
        except SystemExit as e:
            outcome[r] = e.code
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome[r] = e
    run_both(rank, timeout_s * 2, ranks)
    return outcome


def run_both(rank, timeout_s: float, ranks: int = 2) -> None:
    """rank(0) and rank(1) (... rank(N-1)) in threads; all must end within timeout_s."""
    import threading
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
