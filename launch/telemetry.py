"""TensorBoard figures of a run, written by rank 0 (the later ranks' figures come back in the replies).

    <log.dir>/<YYYYmmdd-HHMMSS>-<model>-k<K>-<drafter>/
        events.out.tfevents.*   scalars, histogram, text, hparams (tensorboard --logdir <log.dir>)
        trace.json              every rank on one time axis (log.trace; launch/timeline.py)
        summary.json            the stats, the clock alignment and every round's record
        *.pt.trace.json         torch.profiler traces of a few rounds on rank 0 (log.profile)

Per round, step = the round's index; round 0 is the prefill (the prompt in, the first token out), so
the sum of `round/tokens` over all steps is the number of tokens generated and the number of steps
is stats["rounds"]. The output JSON's means are over the decode rounds (steps >= 1).

    round/draft_ms      drafting on rank 0
    round/stage0_ms     rank 0's layer slice
    round/last_ms       the last rank's layer slice + head + verification, as it measured it (with N > 2
                        ranks round/rank{r}_ms is each middle rank's layers); round/stage1_ms is the same
                        figure under its name from before N ranks, still written (docs/running.md)
    round/network_ms    send -> reply on rank 0 minus every later rank's compute and ahead_ms: the wire,
                        (de)serialization and any emulated delay; no compute of either rank
    round/ahead_ms      spec.overlap: rank 0 preparing the next round while this one was in flight
    round/round_ms      the whole round on rank 0 (draft + stage0 + send -> reply)
    round/busy_ms       rank 0's whole work since the reply before (a batch's first round; none after an
                        admission): its forward, drafting and send, and the engine's committing and answering,
                        which the cost model prices at the pace it measures (cost_model.PaceTally: "engine")
    round/drafted, round/accepted (drafts the target kept), round/tokens (committed this round)
    round/in_flight     this request's rounds on the way when the reply came (spec.in_flight)
    round/on_the_way    every live request's rounds on the way then (serving several at once)
    round/batch         the rounds that went out in one forward with this one (several requests' rounds)
    round/start         the position its block began at: the tokens its request had cached (attended over)
    round/predicted_tokens_per_s  the cost model's tokens/s for this stream at this round's K (acceptance and
                        the costs' pace as measured so far; speculative.cost_model), beside
                        round/measured_tokens_per_s: the stream's tokens/s since its first token;
                        round/predicted_draft_ms, _stage0_ms, _last_ms (and _rank{r}_ms) the model's parts of the
                        round at the start-up costs beside the measured ones: the
                        drafter's steps, each rank's whole work on the block (cost_model.parts_ms): which cost
                        drifted (bench/round_parts.py sums them up per batch size, K and context)

Per ring link (step = the link's index i, rank i -> rank i+1; measured at start-up, netbridge.link_probe):
link/rtt_ms, link/send_mbps, link/recv_mbps, link/between_hosts (1: carried by transport.kind, 0: direct on
one host); text run/links names each link's kind. summary.json has them as "links".

Per run (step 0): run/ttft_ms, run/tokens_per_s (and the cost model's run/predicted_ttft_ms,
run/predicted_tokens_per_s, and run/predicted_tokens_per_s_timed at the costs as timed at start-up),
run/tokens_per_round, run/acceptance_rate, run/full_hit_rate, run/tokens, run/clock_offset_ms,
run/clock_uncertainty_ms; run/accepted_per_round (histogram of accepted drafts per decode round); position/acceptance (step = draft position 1..K);
text run/prompt, run/output, run/config; and the config as hparams with hparam/* final figures.

Serving (serve.port; ServeTelemetry): several requests are live at once and their rounds interleave, so
the round/* scalars take one global step across requests (a round's index in the whole serve), and with
each round serve/slots_in_use (requests being generated) and serve/waiting (queued for a slot).
Per request (step =
the request's index, in the order they ended): request/ttft_ms (from its arrival), request/queue_ms
(arrival to admission into a slot), request/tokens_per_s, request/tokens, request/prompt_tokens,
request/prompt_tokens_reused, request/prefilled_tokens, request/slot. At shutdown trace.json (log.trace)
holds the last requests' rounds (up to MAX_TRACED_ROUNDS), each tagged with its slot and request, one
block of rows per slot (launch/timeline.py).
"""
from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

