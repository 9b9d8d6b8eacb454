"""draft.quant=auto: the drafter's weight format, picked on rank 0 at start-up by timing a draft step in each.

A draft step is memory-bound: it reads every weight once for one token. Fewer bytes per weight, a faster step,
as long as the kernel that reads them is fast on this device: torch's int8 kernel is on a CPU in bf16 and not on
CUDA, bitsandbytes' NF4 repacks for AVX512-BF16 CPUs and does not batch well. So nothing is assumed: each
format's step is timed here, after warm-up steps, on placeholder weights in the drafter's real shapes
(model_parallel.split.draft_step_ms), at one row and, when serving several requests at once, at that many rows.

The rule (`pick`), and the figures behind it:
- int8 is near-lossless (one scale per output channel: every weight within half a step of 1/254 of its row's
  largest), so between none and int8 the faster step wins.
- NF4 costs acceptance: on the embedded pair, 83% of drafts accepted in bf16 against 78% in NF4 (FACTS.md,
  2026-12-04). At acceptance a per draft and K drafts a round yields (1 - a^(K+1)) / (1 - a) tokens: 3.56 against
  3.23 at K=4 (-9%), 4.56 against 4.06 at K=8 (-11%). So NF4 is taken only when its step is faster than the best of
  the others by more than NF4_MARGIN (1.15: a step 13% shorter pays for 11% fewer tokens per round even when the
  drafter is the whole round, which it is when it is the bottleneck this choice is about).
- Several rows (serve.max_concurrent > 1): each format's time relative to none's at one row and at B rows, their
  geometric mean: a one-stream step and a full batch weigh alike.
- A prompt's intake weighs alike too: every request's prompt goes through the drafter once, in chunks, and a
  kernel fast for a step's few rows may be slow over a chunk's hundreds (bitsandbytes' NF4 kernel on an
  AVX512-BF16 CPU runs a matrix-vector loop per row: the embedded pair's 0.5B drafter took in a 512-token chunk in
  ~5 s where int8 took 1.2, so a 2,000-token prompt's first token waited ~20 s instead of ~9). So each format
  also takes in a chunk of INTAKE_TOKENS, and that time relative to none's joins the mean.
- A drafter whose layers and head are under SMALL_BYTES stays as it is: its weights sit in a CPU's caches (or a
  GPU reads them in microseconds), a step costs its overheads, and a timing would pick noise.
- A format whose trial step fails here (bitsandbytes missing, a shape its kernel refuses) is left out, said so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

FORMATS = ("none", "int8", "nf4")
NF4_MARGIN = 1.15
SMALL_BYTES = 32 * 2**20
MAX_ROWS = 8  # the largest batch timed (serve.max_concurrent=null serves up to launch.plan.AUTO_SLOTS = 8)
INTAKE_TOKENS = 128  # the prompt chunk timed: past a few dozen rows every kernel's time is linear in them
INTAKE = "intake"  # its key beside the row counts


@dataclass(frozen=True)
class DraftFormat:
    name: str  # none | int8 | nf4: what the drafter runs
    settings: object  # its model_parallel.quant settings (None: as stored)
    why: str  # for the start-up line: as given, or what auto timed and chose
    step_ms: dict = field(default_factory=dict)  # auto: {rows: ms of a step} of the format chosen, as timed


def pick(ms: dict[tuple[str, int | str], float], rows: tuple[int | str, ...]) -> str:
    """The format to run from {(format, rows): ms per step} (none's at every row count included; rows INTAKE: a
    prompt chunk's intake)."""
    names = [f for f in FORMATS if all((f, r) in ms for r in rows)]
    score = {f: math.prod(ms[f, r] / ms["none", r] for r in rows) ** (1 / len(rows)) for f in names}
    lossless = min((f for f in names if f != "nf4"), key=score.__getitem__)
    if "nf4" in score and score["nf4"] * NF4_MARGIN < score[lossless]:
        return "nf4"
    return lossless


def choose(model, device: str, dtype, settings: dict[str, object], rows: tuple[int, ...], weights_bytes: int,
           window_s: float | None = None) -> tuple[str, str, dict]:
    """(the format auto runs, the start-up line's reason, {rows: its ms per step} as timed (none when not timed))
    for the drafter `model` (a loader.ModelSource) on
    `device`; `settings`: each format's quant settings; `weights_bytes`: its layers' and head's bytes as stored."""
    from model_parallel.lines import human
    from model_parallel.split import WINDOW_S, Timed, draft_step_ms
    if weights_bytes < SMALL_BYTES:
        return "none", (f"draft.quant=auto: none (the drafter's layers and head are {human(weights_bytes)}, under "
                        f"{human(SMALL_BYTES)}: a step costs its overheads, not its weight reads)"), {}
    steps = {(f, r): (Timed(model, 1, device, dtype, settings[f], head=True), r) for f in FORMATS for r in rows}
    steps |= {(f, INTAKE): (Timed(model, INTAKE_TOKENS, device, dtype, settings[f]), 1) for f in FORMATS}
    ms, failed = draft_step_ms(steps, WINDOW_S if window_s is None else window_s)
    columns = (*rows, INTAKE)
    if any(("none", r) not in ms for r in columns):
        return "none", f"draft.quant=auto: none (the full-precision step did not run: {failed})", {}
    chosen = pick(ms, columns)
    names = {r: f"{r} row{'s' if r > 1 else ''}" for r in rows} | {INTAKE: f"a {INTAKE_TOKENS}-token prompt chunk"}
    timings = "; ".join(f"{names[r]}: " + ", ".join(f"{f} {ms[f, r]:.1f}" for f in FORMATS if (f, r) in ms)
                        for r in columns)
    skipped = sorted({f for f, _ in failed})
    reasons = {f: why for (f, _), why in failed.items()}
    left_out = f"; left out: {', '.join(f'{f} ({reasons[f]})' for f in skipped)}" if skipped else ""
    why = (f"draft.quant=auto: {chosen} (ms per draft step, timed here: {timings}; int8 when faster than none, nf4 "
           f"only when {NF4_MARGIN:g}x faster than both, for its lower acceptance; the step and the prompt's intake "
           f"weigh alike{left_out})")
    return chosen, why, {r: ms[chosen, r] for r in rows}
