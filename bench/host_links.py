"""Two GPUs per host, emulated (issue 42): 4 ranks on 2 hosts, direct links on a host vs every link through the relay.

    python -m bench.host_links                         # a tiny fp32 model drafting for itself (about 2 minutes here)
    python -m bench.host_links --max-new-tokens 24     # a short check
    python -m bench.host_links --target PATH --draft PATH --dtype bfloat16 --prompt "..."   # real models

Each mode is the real entry under two torchruns (--nnodes=2 --nproc_per_node=2) that meet at a `tandem-relay`
subprocess (the tandem-relay rendezvous) with transport.kind=relay and an EMULATED one-way delay of --delay-ms
(transport.emulate_delay_ms) on every link transport.kind carries:
    direct     transport.local_links=auto: ranks 0-1 and 2-3 link on their host (loopback, no delay); the relay
               carries 2 links (1 -> 2, 3 -> 0): a round crosses between the hosts twice
    relay      transport.local_links=transport: all 4 links through the relay, each a WAN trip (as through a real
               relay, where even two ranks of one host meet only there): 4 crossings a round
Columns: tok/s (decode: (tokens - 1) / (total - TTFT)), x relay, tok/round, links the relay carried (its own log),
and = relay (the tokens equal: greedy, so they must). Writes <out>/results.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.hosts_harness import finish, paired_ring_links, start_hosts  # noqa: E402 - the repository root first
from tests.support.relay_harness import relay_process  # noqa: E402

MODES = {"direct": "transport.local_links=auto", "relay": "transport.local_links=transport"}


def tiny_self_model(root: Path) -> list[str]:
    """A tiny random fp32 model drafting for itself: every draft is accepted, so the wire is the round."""
    from tests.support.tiny_models import save_tiny
    folder = save_tiny(root / "tiny", "qwen2", seed=3, layers=8)
    return [f"model.target={folder}", f"draft.model={folder}", "model.dtype=float32", "draft.dtype=float32",
            "prompt_ids=[5,17,250,3,99,42,7,8]", "chat=false"]


def run_mode(mode: str, model: list[str], args, out: Path) -> dict:
    result, run_id = out / f"{mode}.json", f"hl-{mode}-{time.time_ns()}"
    overrides = [*model, MODES[mode], "transport.kind=relay", f"transport.emulate_delay_ms={args.delay_ms}",
                 f"output.json={result}", "output.stream=false", f"gen.max_new_tokens={args.max_new_tokens}",
                 f"spec.k={args.k}", "spec.adaptive=false", "model.split=null", "transport.timeout_s=300"]
    with relay_process(out) as relay:
        procs = start_hosts(out, 2, 2, overrides, relay, run_id)
        outs = finish(procs, args.timeout_s)
        carried = paired_ring_links(relay.log(), run_id)
    for node, p in procs.items():
        if p.returncode != 0 or not result.exists():
            raise SystemExit(f"{mode}: host {node} failed ({p.returncode}):\n{outs[node][1][-3000:]}")
    got = json.loads(result.read_text())
    s = got["stats"]
    return {"mode": mode, "tok_s": s["tokens_per_s"], "tokens_per_round": s["tokens_per_round"], "relay_links": len(set(carried)),
            "token_ids": got["token_ids"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay-ms", type=float, default=40.0, help="one-way delay on each link the relay carries")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--target", help="a model folder (default: a tiny random model drafting for itself)")
    ap.add_argument("--draft", help="the drafter's folder (with --target)")
    ap.add_argument("--dtype", default="bfloat16", help="with --target")
    ap.add_argument("--prompt", default="Write a Python function that reverses a string.", help="with --target")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="host-links-"))
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_self_model(out) if not args.target else [
        f"model.target={args.target}", f"model.dtype={args.dtype}", f"prompt={args.prompt}",
        *([f"draft.model={args.draft}", f"draft.dtype={args.dtype}"] if args.draft else ["draft.kind=ngram"])]
    rows = [run_mode(mode, model, args, out) for mode in MODES]
    base = rows[-1]
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores; 4 ranks as 2 hosts x 2 on this "
          f"machine; {args.delay_ms:g} ms one way per relay-carried link; batch 1, K={args.k}, "
          f"{args.max_new_tokens} new tokens\n")
    print("| links on a host | tok/s | x relay | tok/round | links the relay carried | = relay |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['tok_s']:.2f} | {r['tok_s'] / base['tok_s']:.2f} | {r['tokens_per_round']:.2f} | "
              f"{r['relay_links']} | {'yes' if r['token_ids'] == base['token_ids'] else 'NO'} |")
    (out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "rows": rows}, indent=1))
    print(f"\n{out / 'results.json'}")


if __name__ == "__main__":
    main()