from omegaconf import OmegaConf

from launch.private_files import private_dir, private_files, write_private
from launch.timeline import Part, alignment_dict, build_timeline, merged_timeline, write_trace

PROFILE_ROUNDS = dict(wait=1, warmup=1, active=3, repeat=1)  # skip the prefill, warm up, record 3 rounds


def run_name(cfg, now: float | None = None) -> str:
    model = Path(cfg.model.target.rstrip("/")).name or "model"
    drafter = "none" if cfg.spec.k == 0 else cfg.draft.kind
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{stamp}-{model}-k{cfg.spec.k}-{drafter}")


def _unique_dir(root: Path, name: str) -> Path:
    path, n = root / name, 2
    while path.exists():
        path, n = root / f"{name}-{n}", n + 1
    return private_dir(path)


class Telemetry:
    """`on_round` is the round loop's callback; `finish` writes the per-run figures and the trace."""

    def __init__(self, cfg, prompt_ids: list[int] | None, prompt_text: str | None = None, links: tuple = ()):
        from torch.utils.tensorboard import SummaryWriter
        self.cfg = cfg
        self.dir = _unique_dir(Path(cfg.log.dir).expanduser(), run_name(cfg))
        self.writer = SummaryWriter(str(self.dir))
        private_files(self.dir)  # the event file exists now; TensorBoard creates it with the umask's mode
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text
        self.links = tuple(links)  # netbridge.link_probe.LinkProbe, one per ring link
        self.link_figures()
        self.last_marks: list[list[float]] = []  # the last rank's clock marks, per round
        self.middle_marks: list[list[list[float]]] = []  # N > 2: per round, each middle rank's
        self.last_rank = 1
        self.step = 0
        self.profiler = None
        if cfg.log.profile:
            import torch.profiler as tp
            self.profiler = tp.profile(schedule=tp.schedule(**PROFILE_ROUNDS), record_shapes=True,
                                       on_trace_ready=tp.tensorboard_trace_handler(str(self.dir), worker_name="rank0"))
            self.profiler.start()

    def link_figures(self) -> None:
        """link/* per ring link, and run/links naming each one's kind and round trip."""
        ranks = len(self.links)
        for i, link in enumerate(self.links):
            for tag, value in (("rtt_ms", link.rtt_ms), ("send_mbps", link.send_mbps), ("recv_mbps", link.recv_mbps),
                               ("between_hosts", int(link.kind != "local"))):
                self.writer.add_scalar(f"link/{tag}", value, i)
        if self.links:
            self.writer.add_text("run/links", _md("\n".join(f"rank {i} -> rank {(i + 1) % ranks}: {link.text()}"
                                                            for i, link in enumerate(self.links))), 0)

    def on_round(self, r, reply) -> None:
        """r: the round's RoundRecord; reply: the last rank's protocol.Reply (its clock marks feed the trace)."""
        self.round_scalars(r)
        self.last_marks.append(list(reply.marks))
        self.middle_marks.append(list(reply.middle_marks or []))
        self.last_rank = max(self.last_rank, len(self.middle_marks[-1]) + 1)
        self.next_step()

    def next_step(self) -> None:
        self.step += 1
        if self.profiler is not None:
            self.profiler.step()

    def round_scalars(self, r) -> None:
        """The round/* scalars of one round at the current step."""
        w, step = self.writer, self.step
        for tag, value in (("draft_ms", r.draft_ms), ("stage0_ms", r.stage0_ms), ("last_ms", r.last_ms),
                           ("stage1_ms", r.last_ms),  # last_ms's name before N ranks (docs/running.md)
                           ("network_ms", r.network_ms), ("ahead_ms", r.ahead_ms),
                           ("round_ms", r.draft_ms + r.stage0_ms + r.round_ms),
                           ("drafted", r.drafted), ("accepted", r.accepted), ("tokens", r.committed),
                           ("in_flight", r.in_flight), ("bets_lost", r.bets_lost), ("wasted_ms", r.wasted_ms),
                           ("on_the_way", r.on_the_way), ("batch", r.batch), ("start", r.start)):
            w.add_scalar(f"round/{tag}", value, step)
        if r.predicted_tokens_per_s > 0:  # the cost model beside what this stream measured so far: drift shows
            w.add_scalar("round/predicted_tokens_per_s", r.predicted_tokens_per_s, step)
            w.add_scalar("round/measured_tokens_per_s", r.measured_tokens_per_s, step)
        if r.predicted_parts is not None:  # ... and part by part: which cost drifted
            parts = r.predicted_parts
            for tag, value in (("draft_ms", parts.draft_ms), ("stage0_ms", parts.stage0_ms), ("last_ms", parts.last_ms),
                               *((f"rank{rank}_ms", ms) for rank, ms in enumerate(parts.middle_ms, start=1))):
                w.add_scalar(f"round/predicted_{tag}", value, step)
        if r.busy_ms is not None:
            w.add_scalar("round/busy_ms", r.busy_ms, step)
        if r.bet is not None:  # a round was prepared ahead on this one: 1 if its bet held
            w.add_scalar("round/bet_won", int(r.bet), step)
        for rank, ms in enumerate(r.middle_ms, start=1):
            w.add_scalar(f"round/rank{rank}_ms", ms, step)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
        self.writer.close()

    def finish(self, gen, stats: dict, output_text: str | None) -> dict:
        """Per-run figures, hparams, trace.json and summary.json; returns the clock alignment."""
        if self.profiler is not None:
            self.profiler.stop()
        w = self.writer
        trace, alignment = build_timeline(gen, self.last_marks, meta={"run": self.dir.name},
                                          min_one_way_s=self.cfg.transport.emulate_delay_ms / 1000,
                                          middle_marks=self.middle_marks if self.last_rank > 1 else None)
        if self.cfg.log.trace:
            write_trace(self.dir / "trace.json", trace)
        run = {"ttft_ms": stats["ttft_s"] * 1000, "tokens_per_s": stats["tokens_per_s"],
               "predicted_ttft_ms": stats["predicted_ttft_s"] * 1000,
               "predicted_tokens_per_s": stats["predicted_tokens_per_s"],
               "predicted_tokens_per_s_timed": stats["predicted_tokens_per_s_timed"],
               "tokens_per_round": stats["tokens_per_round"], "acceptance_rate": stats["acceptance_rate"],
               "full_hit_rate": stats["full_hit_rate"], "tokens": stats["tokens"],
               "clock_offset_ms": alignment.offset_ms, "clock_uncertainty_ms": alignment.uncertainty_ms}
        for tag, value in run.items():
            w.add_scalar(f"run/{tag}", value, 0)
        for position, rate in enumerate(stats["acceptance_per_position"], start=1):
            w.add_scalar("position/acceptance", rate, position)
        accepted = [r.accepted for r in gen.rounds[1:] if r.drafted]
        if accepted:
            import numpy as np
            w.add_histogram("run/accepted_per_round", np.array(accepted), 0, bins=np.arange(stats["k"] + 2) - 0.5)
        w.add_text("run/prompt", _md(self.prompt_text if self.prompt_text is not None else str(self.prompt_ids)), 0)
        w.add_text("run/output", _md(output_text if output_text is not None else str(gen.output.tokens)), 0)
        w.add_text("run/config", _md(OmegaConf.to_yaml(public_config(self.cfg))), 0)
        self._hparams(stats)
        w.flush()
        w.close()
        summary = {"run": self.dir.name, "stats": stats, "clock": alignment_dict(alignment),
                   "rounds": [asdict(r) for r in gen.rounds], "last_marks": self.last_marks,
                   "rank1_marks": self.last_marks,  # last_marks's name before N ranks (docs/running.md)
                   **({"middle_marks": self.middle_marks} if self.last_rank > 1 else {}),
                   "links": [asdict(link) for link in self.links], "t0_s": gen.t0_s}
        write_private(self.dir / "summary.json", json.dumps(summary, indent=1))
        private_files(self.dir)  # the profiler's traces too
        return alignment_dict(alignment)

    def _hparams(self, stats: dict) -> None:
        from torch.utils.tensorboard.summary import hparams
        metrics = {f"hparam/{k}": float(stats[k]) for k in
                   ("tokens_per_s", "tokens_per_round", "acceptance_rate", "full_hit_rate", "tokens")}
        metrics["hparam/ttft_ms"] = stats["ttft_s"] * 1000
        exp, ssi, sei = hparams(flat_config(self.cfg), metrics)
        for summary in (exp, ssi, sei):
            self.writer.file_writer.add_summary(summary)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, 0)


