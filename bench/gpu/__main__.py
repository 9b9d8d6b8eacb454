"""python -m bench.gpu --out DIR [--dry-run] [--budget-s 480]: see bench/gpu/__init__.py."""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.gpu.wheels import use_wheels  # noqa: E402  (before anything imports omegaconf)


class Budget:
    """Each part runs only while time is left; a part that is skipped or fails is said so in the report."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.parts: list[dict] = []

    def run(self, name: str, fn, need_s: float = 0.0):
        left = self.end - time.monotonic()
        if left < need_s:
            self.parts.append({"part": name, "status": f"skipped: {left:.0f} s left, it needs ~{need_s:.0f} s"})
            return None
        t0 = time.monotonic()
        try:
            result = fn()
            status = "ok"
        except Exception as e:  # noqa: BLE001 - one part's failure is a finding; the rest still runs
            result, status = None, f"failed: {type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        self.parts.append({"part": name, "status": status, "seconds": round(time.monotonic() - t0, 1)})
        print(f"[gpu check] {name}: {status} ({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
        return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, in seconds: checks the script itself")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting parts after this (default 8 min)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    wheels = use_wheels()
    import torch
    from bench.gpu import costs, parity, projection
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --dry-run for the CPU check of this script")
    device = "cpu" if dry else "cuda:0"
    name = "cpu (dry run)" if dry else torch.cuda.get_device_name(0)
    k, chunk, reps = 4, (16 if dry else 512), (3 if dry else 20)
    budget, tmp = Budget(args.budget_s), parity.tmp_dir()
    report = {"device": name, "torch": torch.__version__, "dry_run": dry, "wheels": wheels, "parity": [], "timings": {}}

    entry = budget.run("parity through the entry", lambda: parity.entry_parity(device, tmp, dry), 60)
    report["parity"] += entry or []
    for real in ([False] if dry else [False, True]):
        case = budget.run(f"graph parity ({'0.5B shape' if real else 'tiny'})",
                          lambda: parity.graph_parity(device, tmp, real, 20 if dry else (100 if real else 300)), 30)
        report["parity"] += [case] if case else []
    case = budget.run("several requests at once", lambda: parity.concurrent_parity(device, tmp), 30)
    report["parity"] += [case] if case else []
    if not all(c.get("identical") is not False for c in report["parity"]):
        print("[gpu check] PARITY FAILED: the timings below measure wrong code; fix parity first", file=sys.stderr)

    t = report["timings"]
    drafter = budget.run("random drafter in the 0.5B shape", lambda: costs.drafter_folder(tmp, dry, device), 20)
    if drafter:
        t["drafter_k_loop"] = budget.run("drafter K-step loop, eager vs graph",
                                         lambda: costs.drafter_steps(drafter, device, k, reps), 30)
        t["drafter_k_loop_formats"] = budget.run("drafter K-step loop per weight format (draft.quant)",
                                                 lambda: costs.drafter_formats(drafter, device, k, reps), 40)
    for shape in ("qwen2.5-7b", "qwen2.5-32b"):
        t[shape] = budget.run(f"stage costs, {shape} shape", lambda: costs.layer_ms(shape, device, k, chunk, 2 if dry else 4, reps, dry), 30)
    target = budget.run("random target (7B shape, 2 layers) for whole rounds", lambda: costs.round_target(tmp, dry, 2, device), 30)
    if target and drafter:
        t["rounds"] = [r for r in (budget.run(f"whole round at {d} ms one way",
                                              lambda: costs.entry_round(target, drafter, d, tmp, 8 if dry else 48, k), 40)
                                   for d in ([0.0] if dry else [0.0, 43.0])) if r]
    report["projection"] = budget.run("projection", lambda: project(report, name), 0)
    report["parts"] = budget.parts
    (args.out / "gpu.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu.md").write_text(table(report))
    print(table(report))
    return 0 if all(c.get("identical") is not False for c in report["parity"]) else 1


def project(report: dict, device_name: str) -> dict:
    from bench.gpu.projection import project as formula
    t = report["timings"]
    loop = t.get("drafter_k_loop") or {}
    draft_ms = loop.get("graph_ms", loop.get("eager_ms"))
    layers = t.get("qwen2.5-7b") or {}
    layer_ms, head_ms = layers.get("per_layer_ms_5"), layers.get("head_ms_5")
    zero = next((r for r in t.get("rounds", []) if r.get("delay_ms") == 0 and "mean_ms" in r), None)
    if None in (draft_ms, layer_ms, head_ms) or zero is None:
        return {"missing": "a timing it needs was skipped or failed"}
    parts = zero["mean_ms"]
    overhead = max(0.0, parts["round"] - parts["draft"] - parts["stage0"] - parts.get("last", parts.get("stage1", 0.0)))
    return formula(draft_ms, layer_ms, head_ms, overhead, device_name)


def table(report: dict) -> str:
    lines = [f"# Tandem GPU check: {report['device']} (torch {report['torch']}{', DRY RUN' if report['dry_run'] else ''})", "",
             "## Parity", "", "| case | identical |", "|---|---|"]
    lines += [f"| {c['name']} | {c.get('identical')}{' (' + c['skipped'] + ')' if c.get('skipped') else ''} |" for c in report["parity"]]
    lines += ["", "## Timings (bf16, random weights in the real shapes; per layer over a few layers)", "", "```",
              json.dumps(report["timings"], indent=1), "```", "", "## Projection for the seed's setting", ""]
    p = report.get("projection") or {}
    if "tokens_per_s_this_device" in p:
        t4 = p["tokens_per_s_t4_estimate"]
        lines += [f"- formula: {p['formula']}", f"- inputs: {json.dumps(p['inputs'])}",
                  f"- projected on this device's costs at 86 ms RTT: **{p['tokens_per_s_this_device']:.1f} tokens/s**",
                  f"- T4 estimate (costs scaled by memory bandwidth): {'n/a' if t4 is None else f'{t4:.1f} tokens/s'}",
                  f"- the seed's two T4s: {p['seed']['avg_tokens_per_s']} average / {p['seed']['peak_tokens_per_s']} peak tokens/s"]
    else:
        lines.append(f"- not projected: {p.get('missing', 'the projection part did not run')}")
    lines += ["", "## Parts", "", "| part | status | s |", "|---|---|---|"]
    lines += [f"| {x['part']} | {x['status']} | {x.get('seconds', '')} |" for x in report["parts"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
