"""Which cost drifted: each round's parts as measured beside the cost model's (round/predicted_* in TensorBoard,
speculative.cost_model.parts_ms), the medians per run, rows in the forward, K and cached tokens (to the nearest
thousand).

    python -m bench.cost_grid --models tiny --delays 0 --out /tmp/grid --set log.dir=/tmp/grid/runs
    python -m bench.round_parts /tmp/grid/runs

Parts: draft (rank 0's drafter steps), stage0 (its forward), rank{r} (a middle rank's), last (the last rank's
forward and verification), as each rank timed them; predicted, what the model charges each rank for the block, the
engine's work besides the forward included (cost_model.PartsMs: rank 0's committing, ~0.8 ms a round and 0.16 a
row more, is outside its measured stage0, so there measured below predicted is the model holding). A round
prepared in an earlier round's wait (spec.overlap) timed its drafting and stage 0 there, not here: its draft and
stage0 are left out. Prints measured / predicted (ms) and their ratio per part."""
from __future__ import annotations

import argparse
import collections
import statistics
from pathlib import Path

PARTS = ("draft", "stage0", "rank1", "rank2", "last")


def read_run(folder: Path) -> list[dict]:
    """A run's decode rounds: {tag: value} of its round/* scalars, those with the model's parts only."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    rounds: dict[int, dict] = collections.defaultdict(dict)
    for tag in tags:
        if tag.startswith("round/"):
            for e in events.Scalars(tag):
                rounds[e.step][tag[len("round/"):]] = e.value
    return [r for _, r in sorted(rounds.items()) if "predicted_last_ms" in r]


def rows_of(runs: dict[str, list[dict]]) -> list[tuple]:
    """(run, rows, K, cached, rounds, {part: (measured, predicted)}) per group of rounds, in order."""
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for name, rounds in runs.items():
        for r in rounds:
            groups[name, int(r["batch"]), int(r["drafted"]), round(r.get("start", 0), -3)].append(r)
    out = []
    for key, rounds in groups.items():
        parts = {}
        for part in PARTS:
            if part in ("draft", "stage0"):  # drafted in the open: a prepared block's work is in its wait
                timed = [r for r in rounds if r["stage0_ms"] > 0 and (part == "stage0" or r["drafted"] > 0)]
            else:
                timed = rounds
            timed = [r for r in timed if f"{part}_ms" in r and f"predicted_{part}_ms" in r]
            if timed:
                parts[part] = (statistics.median(r[f"{part}_ms"] for r in timed),
                               statistics.median(r[f"predicted_{part}_ms"] for r in timed))
        out.append((*key, len(rounds), parts))
    return out


def table(rows: list[tuple]) -> list[str]:
    lines = ["| run | rows | K | cached | rounds | " + " | ".join(PARTS) + " |",
             "|---|---|---|---|---|" + "---|" * len(PARTS)]
    for name, batch, k, cached, n, parts in rows:
        cells = [f"{m:.2f} / {p:.2f} ({m / p:.2f}x)" if p > 0 else f"{m:.2f} / 0" if (m, p) != (0, 0) else "-"
                 for m, p in (parts.get(part, (0.0, 0.0)) for part in PARTS)]
        lines.append(f"| {name} | {batch} | {k} | {cached:.0f} | {n} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="run folders (log.dir's), or folders holding them")
    a = ap.parse_args(argv)
    found = sorted({f.parent for folder in a.folders for f in Path(folder).rglob("events.out.tfevents.*")})
    runs = {folder.name: read_run(folder) for folder in found}
    print("measured / predicted ms (median over the rounds), and measured over predicted")
    for line in table(rows_of(runs)):
        print(line)


if __name__ == "__main__":
    main()