MAX_TRACED_ROUNDS = 20_000  # serving: trace.json keeps the last requests' rounds up to this many (memory stays bounded)


class ServeTelemetry(Telemetry):
    """Serving: the live requests' rounds come interleaved, so round/* take one step across the whole serve
    (never two rounds on one step), with serve/slots_in_use and serve/waiting at each; request/* take the
    request's index. At close, trace.json (log.trace) has the last requests' rounds, each on its slot's rows."""

    def __init__(self, cfg, links: tuple = ()):
        super().__init__(cfg, None, links=links)
        self.marks: dict[int, list] = {}  # a live request's readings per round (the last rank's, the middle ranks'), by its serial
        self.traced: deque[Part] = deque()
        self.traced_rounds = 0

    def on_round(self, r, reply, request: int = 0, live: int = 1, waiting: int = 0) -> None:
        """One round of the request admitted `request`-th; `live` requests being generated, `waiting` queued."""
        self.round_scalars(r)
        self.writer.add_scalar("serve/slots_in_use", live, self.step)
        self.writer.add_scalar("serve/waiting", waiting, self.step)
        self.marks.setdefault(request, []).append((list(reply.marks), list(reply.middle_marks or [])))
        self.next_step()

    def on_request(self, stats: dict, index: int, request: int, gen) -> None:
        """A request ended (finished or cancelled): its figures at step `index`, its rounds kept for the trace."""
        for tag, value in (("ttft_ms", stats["ttft_s"] * 1000), ("queue_ms", stats["queue_s"] * 1000),
                           ("tokens_per_s", stats["tokens_per_s"]), ("tokens", stats["tokens"]),
                           ("prompt_tokens", stats["prompt_tokens"]), ("slot", stats["slot"]),
                           ("prompt_tokens_reused", stats["prompt_tokens_reused"]),
                           ("prefilled_tokens", stats["prefilled_tokens"])):
            self.writer.add_scalar(f"request/{tag}", value, index)
        self.writer.flush()
        marks = self.marks.pop(request, [])
        if self.cfg.log.trace and gen.rounds:
            self.traced.append(Part(gen, [m for m, _ in marks], [m for _, m in marks], stats["slot"], index))
            self.traced_rounds += len(gen.rounds)
            while self.traced_rounds > MAX_TRACED_ROUNDS and len(self.traced) > 1:
                self.traced_rounds -= len(self.traced.popleft().gen.rounds)

    def close(self) -> None:
        if self.traced:
            trace, _ = merged_timeline(list(self.traced), {"run": self.dir.name, "requests": len(self.traced)},
                                       self.cfg.transport.emulate_delay_ms / 1000)
            write_trace(self.dir / "trace.json", trace)
        super().close()
        private_files(self.dir)


def flat_config(cfg) -> dict:
    """The config as hparams: dotted keys, values TensorBoard accepts (lists and None as text)."""
    out = {}

    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, (bool, int, float, str)):
                out[prefix + key] = value
            else:
                out[prefix + key] = "none" if value is None else json.dumps(value)[:200]

    walk(public_config(cfg), "")
    return out


SECRETS = (("transport", "secret"), ("transport", "relay_token"), ("serve", "api_key"))  # never in a file we write


def public_config(cfg) -> dict:
    """The config as a plain dict, with every secret blanked: never write a secret into a log."""
    tree = OmegaConf.to_container(OmegaConf.structured(cfg))
    for section, key in SECRETS:
        if tree[section].get(key):
            tree[section][key] = "(set)"
    return tree


def _md(text: str) -> str:
    """TensorBoard renders text as markdown: indent it so code and newlines survive."""
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty)"
