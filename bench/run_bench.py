"""Tandem beside what a user would run instead: one run, one machine, one table.

    python bench/run_bench.py            # the default sweep (under 15 minutes on 2 CPU cores)
    python bench/run_bench.py --full     # every delay x K x drafter
    python bench/run_bench.py --split    # model.split=auto vs the even split vs a memory-forced one, overlap on/off
    python bench/run_bench.py --hybrid --prompt-set edit --max-new-tokens 256   # draft.kind=hybrid vs model
                                         # on answers that copy their prompt (--prompt-set novel: on the default prompts)

Tandem runs as the real entry under torchrun (two ranks on this host), once per configuration and
prompt, with an EMULATED one-way delay (transport.emulate_delay_ms: each message arrives that long after
it was sent, the sender not held, netbridge/delay.py; this kernel has no netem). The baselines run in this process on the same prompts and token
budget: transformers `generate` (greedy, the whole model in one process) and transformers assisted
generation with the same drafter, with every core (`--hf-threads`; Tandem's ranks: `--threads` each).
The prefill and first token are TTFT; tok/s is what follows.

Per Tandem row, over the decode rounds of all prompts pooled:
    tok/s       (tokens - 1) / (total - TTFT): decode only, as in Tandem's own stats
    e2e tok/s   tokens / total, prefill included
    tok/round   tokens committed per round (accepted drafts + the target's own token)
    accept      accepted drafts / drafted tokens
    draft, stage0, network, stage1, other   mean ms per round: drafting, rank 0's layers, the wire
                (send -> reply minus rank 1's compute: emulated delay, loopback, (de)serialization),
                rank 1's layers + head + verification, and rank 0's commit/bookkeeping between rounds
    bound       tok/round / (2 x delay + draft + stage0 + stage1): the speed if the wire cost exactly
                the emulated round trip and nothing else were spent; eff = tok/s / bound
    bound overlapped   tok/round / max(2 x delay + stage1, draft + stage0 + drafting ahead): the same
                if rank 0's work per round hid entirely behind its wait for rank 1 (or the reverse)
    x K=0       tok/s over Tandem's K=0 at the same delay
    looked up   draft.kind=hybrid: the share of decode rounds proposed by prompt lookup (no model step)
    x HF greedy e2e tok/s over transformers greedy's (end to end: assisted generation's first
                emission already holds drafting work, which a decode-only figure would hide)
    = greedy    tokens identical to transformers greedy (common prefix / tokens; bf16 near-ties can differ)
    split       rank 1's first layer, as the ranks settled it (model.split=auto: by memory, then speed)
    est ms 0/1  each rank's own estimate of its work per round (its start-up line, timed in the handshake)
    block ms 0/1  measured: rank 0's work per prepared round as its estimate counts it (with overlap the
                mean ahead_ms: K+1 drafter steps + its slice; without, drafting in line + its slice in the
                rounds of the full K), rank 1's layers + head + verification per round
Writes <out>/results.json (every run's stats and round records), <out>/table.md, and TensorBoard
logs with a two-rank trace per run under <out>/tb. `--from <out>/results.json` prints the table again.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.ports import free_port  # noqa: E402 - the repository root first

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain in three sentences why the sky is blue.",
]


def prompt_set(name: str) -> list[str]:
    """--prompt-set: novel (PROMPTS: answers that copy little) or edit (bench/edit_prompts.py: rewrite a given
    function with a small change, answers that copy most of their prompt)."""
    if name == "edit":
        from bench.edit_prompts import EDIT_PROMPTS
        return EDIT_PROMPTS
    return PROMPTS


@dataclass
class Row:
    drafter: str  # none | model | ngram | hybrid
    k: int
    delay_ms: float
    extra: list[str] = field(default_factory=list)  # more key=value overrides
    note: str = ""

    @property
    def label(self) -> str:
        name = "K=0" if self.k == 0 else f"{self.drafter} K={self.k}"
        return f"{name}{' ' + self.note if self.note else ''}"

    @property
    def slug(self) -> str:
        return f"{self.drafter}-k{self.k}-d{self.delay_ms:g}{'-' + self.note.replace(' ', '-') if self.note else ''}"


# rank 1 may hold 1.5 GiB: the head (445 MiB) and 12 of the 1.5B's 28 layers (91 MiB each with a 1024-token cache): split 16
FORCED_MEMORY = "model.max_memory=[16GiB,1.5GiB]"


def split_sweep() -> list[Row]:
    """model.split=auto, the even split and a memory-forced split, overlap on and off, beside K=0, at 0 and 40 ms."""
    splits = {"auto-split": ["model.split=auto"], "even-split": ["model.split=null"],
              "forced-split": ["model.split=auto", FORCED_MEMORY]}
    return [row for d in (0, 40) for row in
            [Row("none", 0, d), *(Row("model", 4, d, [f"spec.overlap={str(on).lower()}", *extra],
                                      note=f"{'overlap' if on else 'no overlap'} {name}")
                                  for on in (True, False) for name, extra in splits.items())]]


def sweep(full: bool, overlap: bool = False, split: bool = False, hybrid: bool = False) -> list[Row]:
    if split:
        return split_sweep()
    if hybrid:  # draft.kind=hybrid beside the model drafter it adds prompt lookup to, at 0 and 40 ms
        return [Row(kind, 4, d) for d in (0, 40) for kind in ("model", "hybrid")]
    if overlap:  # spec.overlap on/off beside K=0 at 0, 40 and 80 ms
        return [row for d in (0, 40, 80) for row in
                (Row("none", 0, d), Row("model", 4, d, ["spec.overlap=false"], note="no overlap"),
                 Row("model", 4, d, ["spec.overlap=true"], note="overlap"),
                 Row("model", 4, d, ["spec.overlap=true", "model.split=auto"], note="overlap auto-split"),
                 Row("model", 8, d, ["spec.k_from_costs=true", "spec.overlap=false"], note="costs no overlap"),
                 Row("model", 8, d, ["spec.k_from_costs=true", "spec.overlap=true"], note="costs overlap"),
                 Row("model", 8, d, ["spec.k_from_costs=true", "spec.overlap=true", "model.split=auto"],
                     note="costs overlap auto-split"))]
    delays, ks = ((0, 10, 40), (1, 2, 4, 8)) if full else ((0, 40), (4, 8))
    rows = []
    for d in delays:
        rows.append(Row("none", 0, d))
        rows += [Row("model", k, d) for k in ks]
        rows += [Row("ngram", k, d) for k in (ks if full else (4,))]
        if d == 0:  # the model-drafter rows run with spec.adaptive (the default); fixed K beside them
            rows += [Row("model", k, d, ["spec.adaptive=false"], note="fixed") for k in ks]
    if (ROOT / "model_parallel" / "quant.py").exists():
        rows.append(Row("model", 4, 0, ["model.quant=nf4"], note="nf4"))
    return rows


def machine(threads: int, hf_threads: int) -> dict:
    import torch
    import transformers
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.processor())
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(mem_gb, 1), "threads_per_rank": threads, "hf_threads": hf_threads,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "host": platform.node()}


# ---------------------------------------------------------------- Tandem under torchrun

def run_tandem(row: Row, prompt_index: int, ids: list[int], args, out: Path) -> dict:
    name = f"{row.slug}-p{prompt_index}"
    log_root, result = out / "tb" / name, out / "tandem" / f"{name}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(ROOT / "train_free_infer.py"), f"config={args.config}",
           f"output.json={result}", "output.stream=false", f"prompt_ids=[{','.join(map(str, ids))}]",
           f"gen.max_new_tokens={args.max_new_tokens}", f"spec.k={row.k}", f"draft.kind={row.drafter}",
           f"transport.emulate_delay_ms={row.delay_ms}", f"log.dir={log_root}", "model.max_len=1024",
           "draft.max_len=1024", *row.extra, *args.set]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.run_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.exists():
        tail = [line for line in proc.stderr.splitlines() if line.strip() and "tensor/s" not in line][-3:]
        return {"error": " | ".join(tail)[-400:] or f"exit {proc.returncode}", "wall_s": wall}
    summary = json.loads(next(log_root.glob("*/summary.json")).read_text())
    return {**json.loads(result.read_text()), "rounds": summary["rounds"], "clock": summary["clock"],
            "run_dir": str(next(log_root.iterdir())), "wall_s": wall, "load_avg_1min": load,
            "placement": placement(proc.stderr)}


def placement(stderr: str) -> dict:
    """Each rank's start-up line: its layers and, under model.split=auto, its estimated ms per round."""
    import re
    ranks = {}
    for m in re.finditer(r"\[rank (\d): layers (\d+)-(\d+) .*?(?:timed here\)|\(model\.split was given\))\]", stderr):
        est = re.search(r"estimated (\d+) ms per round", m.group(0))
        ranks[m.group(1)] = {"first": int(m.group(2)), "last": int(m.group(3)), "line": m.group(0)[1:-1],
                             "estimated_ms": float(est.group(1)) if est else None}
    return ranks


