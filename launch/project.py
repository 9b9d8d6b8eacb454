"""A projection for machines not yet rented: will the model fit, how is it split, how fast would it be.

    python -m launch.project Qwen/Qwen2.5-7B-Instruct --hosts T4 T4 --rtt-ms 86 --drafter Qwen/Qwen2.5-0.5B-Instruct
    python -m launch.project bench/projection_models/llama-3.3-70b-instruct --quant nf4 --hosts T4,T4 T4,T4 --rtt-ms 86
    tandem-plan ...                                          # the same command, installed as a script

The model (a Hub id, resolved by model_parallel.hub: config.json and the other small files, never a weight; or a
local folder / config.json path) is built on the meta device, so its bytes per layer are exact (model_parallel.memory,
the counts the launch checks budgets with). The machines are device kinds from DEVICES (published memory, bandwidth
and dense 16-bit tensor FLOPs) or `cpu`, measured here; one host per --hosts word, its ranks' devices comma-separated
(`T4,T4` or `2xT4`), ranks numbered host by host. A ring link between two hosts costs half the round trip given for
that crossing (--rtt-ms: one value, or one per crossing in ring order) at --mbps; within a host, LOCAL_ONE_WAY_MS.

What each part costs, stated with every projection (ASSUMPTIONS): a decode step is memory-bound, so a stage's time
over a block is the bytes it reads (its weights once, every row's keys and values of the context) / (bandwidth x
efficiency), or its FLOPs / (peak x efficiency) when that is larger (a long prefill chunk), plus an eager launch
overhead per layer on a GPU (the drafter is graph-captured there: draft.graph=auto). From those costs the pipeline's
model (speculative.cost_model, the one the launch chooses K, depth and batches with) gives one stream's tokens/s, the
aggregate of several and the TTFT of a long prompt. Acceptance is a prior (--acceptance), not a measurement.

Nothing here is measured on the machines themselves: the output says "projection". On machines you have, run
the launch with plan_only=true, which times each rank for real.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
EFFICIENCY = 0.6  # of the published bandwidth / FLOPs an eager stage reaches (the article's 7B on a T4: ~0.4-0.5)
GRAPH_EFFICIENCY = 0.85  # a graph-captured drafter step (the article: 0.5B, 8 steps in 25 ms on a T4 = ~0.9)
LAUNCH_MS = 0.2  # eager kernel launches per decoder layer on a GPU (~25 kernels x ~8 us of Python and driver)
CONTEXT = 1024  # tokens every row attends over in a decode round (prompt + answer so far)
CUDA_CONTEXT_GIB = 0.5  # what the CUDA runtime itself takes on a GPU before any tensor
HEADROOM = 0.10  # of the rest, kept free (model.max_memory=null keeps the same)
LOCAL_ONE_WAY_MS = 0.1  # two ranks of one host (gloo over loopback; FACTS.md: 0.12-0.14 ms a small round trip)
LOCAL_MBPS = 24_000.0  # ~3 GB/s over loopback (FACTS.md)
ACTIVATION_BYTES = 2  # a hidden state on the wire, per number (16-bit)


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes, as published
    bandwidth: float  # bytes/s, memory bandwidth
    flops: float  # dense 16-bit tensor FLOP/s (fp32 accumulation)
    gpu: bool = True
    bf16: bool = True
    source: str = "published"

    def budget(self) -> int:
        """What model.max_memory=null would give a rank on it."""
        runtime = CUDA_CONTEXT_GIB * GiB if self.gpu else 0
        return int((self.memory - runtime) * (1 - HEADROOM))


def _gpu(name, gib, gbps, tflops, bf16=True) -> Device:
    return Device(name, gib * GiB, gbps * 1e9, tflops * 1e12, bf16=bf16)


# Published figures (vendor data sheets): memory, memory bandwidth, dense fp16/bf16 tensor FLOPs with fp32 accumulate.
DEVICES = {d.name.lower(): d for d in (
    _gpu("T4", 16, 320, 65, bf16=False),  # Turing: no bfloat16 (give --dtype float16)
    _gpu("L4", 24, 300, 121),
    _gpu("A10", 24, 600, 125),
    _gpu("A100-40", 40, 1555, 312),
    _gpu("A100-80", 80, 2039, 312),
    _gpu("H100", 80, 3350, 989),  # SXM
    _gpu("RTX3090", 24, 936, 35.6),
    _gpu("RTX4090", 24, 1008, 82.6),
)}


def measured_cpu() -> Device:
    """This machine's CPU: bandwidth from reading a 256 MiB tensor, FLOPs from a matmul, memory MemAvailable."""
    import time

    import torch
    from model_parallel.memory import free_bytes
    big = torch.ones(64 * 2**20, dtype=torch.float32)
    big.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        big.sum()
    bandwidth = 3 * big.numel() * 4 / (time.perf_counter() - t0)
    a = torch.ones(512, 512, dtype=torch.bfloat16)
    a @ a
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    flops = 5 * 2 * 512**3 / (time.perf_counter() - t0)
    memory, _ = free_bytes("cpu")
    return Device("cpu", memory, bandwidth, flops, gpu=False, source="measured here")


