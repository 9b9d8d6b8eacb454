"""Why spec.overlap can gain nothing: rank 0 drafting ahead while rank 1 verifies, each timed alone and together.

With spec.overlap, rank 0 drafts the next round (K+1 drafter steps) and runs its slice while rank 1
verifies the round in flight; on one host the two then run at the same time on the two cores. This
loads the drafter here (real weights, one thread) and rank 1's stage (layers [split, L) + head, real
weights, one thread) in a second process, and times:
    drafter   K+1 steps (a prepared round's drafting), alone and while rank 1 verifies in a loop
    rank 1    its layers + head over a block of K+1, alone and while the drafter drafts in a loop

    python bench/overlap_probe.py [--split 1] [--k 4] [--reps 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def config(split: int):
    from launch.config import load_config
    return load_config(["prompt=hi", "model.max_len=1024", "draft.max_len=1024", f"model.split={split}"])


def drafter_times(drafter, context: list[int], steps: int, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        drafter.propose(context, steps)
        times.append((time.perf_counter() - t0) * 1000)
        drafter.commit(len(context))  # back to the same cache length: every rep drafts the same
    return times


def child(split: int, k: int) -> None:
    """Rank 1's work in a loop, on command from the parent (stdin): "solo" N blocks, or "loop" until "stop"."""
    import select

    import torch
    from launch.build import build_stage
    from launch.plan import plan_here
    torch.set_num_threads(1)
    stage = build_stage(plan_here(config(split), 1))
    hidden = torch.randn(1, 64 + k + 1, stage.config.hidden_size, dtype=torch.bfloat16) * 0.1
    stage(hidden[:, :64], num_logits=1, live=64)

    def block() -> float:
        t0 = time.perf_counter()
        stage.cache.rewind(64)
        stage(hidden[:, 64:], num_logits=k + 1, live=64 + k + 1)
        return (time.perf_counter() - t0) * 1000
    print("ready", flush=True)
    for command in sys.stdin:
        if command.startswith("solo"):
            print("solo", statistics.median([block() for _ in range(int(command.split()[1]))]), flush=True)
        elif command.startswith("loop"):
            times = []
            while not select.select([sys.stdin], [], [], 0)[0]:
                times.append(block())
            sys.stdin.readline()  # "stop"
            print("loop", statistics.median(times), len(times), flush=True)
        else:
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.split, args.k)
    import torch
    from launch.build import load_tokenizer, model_drafter
    from launch.plan import plan_here
    from bench.run_bench import PROMPTS
    torch.set_num_threads(1)
    cfg = config(args.split)
    tokenizer = load_tokenizer(cfg.model.target)
    context = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    drafter = model_drafter(plan_here(cfg, 0))
    drafter.reset(0, 0.0, 0)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, __file__, "--child", "--split", str(args.split), "--k", str(args.k)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().startswith("ready")
    load = os.getloadavg()[0]
    drafter_times(drafter, context, args.k + 1, 2)  # warm-up
    alone = statistics.median(drafter_times(drafter, context, args.k + 1, args.reps))
    proc.stdin.write(f"solo {args.reps}\n")
    proc.stdin.flush()
    rank1_alone = float(proc.stdout.readline().split()[1])
    proc.stdin.write("loop\n")
    proc.stdin.flush()
    time.sleep(0.5)
    together = statistics.median(drafter_times(drafter, context, args.k + 1, args.reps))
    proc.stdin.write("stop\n")
    proc.stdin.flush()
    _, rank1_together, blocks = proc.stdout.readline().split()
    proc.stdin.write("end\n")
    proc.stdin.close()
    proc.wait(60)
    print(f"load average {load:.1f}, {os.cpu_count()} cores, split {args.split}, K={args.k}, bf16, 1 thread each (medians):")
    print(f"  drafter {args.k + 1} steps: alone {alone:.0f} ms, while rank 1 verifies {together:.0f} ms ({together / alone:.2f}x)")
    print(f"  rank 1 block of {args.k + 1}: alone {rank1_alone:.0f} ms, while the drafter drafts {float(rank1_together):.0f} ms "
          f"({float(rank1_together) / rank1_alone:.2f}x, {blocks} blocks)")


if __name__ == "__main__":
    main()