def pool(runs: list[dict], delay_ms: float) -> dict:
    """The decode rounds of every prompt, pooled; see the module docstring for each figure."""
    decode = [r for run in runs for r in run["rounds"][1:]]
    tokens = sum(len(run["token_ids"]) - 1 for run in runs)
    decode_s = sum(run["stats"]["total_s"] - run["stats"]["ttft_s"] for run in runs)
    n = len(decode)
    mean = lambda f: sum(map(f, decode)) / n if n else 0.0  # noqa: E731
    other = []  # rank 0's time per round outside draft, stage0 and send -> reply (the last round, which
    for run in runs:  # also sends "stop" with its emulated delay, is left out)
        rs = run["rounds"]
        other += [(nxt["start_s"] - r["start_s"]) * 1000 - (r["draft_ms"] + r["stage0_ms"] + r["round_ms"])
                  for r, nxt in zip(rs[1:-1], rs[2:])]
    drafted = sum(r["drafted"] for r in decode)
    ms = {"draft": mean(lambda r: r["draft_ms"]), "stage0": mean(lambda r: r["stage0_ms"]),
          "network": mean(lambda r: max(0.0, r["round_ms"] - r.get("ahead_ms", 0.0) - r["last_ms"])),
          "stage1": mean(lambda r: r["last_ms"]), "other": sum(other) / len(other) if other else 0.0}
    # each rank's busy fraction of the decode wall time (rank 0: drafting, its slice, drafting ahead)
    busy0 = sum(r["draft_ms"] + r["stage0_ms"] + r.get("ahead_ms", 0.0) for r in decode) / 1000 / decode_s if decode_s else 0.0
    busy1 = sum(r["last_ms"] for r in decode) / 1000 / decode_s if decode_s else 0.0
    # rank 0's work per prepared round, as its estimate counts it (a round of the full K): drafting ahead
    # (its guess + K steps, its slice) with overlap, else drafting in line (taking in the last draft of a
    # fully accepted round + K steps, its slice) in the rounds of the full K
    full_k = max((r["drafted"] for r in decode), default=0)
    blocks = [r["ahead_ms"] for r in decode if r.get("ahead_ms")] or \
        [r["draft_ms"] + r["stage0_ms"] for r in decode if full_k and r["drafted"] == full_k and not r.get("from_ahead")]
    block_ms = [sum(blocks) / len(blocks) if blocks else mean(lambda r: r["stage0_ms"]), ms["stage1"]]
    per_round = sum(r["committed"] for r in decode) / n if n else 0.0
    compute_s = (2 * delay_ms + ms["draft"] + ms["stage0"] + ms["stage1"]) / 1000
    bound = per_round / compute_s if compute_s else 0.0
    # overlapped: rank 0's work per round (in line or ahead) hides behind the wait for rank 1, or the reverse
    rank0_ms = mean(lambda r: r["draft_ms"] + r["stage0_ms"] + r.get("ahead_ms", 0.0))
    overlapped_s = max(2 * delay_ms + ms["stage1"], rank0_ms) / 1000
    bound_overlap = per_round / overlapped_s if overlapped_s else 0.0
    tok_s = tokens / decode_s if decode_s > 0 else 0.0
    e2e = sum(len(run["token_ids"]) for run in runs) / sum(run["stats"]["total_s"] for run in runs)
    return {"tokens_per_s": tok_s, "e2e_tokens_per_s": e2e, "tokens_per_round": per_round, "decode_rounds": n,
            "looked_up": sum(bool(r.get("looked_up")) for r in decode) / n if n else 0.0,
            "acceptance": sum(r["accepted"] for r in decode) / drafted if drafted else None, "ms": ms,
            "round_ms": sum(ms.values()), "bound_tokens_per_s": bound, "bound_overlap_tokens_per_s": bound_overlap, "efficiency": tok_s / bound if bound else 0.0,
            "ttft_s": sum(run["stats"]["ttft_s"] for run in runs) / len(runs), "busy": [busy0, busy1],
            "block_ms": block_ms, "rank0_ms_per_round": rank0_ms}