def device(kind: str) -> Device:
    found = measured_cpu() if kind.lower() == "cpu" else DEVICES.get(kind.lower().replace(" ", ""))
    if found is None:
        raise ValueError(f"unknown device kind {kind!r}; known: {', '.join(d.name for d in DEVICES.values())}, cpu")
    return found


def hosts_ranks(hosts: list[str]) -> list[tuple[int, str]]:
    """[(host, device kind)] per rank from --hosts words: `T4`, `T4,T4`, `2xT4`."""
    ranks = []
    for h, word in enumerate(hosts):
        for part in word.split(","):
            count, kind = part.split("x", 1) if re.fullmatch(r"\d+x.+", part) else ("1", part)
            ranks += [(h, kind)] * int(count)
    return ranks


# --- what a model's parts read and compute ---------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One model's per-layer figures, from config.json (and the quant its linears are stored in)."""
    layers: int
    layer_bytes: int  # one layer's weights as stored (NF4 packed, int8, or the dtype)
    layer_linear: int  # one layer's linear weights, in numbers
    kv_token_bytes: int  # one token's keys and values in one layer
    attention_width: int  # heads x head_dim
    hidden: int
    vocab: int
    embed_bytes: int
    head_bytes: int
    quant: str  # none | nf4 | int8
    nf4_read_once: bool = False  # what if: a 4-bit kernel that reads the packed weights once for a small block

    def weight_traffic(self, positions: int, gpu: bool) -> float:
        """Bytes one layer's weights cost over a block of `positions` (rows x tokens): read once; NF4 over more
        than one position and int8 on a GPU are dequantized to 16 bits first (written, then read by the matmul)."""
        dequantized = (self.quant == "nf4" and positions > 1 and not self.nf4_read_once) or (self.quant == "int8" and gpu)
        return self.layer_bytes + (4 * self.layer_linear if dequantized else 0)


def shape(model, quant_name: str, dtype: str, nf4_read_once: bool = False) -> Shape:
    from model_parallel.memory import model_bytes
    from model_parallel.quant import Int8Settings, NF4Settings
    quant = {"nf4": NF4Settings(), "int8": Int8Settings()}.get(quant_name)
    b = model_bytes(model, quant, 1)
    c, layer = model.config, model.shell.model.layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if type(m).__name__ == "Linear")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return Shape(c.num_hidden_layers, max(b.layers), linear, b.cache_per_layer, c.num_attention_heads * head_dim,
                 c.hidden_size, c.vocab_size, b.embed, b.head, quant_name, nf4_read_once)


def layer_ms(s: Shape, d: Device, tokens: int, rows: int = 1, context: int = CONTEXT, efficiency: float = EFFICIENCY,
             launch_ms: float | None = None) -> float:
    """One layer over `rows` x `tokens` after `context` cached tokens: the larger of its memory time and its
    compute time, plus the launch overhead (LAUNCH_MS on a GPU)."""
    n = rows * tokens
    read = s.weight_traffic(n, d.gpu) + rows * (context + tokens) * s.kv_token_bytes
    compute = 2 * s.layer_linear * n + 4 * n * (context + tokens) * s.attention_width
    overhead = (LAUNCH_MS if d.gpu else 0.0) if launch_ms is None else launch_ms
    return 1000 * max(read / (d.bandwidth * efficiency), compute / (d.flops * efficiency)) + overhead


def head_ms(s: Shape, d: Device, tokens: int, rows: int = 1, efficiency: float = EFFICIENCY) -> float:
    n = rows * tokens
    return 1000 * max(s.head_bytes / (d.bandwidth * efficiency), 2 * s.hidden * s.vocab * n / (d.flops * efficiency))


def draft_step_ms(s: Shape, d: Device, rows: int = 1, tokens: int = 1) -> float:
    """The whole drafter over `tokens` per row: graph-captured on a GPU (no launches, GRAPH_EFFICIENCY)."""
    eff = GRAPH_EFFICIENCY if d.gpu else EFFICIENCY
    return s.layers * layer_ms(s, d, tokens, rows, efficiency=eff, launch_ms=0.0) + head_ms(s, d, tokens, rows, eff)


# --- the plan: fit, split, the pipeline's costs ------------------------------------------------------

ASSUMPTIONS = (f"a decode step is memory-bound: time = bytes read (weights once per block, every row's keys and values) "
               f"/ (published bandwidth x {EFFICIENCY}), or FLOPs / (published peak x {EFFICIENCY}) when larger (prefill); "
               f"+{LAUNCH_MS} ms of kernel launches per eager layer on a GPU; the drafter graph-captured on a GPU "
               f"(x {GRAPH_EFFICIENCY}, no launches); NF4 over more than one position and int8 on a GPU read each weight "
               f"dequantized to 16 bits too; decode rounds attend over {CONTEXT} tokens; a GPU's budget is its memory less "
               f"{CUDA_CONTEXT_GIB} GiB for the CUDA runtime, less {HEADROOM:.0%}; a crossing between hosts costs half its round "
               f"trip one way, a link within a host {LOCAL_ONE_WAY_MS} ms; hidden states cross in 16 bits")


@dataclass
class Projection:
    lines: list[str]
    fits: bool
    prediction: object = None  # speculative.cost_model.Prediction at the model's own choice
    by_k: dict = None  # K -> one stream's tokens/s (depth 1)


def open_model(spec: str, setting: str, dtype: str):
    """A Hub id (its config.json and small files, no weight), a model folder, or a config.json path."""
    from model_parallel.hub import is_hub_id, resolve
    from model_parallel.loader import ModelSource
    folder = resolve(spec, setting)[0] if is_hub_id(spec) else spec
    folder = Path(folder).parent if Path(folder).name == "config.json" else Path(folder)
    return ModelSource.open(folder, dtype)


def ring_links(ranks: list[tuple[int, str]], rtt_ms: list[float], mbps: list[float]):
    """LinkCost per ring link (i: rank i -> i+1, the last back to rank 0): local within a host, else the next
    crossing's round trip / 2 at its bandwidth. No message cost (LinkCost.message_ms 0): it is CPU time on the
    machines projected, which their link probe measures once they run (a gloo pair on a busy 2-core host: 0.8-5 ms)."""
    from speculative.cost_model import LinkCost
    n = len(ranks)
    crossing = [ranks[i][0] != ranks[(i + 1) % n][0] for i in range(n)]
    count = sum(crossing)
    if count and len(rtt_ms) not in (1, count):
        raise ValueError(f"--rtt-ms gives {len(rtt_ms)} round trips for {count} host crossings: give one, or one per crossing")
    if count and len(mbps) not in (1, count):
        raise ValueError(f"--mbps gives {len(mbps)} bandwidths for {count} host crossings: give one, or one per crossing")
    links, j = [], 0
    for i in range(n):
        if crossing[i]:
            links.append(LinkCost(rtt_ms[min(j, len(rtt_ms) - 1)] / 2, mbps[min(j, len(mbps) - 1)]))
            j += 1
        else:
            links.append(LinkCost(LOCAL_ONE_WAY_MS, LOCAL_MBPS))
    return links