# ---------------------------------------------------------------- transformers baselines, in process

class Arrivals:
    """A generate() streamer that only notes when tokens arrive (its first put is the prompt)."""

    def __init__(self):
        self.times, self.counts, self._prompt = [], [], True

    def put(self, value):
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self):
        pass


def hf_generate(model, ids: list[int], max_new_tokens: int, eos: list[int], **kw) -> dict:
    import torch
    streamer = Arrivals()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
                             eos_token_id=eos, pad_token_id=eos[0], **kw)
    t_end = time.perf_counter()
    tokens = out[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    tokens = tokens if stop is None else tokens[:stop + 1]
    after_first = len(tokens) - streamer.counts[0]
    return {"token_ids": tokens, "ttft_s": streamer.times[0] - t0, "decode_s": t_end - streamer.times[0],
            "decode_tokens": after_first, "target_forwards": len(streamer.times)}


def hf_baselines(args, prompts: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from launch.distributed import reuse_freed_memory
    torch.set_num_threads(args.hf_threads)
    reuse_freed_memory()  # as Tandem's ranks do: neither side wins a prefill by malloc's page faults
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=getattr(torch, args.draft_dtype)).eval()  # Tandem's drafter
    eos = GenerationConfig.from_pretrained(args.target).eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    resolved = {**GenerationConfig()._get_default_generation_params(), **draft.generation_config.to_diff_dict()}
    settings = {k: resolved.get(k) for k in keys}  # what assisted generation uses when a user sets nothing
    methods = {"greedy": {}, "assisted": {"assistant_model": draft}}
    results = {}
    for name, kw in methods.items():
        hf_generate(target, prompts[0], 4, eos, **kw)  # warm-up, not measured
        results[name] = {"runs": [hf_generate(target, ids, args.max_new_tokens, eos, **kw) for ids in prompts]}
    results["assisted"]["settings"] = settings
    del target, draft
    gc.collect()
    return results


def pool_hf(runs: list[dict]) -> dict:
    decode_tokens, decode_s = sum(r["decode_tokens"] for r in runs), sum(r["decode_s"] for r in runs)
    tokens = sum(len(r["token_ids"]) for r in runs)
    return {"tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
            "e2e_tokens_per_s": tokens / sum(r["ttft_s"] + r["decode_s"] for r in runs),
            "tokens_per_forward": tokens / sum(r["target_forwards"] for r in runs),
            "ttft_s": sum(r["ttft_s"] for r in runs) / len(runs)}


# ---------------------------------------------------------------- the table

def agreement(token_lists: list[list[int]], reference: list[list[int]]) -> tuple[int, int]:
    same = total = 0
    for a, b in zip(token_lists, reference):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same, total = same + n, total + len(b)
    return same, total


def table(rows: list[dict], hf: dict | None) -> str:
    cols = ["run", "delay (ms, emulated)", "tok/s", "e2e tok/s", "tok/round", "accept", "draft", "stage0", "network", "stage1", "other",
            "bound tok/s", "eff", "bound overlapped", "busy 0/1", "split", "est ms 0/1", "block ms 0/1", "x K=0",
            "looked up", "x HF greedy (e2e)", "= greedy"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    ref = [r["token_ids"] for r in hf["greedy"]["runs"]] if hf else None
    hf_e2e = pool_hf(hf["greedy"]["runs"])["e2e_tokens_per_s"] if hf else None
    k0 = {r["delay_ms"]: r["pooled"]["tokens_per_s"] for r in rows if r["k"] == 0 and "pooled" in r}
    ratio = lambda a, b: f"{a / b:.2f}" if b else "-"  # noqa: E731
    for r in rows:
        if "pooled" not in r:
            lines.append(f"| {r['label']} | {r['delay_ms']:g} | failed: {r['error'][:160]} |" + " |" * (len(cols) - 3))
            continue
        p, ms = r["pooled"], r["pooled"]["ms"]
        agree = "%d/%d" % agreement([run["token_ids"] for run in r["runs"]], ref) if ref else "-"
        acc = "-" if p["acceptance"] is None else f"{p['acceptance']:.0%}"
        lines.append(f"| {r['label']} | {r['delay_ms']:g} | {p['tokens_per_s']:.2f} | {p['e2e_tokens_per_s']:.2f} "
                     f"| {p['tokens_per_round']:.2f} | {acc} "
                     f"| {ms['draft']:.0f} | {ms['stage0']:.0f} | {ms['network']:.1f} | {ms['stage1']:.0f} | {ms['other']:.1f} "
                     f"| {p['bound_tokens_per_s']:.2f} | {p['efficiency']:.0%} | {p.get('bound_overlap_tokens_per_s', 0):.2f} "
                     f"| {'/'.join(f'{b:.0%}' for b in p.get('busy', [0, 0]))} | {split_of(r)} | {estimates(r)} "
                     f"| {'/'.join(f'{b:.0f}' for b in p.get('block_ms', [0, 0]))} | {ratio(p['tokens_per_s'], k0.get(r['delay_ms']))} "
                     f"| {p['looked_up']:.0%} | {ratio(p['e2e_tokens_per_s'], hf_e2e)} | {agree} |")
    threads = f"{hf['threads']} threads" if hf and "threads" in hf else "1 thread"
    for name, label in (("greedy", f"HF generate, greedy (1 process, {threads})"),
                        ("assisted", f"HF assisted generation, same drafter ({threads})")):
        if not hf:
            break
        h = pool_hf(hf[name]["runs"])
        agree = "%d/%d" % agreement([run["token_ids"] for run in hf[name]["runs"]], ref)
        lines.append(f"| {label} | - | {h['tokens_per_s']:.2f} | {h['e2e_tokens_per_s']:.2f} | {h['tokens_per_forward']:.2f} "
                     f"| - | - | - | - | - | - | - | - | - | - | - | - | - | - | - | {ratio(h['e2e_tokens_per_s'], hf_e2e)} | {agree} |")
    return "\n".join(lines)


def overlap_table(rows: list[dict]) -> str:
    """Why overlap gains what it gains, per row with drafting: a round of spec.overlap waits for the reply
    (d + V after its send, d the emulated one-way delay, V rank 1's verify) and for rank 0's drafting
    ahead (A, after the send's own delay d: the emulation sleeps in the sender); when the bet misses
    (every draft accepted and the guess right, else) rank 0 then drafts in line (I). So per round:
        on:  d + max(A, d + V) + (1 - h) I        off:  I + 2d + V
    and overlap gains h I - max(0, A - d - V): the in-line work it saves on a hit, less what drafting
    ahead overruns the wait. Measured per row: h (prepared rounds used / decode rounds), A, I, V, and
    the decode ms per round beside the formula's."""
    lines = ["| run | delay | hit rate h | A ahead ms | I in-line ms | V stage1 ms | ms/round measured | ms/round formula |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "pooled" not in r or r["k"] == 0:
            continue
        decode = [x for run in r["runs"] for x in run["rounds"][1:]]
        d, n = r["delay_ms"], len(decode)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        ahead = [x["ahead_ms"] for x in decode if x.get("ahead_ms")]
        inline = [x["draft_ms"] + x["stage0_ms"] for x in decode if not x.get("from_ahead")]
        h = sum(1 for x in decode if x.get("from_ahead")) / n if n else 0.0
        a, i, v = mean(ahead), mean(inline), mean([x["last_ms"] for x in decode])
        formula = d + max(a, d + v) + (1 - h) * i if ahead else i + 2 * d + v
        measured = 1000 * sum(run["stats"]["total_s"] - run["stats"]["ttft_s"] for run in r["runs"]) / n if n else 0.0
        lines.append(f"| {r['label']} | {d:g} | {h:.0%} | {a:.0f} | {i:.0f} | {v:.0f} | {measured:.0f} | {formula:.0f} |")
    return "\n".join(lines)


def estimate_table(rows: list[dict]) -> str:
    """Each rank's estimate of its work per round (its start-up line under model.split=auto) beside what
    the same launch measured (one launch per prompt, each with its own estimate): rank 0 its prepared
    block (pool's block ms), rank 1 its layers + head + verification per round."""
    lines = ["| run | delay | prompt | split | rank 0 est / measured ms | rank 1 est / measured ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        for i, run in enumerate(r["runs"]):
            ranks = run.get("placement", {})
            est = [ranks.get(k, {}).get("estimated_ms") for k in ("0", "1")]
            if "rounds" not in run or None in est:
                continue
            measured = pool([run], r["delay_ms"])["block_ms"]
            cells = [f"{e:.0f} / {m:.0f} ({e / m - 1:+.0%})" for e, m in zip(est, measured)]
            lines.append(f"| {r['label']} | {r['delay_ms']:g} | {i} | {ranks['1']['first']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def split_of(row: dict) -> str:
    ranks = row["runs"][0].get("placement", {})
    return str(ranks["1"]["first"]) if "1" in ranks else "-"


def estimates(row: dict) -> str:
    ranks = row["runs"][0].get("placement", {})
    est = [ranks.get(r, {}).get("estimated_ms") for r in ("0", "1")]
    return "-" if None in est else f"{est[0]:.0f}/{est[1]:.0f}"


def header(info: dict) -> str:
    m = info["machine"]
    lines = [f"{info['date']}, `{info['command']}`: {m['cpu']} ({m['cores']} cores, {m['memory_gb']} GB, "
             f"{m['gpu'] or 'no GPU'}), Tandem {m.get('threads_per_rank', m.get('threads_per_process'))} thread(s) per rank, "
             f"transformers baselines {m.get('hf_threads', m.get('threads_per_process'))} thread(s), {info['dtype']} "
             f"(drafter {info.get('draft_dtype', info['dtype'])}), {info.get('prompt_set', 'novel')} prompts of "
             f"{' and '.join(str(p['tokens']) for p in info['prompts'])} tokens (chat template), "
             f"{info['max_new_tokens']} new tokens each, greedy.",
             "Delays are EMULATED (one-way, per message); both ranks on one host.",
             f"Wall time of the whole benchmark: {info['runtime_s'] / 60:.1f} min."]
    if info["load_avg_1min"]:
        low, high = info["load_avg_1min"]
        busy = "; other work shared the CPU, compare rows with care" if high > m["cores"] + 1 else ""
        lines.append(f"Load average at the runs' starts: {low:.1f}-{high:.1f} (the benchmark itself is about 1{busy}).")
    return " ".join(lines)


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="delays 0/10/40 ms x K 0/1/2/4/8 x drafters model/ngram")
    ap.add_argument("--overlap", action="store_true", help="spec.overlap on/off beside K=0 at 0, 40 and 80 ms")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompt-set", choices=("novel", "edit"), default="novel",
                    help="novel: the default prompts; edit: 8 'rewrite this function with a small change' prompts")
    ap.add_argument("--prompts", type=int, default=None, help="use the first N prompts of the set (default: all)")
    ap.add_argument("--hybrid", action="store_true", help="draft.kind=hybrid beside model, K=4, at 0 and 40 ms")
    ap.add_argument("--split", action="store_true", help="model.split=auto / even / memory-forced, overlap on/off, at 0 and 40 ms")
    ap.add_argument("--threads", type=int, default=1, help="threads per Tandem rank (torchrun's default with 2 ranks per host)")
    ap.add_argument("--hf-threads", type=int, default=os.cpu_count(), help="threads of the transformers baselines (default: every core)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    ap.add_argument("--out", default=None, help="default: runs/bench/<time>")
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument("--skip-hf", action="store_true", help="no transformers baselines (the table then has no x HF column)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these rows, by slug (e.g. model-k4-d0 none-k0-d40)")
    ap.add_argument("--set", nargs="*", default=[], help="more Tandem key=value overrides for every run")
    ap.add_argument("--from", dest="saved", default=None, help="print the table of a saved results.json again, measuring nothing")
    args = ap.parse_args(argv)
    if args.saved:
        saved = json.loads(Path(args.saved).read_text())
        for row in saved["rows"]:
            if "error" not in row:
                row["pooled"] = pool(row["runs"], row["delay_ms"])
        print(header(saved) + "\n\n" + table(saved["rows"], saved["transformers"]) + "\n\n" + overlap_table(saved["rows"])
              + "\n\n" + estimate_table(saved["rows"]))
        return
    t_start = time.perf_counter()
    cfg = OmegaConf.load(args.config)
    args.target = os.path.expanduser(OmegaConf.to_container(cfg, resolve=True)["model"]["target"])
    args.draft = os.path.expanduser(OmegaConf.to_container(cfg, resolve=True)["draft"]["model"])
    overrides = dict(item.split("=", 1) for item in args.set if "=" in item)
    args.dtype = overrides.get("model.dtype", cfg.model.dtype)  # the baselines run in Tandem's dtypes
    args.draft_dtype = overrides.get("draft.dtype", cfg.draft.dtype)
    out = Path(args.out or ROOT / "runs" / "bench" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = prompt_set(args.prompt_set)[:args.prompts]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]) for t in texts]
    info = {"machine": machine(args.threads, args.hf_threads), "dtype": args.dtype, "draft_dtype": args.draft_dtype, "target": args.target, "draft": args.draft,
            "max_new_tokens": args.max_new_tokens, "prompt_set": args.prompt_set, "prompts": [{"text": t, "tokens": len(p)} for t, p in zip(texts, prompts)],
            "delays": "EMULATED one-way delay per message (delivered that long after its send; netbridge/delay.py), both ranks on this host",
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    print(f"# {info['machine']['cpu']}, {info['machine']['cores']} cores, {args.threads} threads per rank, "
          f"{args.hf_threads} for the baselines, {args.dtype}, "
          f"prompts of {', '.join(str(p['tokens']) for p in info['prompts'])} tokens, {args.max_new_tokens} new tokens", file=sys.stderr)

    hf = None
    if not args.skip_hf:
        t0 = time.perf_counter()
        hf = {**hf_baselines(args, prompts), "threads": args.hf_threads}
        print(f"# transformers baselines: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    rows = []
    for row in sweep(args.full, args.overlap, args.split, args.hybrid):
        if args.only is not None and row.slug not in args.only:
            continue
        runs = [run_tandem(row, i, ids, args, out) for i, ids in enumerate(prompts)]
        entry = {"label": row.label, "drafter": row.drafter, "k": row.k, "delay_ms": row.delay_ms, "extra": row.extra, "runs": runs}
        failed = [r for r in runs if "error" in r]
        if failed:
            entry["error"] = failed[0]["error"]
        else:
            entry["pooled"] = pool(runs, row.delay_ms)
        rows.append(entry)
        p = entry.get("pooled")
        print(f"# {row.label} @ {row.delay_ms:g} ms: " + (f"{p['tokens_per_s']:.2f} tok/s, {p['tokens_per_round']:.2f} tok/round, "
                                                          f"{p['looked_up']:.0%} looked up"
              if p else f"FAILED {entry['error']}") + f" ({sum(r['wall_s'] for r in runs):.0f} s)", file=sys.stderr)

    info["runtime_s"] = time.perf_counter() - t_start
    loads = [run["load_avg_1min"] for row in rows for run in row["runs"] if "load_avg_1min" in run]
    info["load_avg_1min"] = [min(loads), max(loads)] if loads else None
    text = header(info) + "\n\n" + table(rows, hf) + "\n\n" + overlap_table(rows) + "\n\n" + estimate_table(rows)
    print(text)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({**info, "rows": rows, "transformers": hf}, indent=1))
    print(f"\n[results: {out / 'results.json'}; TensorBoard: tensorboard --logdir {out / 'tb'}]", file=sys.stderr)


if __name__ == "__main__":
    main()