def rank_memory(target, drafter, quant_name: str, max_len: int, devices: list[Device], draft_here: bool):
    """Every rank's RankCosts (bytes only), as launch.plan.rank_costs counts them."""
    from model_parallel.memory import model_bytes
    from model_parallel.quant import Int8Settings, NF4Settings
    from model_parallel.split import RankCosts
    quant = {"nf4": NF4Settings(), "int8": Int8Settings()}.get(quant_name)
    t = model_bytes(target, quant, max_len)
    costs = []
    for r, d in enumerate(devices):
        fixed, slot = t.stage(0, 0, embed=r == 0, head=r == len(devices) - 1), t.slot(0, 0)
        if r == 0 and drafter is not None and draft_here:
            b = model_bytes(drafter, None, max_len)
            fixed += b.stage(0, len(b.layers), embed=True, head=True)
            slot += b.slot(0, len(b.layers))
        costs.append(RankCosts(d.budget(), fixed, t.layer(), slot_fixed_bytes=slot, slot_layer_bytes=t.cache_per_layer))
    return costs


def project(args) -> Projection:
    from model_parallel.lines import human
    from model_parallel.split import NoFit, layer_counts, no_fit_message, place_layers
    ranks = hosts_ranks(args.hosts)
    kinds = {kind: device(kind) for _, kind in ranks}
    devices = [kinds[kind] for _, kind in ranks]
    draft_device = device(args.draft_device) if args.draft_device else devices[0]
    target = open_model(args.model, "model", args.dtype)
    drafter = open_model(args.drafter, "drafter", args.dtype) if args.drafter else None
    t = shape(target, args.quant, args.dtype, args.nf4_blocks == "read-once")
    dr = shape(drafter, "none", args.dtype) if drafter else None
    lines = heading(args, t, ranks, devices, draft_device)
    lines += [f"note: {d.name} has no bfloat16: give --dtype float16 (model.dtype=float16)"
              for d in kinds.values() if not d.bf16 and args.dtype == "bfloat16"]
    step = (lambda rows=1, tokens=1: draft_step_ms(dr, draft_device, rows, tokens)) if dr else None
    costs = rank_memory(target, drafter, args.quant, args.max_len, devices, draft_here=not args.draft_device)
    costs = [timed(c.at(args.streams), t, d, args.k, step if r == 0 else None, r == len(ranks) - 1)
             for r, (c, d) in enumerate(zip(costs, devices))]
    try:
        cuts = place_layers(t.layers, costs)  # as model.split=auto places them: memory first, then speed
    except NoFit:
        lines.append(f"fit: NO. {no_fit_message(t.layers, costs)}; {args.streams} KV slot(s) of {args.max_len} tokens")
        return Projection(lines, False)
    links = ring_links(ranks, args.rtt_ms, args.mbps)
    if args.workload:
        cuts, line = workload_split(t, devices, costs, cuts, links, step, args)
        lines.append(line)
    counts = layer_counts(t.layers, cuts)
    bounds = [0, *cuts, t.layers]
    lines.append("fit: yes; split " + "; ".join(
        f"rank {r} layers {bounds[r]}-{bounds[r + 1] - 1}: {human(c.bytes_for(m))} of {human(c.budget)}"
        for r, (c, m) in enumerate(zip(costs, counts))) + f" ({args.streams} KV slot(s) of {args.max_len} tokens)")
    pipe = pipeline(t, devices, counts, links, step, args)
    return predictions(pipe, lines, args)


def workload_split(t: Shape, devices: list[Device], costs, one_stream: list[int], links, step, args):
    """(cuts, the line that says why) for --workload, as workload.* plans a launch's split
    (launch.prediction.split_for_workload): of the splits that fit, the one the model ends --streams prompts of
    --prompt-tokens admitted at once, and their --answer-tokens answers, soonest on (at its best K and depth), where
    that is more than WORKLOAD_MARGIN sooner than on one stream's split (`one_stream`); else that one."""
    from launch.plan import split_text
    from launch.prediction import WORKLOAD_MARGIN, split_for_workload
    from model_parallel.split import layer_counts
    from speculative import cost_model as cm
    w = cm.Workload(args.streams, args.prompt_tokens, args.answer_tokens)
    ks = range(args.k + 1) if step else (0,)

    def ends(cuts: list[int]) -> tuple[float, int]:
        pipe = pipeline(t, devices, layer_counts(t.layers, cuts), links, step, args)
        return cm.best_for_workload(pipe, w, ks, args.chunk, cm.depths_allowed("auto"))

    chosen = split_for_workload(t.layers, costs, one_stream, lambda cuts: ends(cuts)[0])
    (chosen_s, chosen_k), (one_s, one_k) = ends(chosen), ends(one_stream)
    head = (f"planned for {w.streams} stream(s) at once, {w.prompt_tokens}-token prompts and {w.answer_tokens}-token "
            f"answers")
    if chosen != one_stream:
        return chosen, (f"{head}: split {split_text(chosen)} ends them in {chosen_s:.1f} s (K={chosen_k}); one stream's "
                        f"split ({split_text(one_stream)}): {one_s:.1f} s")
    return one_stream, (f"{head}: one stream's split ({split_text(one_stream)}) kept, {one_s:.1f} s (K={one_k}); no "
                        f"split ends them {WORKLOAD_MARGIN:.0%} sooner")


def heading(args, t: Shape, ranks, devices: list[Device], draft_device: Device) -> list[str]:
    where = ", ".join(f"rank {r} {d.name} (host {h})" for r, ((h, _), d) in enumerate(zip(ranks, devices)))
    drafting = (f"; drafter {args.drafter} " + (f"on its own {draft_device.name}" if args.draft_device else
                                                 "on rank 0's device")) if args.drafter else "; no drafter"
    what_if = ("; WHAT IF: NF4 blocks read the 4-bit weights once (--nf4-blocks read-once: no such kernel runs today)"
               if args.quant == "nf4" and args.nf4_blocks == "read-once" else "")
    return [f"PROJECTION (from published device figures, not measured): {args.model} ({t.layers} layers, {args.quant}, "
            f"{args.dtype}) on {len(ranks)} ranks over {len(args.hosts)} host(s): {where}{drafting}",
            f"assumptions: {ASSUMPTIONS}; per-position acceptance {args.acceptance} (a prior, not measured){what_if}"]


def timed(costs, t: Shape, d: Device, k: int, step, last: bool):
    """A rank's RankCosts with the roofline's ms, as the launch's timing fills them (a block of K+1): one layer, and
    the rest of its round (rank 0: the drafter's K+1 steps; the last rank: the head)."""
    costs.layer_ms = layer_ms(t, d, k + 1)
    costs.fixed_ms = ((k + 1) * step() if step else 0.0) + (head_ms(t, d, k + 1) if last else 0.0)
    return costs


def pipeline(t: Shape, devices: list[Device], counts: list[int], links, step, args):
    """speculative.cost_model's Pipeline of this placement: each rank's block costs from the roofline above."""
    from speculative import cost_model as cm
    n, k = len(devices), args.k
    decode = range(1, k + 2)
    prefill = sorted({args.chunk, 2 * args.chunk, args.chunk + k, args.prompt_tokens % args.chunk or args.chunk})
    ranks = []
    for r, (d, m) in enumerate(zip(devices, counts)):
        def ms(tokens, rows=1, context=CONTEXT, r=r, d=d, m=m):
            return m * layer_ms(t, d, tokens, rows, context) + (head_ms(t, d, tokens, rows) if r == n - 1 else 0.0)
        by_tokens = {s: ms(s) for s in decode} | {s: ms(s, context=args.prompt_tokens // 2) for s in prefill}
        ranks.append(cm.RankCost(0.0, by_tokens=by_tokens, row_ms=ms(k + 1, rows=2) - ms(k + 1)))
    draft = cm.DraftCost()
    if step:
        draft = cm.DraftCost(step(), step(2) - step(), step(1, args.chunk) / args.chunk, extra_steps=1)
    return cm.Pipeline(tuple(ranks), tuple(links), draft, cm.Acceptance(prior=args.acceptance),
                       t.hidden * ACTIVATION_BYTES, overlap=True)


def predictions(pipe, lines: list[str], args) -> Projection:
    from speculative import cost_model as cm
    ks = sorted({0, *(k for k in (1, 2, 4, 8) if k <= args.k), args.k} if pipe.draft.step_ms else {0})
    by_k = {k: cm.stream_tokens_per_s(pipe, k, 1) for k in ks}
    lines.append("one stream, tokens/s by K (depth 1, overlap): " + ", ".join(
        f"K={k} {v:.1f} ({cm.tokens_per_round(pipe.acceptance, k):.2f} tokens/round)" for k, v in by_k.items()))
    best = cm.best_settings(pipe, args.k if pipe.draft.step_ms else 0, 4, args.streams)
    p = cm.predict(pipe, best, args.streams, args.prompt_tokens, args.chunk)
    together = (f"{args.streams} streams together {p.aggregate_tokens_per_s:.1f} tokens/s in {best.batches} batch(es); "
                if args.streams > 1 else "")
    lines.append(f"the model's choice: K={best.k}, depth {best.depth}: one stream {p.stream_tokens_per_s:.1f} tokens/s; "
                 f"{together}TTFT of a {args.prompt_tokens}-token prompt {p.ttft_s:.2f} s (chunks of {args.chunk})")
    lines.append(round_line(pipe, best.k))
    if args.goal:
        lines.append(goal_line(pipe, best, args.goal, args.k if pipe.draft.step_ms else 0))
    return Projection(lines, True, p, by_k)


def round_parts_named(pipe, k: int) -> dict[str, float]:
    """A round of K in turn, by part (ms)."""
    tokens = k + 1
    parts = {"drafting": pipe.draft.round_ms(k), "rank 0's layers": pipe.ranks[0].ms(1, tokens)}
    for r, rank in enumerate(pipe.ranks[1:], 1):
        parts[f"rank {r}'s layers" + (" + head" if r == len(pipe.ranks) - 1 else "")] = rank.ms(1, tokens)
    parts["link latency"] = sum(link.one_way_ms for link in pipe.links)
    parts["link transfer"] = sum(link.transfer_ms(pipe.link_bytes(i, 1, tokens)) for i, link in enumerate(pipe.links))
    return parts


def round_line(pipe, k: int) -> str:
    parts = round_parts_named(pipe, k)
    wire = parts["link latency"] + parts["link transfer"]
    largest = max(parts, key=parts.get)
    return (f"a round at K={k}, in turn: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in parts.items())
            + f" = {sum(parts.values()):.1f} ms: compute {sum(parts.values()) - wire:.1f} ms, the wire {wire:.1f} ms; "
            f"the largest single part: {largest}")


def goal_line(pipe, best, goal: float, k_max: int) -> str:
    """Whether `goal` tokens/s for one stream is within the model's reach, and what stands in the way."""
    from speculative import cost_model as cm
    reached = max(cm.stream_tokens_per_s(pipe, k, d) for k in range(k_max + 1) for d in range(1, 5))
    tokens = cm.tokens_per_round(pipe.acceptance, best.k)
    parts = round_parts_named(pipe, best.k)
    wire = parts["link latency"] + parts["link transfer"]
    compute = sum(parts.values()) - wire
    verdict = "reachable" if reached >= goal else "NOT reached"
    return (f"goal {goal:g} tokens/s for one stream: {verdict} (best {reached:.1f}); at K={best.k} a round commits "
            f"{tokens:.2f} tokens, so it must take <= {1000 * tokens / goal:.0f} ms in all (or overlap to that): the wire "
            f"takes {wire:.0f} ms, the ranks' compute {compute:.0f} ms in turn")


def check(args) -> None:
    """The arguments a projection cannot use, as one line each (ValueError)."""
    if len(hosts_ranks(args.hosts)) < 2:
        raise ValueError(f"--hosts {' '.join(args.hosts)} gives {len(hosts_ranks(args.hosts))} rank(s); Tandem runs on 2 or more")
    if not 0 < args.acceptance <= 1:
        raise ValueError(f"--acceptance {args.acceptance} must be in (0, 1]")
    for name in ("k", "streams", "max_len", "prompt_tokens", "chunk", "answer_tokens"):
        low = 0 if name == "k" else 1
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least {low}")
    if min(args.rtt_ms) < 0 or min(args.mbps) <= 0:
        raise ValueError("--rtt-ms must be >= 0 and --mbps > 0")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m launch.project", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog="devices: "
                                + ", ".join(f"{d.name} ({d.memory // GiB} GiB, {d.bandwidth / 1e9:.0f} GB/s)"
                                            for d in DEVICES.values()) + ", cpu (measured here)")
    p.add_argument("model", help="Hub id, model folder or config.json path")
    p.add_argument("--hosts", nargs="+", required=True, help="one word per host: its ranks' devices, e.g. T4,T4 or 2xT4")
    p.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0], help="round trip of each host crossing, in ring order (one: all)")
    p.add_argument("--mbps", type=float, nargs="+", default=[math.inf], help="bandwidth of each crossing, Mbit/s (default unlimited)")
    p.add_argument("--drafter", help="draft model: Hub id, folder or config.json (none: K=0 only)")
    p.add_argument("--draft-device", help="a device of its own for the drafter (as draft.device=cuda:1); default rank 0's")
    p.add_argument("--quant", choices=("none", "nf4", "int8"), default="none", help="the target's weights (model.quant)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--k", type=int, default=8, help="the most drafts a round may carry (spec.k)")
    p.add_argument("--acceptance", type=float, default=0.7, help="each draft's chance to be kept (a prior)")
    p.add_argument("--streams", type=int, default=1, help="streams served at once (KV slots; the aggregate)")
    p.add_argument("--max-len", type=int, default=4096, help="KV cache per slot, tokens (model.max_len)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="the prompt whose TTFT is projected")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (model.prefill_chunk)")
    p.add_argument("--workload", action="store_true", help="plan the split for --streams prompts of --prompt-tokens "
                   "admitted at once and their --answer-tokens answers, as workload.* plans a launch's")
    p.add_argument("--answer-tokens", type=int, default=256, help="with --workload: each answer (workload.answer_tokens)")
    p.add_argument("--nf4-blocks", choices=("dequantize", "read-once"), default="dequantize",
                   help="NF4 over a block of several positions: as bitsandbytes runs it (each weight dequantized to 16 "
                   "bits, then multiplied) or what if a kernel read the 4-bit weights once (not what runs today)")
    p.add_argument("--goal", type=float, help="tokens/s for one stream: say whether it is reachable and what stands in the way")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from model_parallel.loader import ModelLoadError  # (HubError is one)
    try:
        check(args)
        projection = project(args)
    except (ValueError, OSError, ModelLoadError) as e:
        print(f"tandem-plan: {e}", file=sys.stderr)
        return 2
    print("\n".join(projection.lines))
    return 0 if projection.fits else 1


if __name__ == "__main__":
    sys.exit(main())
