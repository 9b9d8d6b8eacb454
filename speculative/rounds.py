"""The round, one function per rank, side by side.

    rank 0                                         rank 1
    drafts = drafter.propose(committed, k)
    h = stage0([pending..., d1..dK])
    send("round", hidden=h, drafts, [q])  ------>  logits = stage1(h)[-(K+1):]
                                                   accepted, next = verify(logits, drafts)
    a, next <------------------------------------  send("reply", accepted, next)
    rewind stage0, commit d1..da + next            rewind stage1 to the committed length

`pending` is the prompt in the first round (the prefill) and the last committed token after that;
both caches then hold exactly the committed tokens but the newest, which the next round feeds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from model_parallel.stage import Stage
from netbridge.channel import Channel
from speculative.output import Output
from speculative.verify import target_probs, verify_greedy, verify_sampled


@dataclass
class RoundRecord:
    drafted: int
    accepted: int
    committed: int  # tokens kept after stop criteria
    draft_ms: float
    stage0_ms: float
    round_ms: float  # send -> reply received: network + rank 1's compute
    stage1_ms: float  # rank 1's forward + verification, as it measured
    start_s: float = 0.0  # when the round started, seconds since generation started
    send_ms: float = 0.0  # the part of round_ms spent in channel.send (an emulated delay included)
    sent_s: float = 0.0  # when the send began, seconds since generation started (round_ms starts here)


@dataclass
class Generation:
    prompt_ids: list[int]
    output: Output
    rounds: list[RoundRecord] = field(default_factory=list)
    ttft_s: float = 0.0
    total_s: float = 0.0
    t0_s: float = 0.0  # time.perf_counter() at the start: start_s + t0_s is a round's clock reading


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def next_k(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """Draft more after a full hit, less after a miss (transformers' assisted-generation schedule):
    a miss means the later drafts were wasted work. Any K is lossless; only speed depends on it."""
    if drafted == 0:
        return k
    return min(k + 2, k_max) if accepted == drafted else max(k - 1, 1)


def run_rank0(stage: Stage, drafter, channel: Channel, prompt_ids: list[int], output: Output, k: int,
              on_round=None, adaptive: bool = False) -> Generation:
    gen = Generation(prompt_ids, output)
    committed = list(prompt_ids)
    pending = list(prompt_ids)  # tokens the target has not yet seen
    t_start = gen.t0_s = time.perf_counter()
    k_now = k
    while not output.done:
        t_round = time.perf_counter()
        remaining = output.max_new_tokens - len(output.tokens)
        k_round = 0 if len(committed) == len(prompt_ids) else min(k_now, remaining - 1)  # never overshoot
        drafts = drafter.propose(committed, k_round)
        draft_ms = _ms(t_round)

        t0 = time.perf_counter()
        start = len(committed) - len(pending)
        stage.cache.check_room(start + len(pending) + len(drafts))
        ids = torch.tensor([pending + drafts.tokens.tolist()], device=stage.device)
        hidden = stage(ids, live=start + ids.shape[1])
        stage0_ms = _ms(t0)

        t0 = time.perf_counter()
        tensors = dict(hidden=hidden, drafts=drafts.tokens)
        if drafts.q_ids is not None:
            tensors.update(q_ids=drafts.q_ids, q_probs=drafts.q_probs)
        channel.send("round", {"start": start}, **tensors)
        send_ms = _ms(t0)
        reply = channel.recv("reply")
        round_ms = _ms(t0)

        accepted, token = reply.meta["accepted"], reply.meta["token"]
        new_tokens = drafts.tokens[:accepted].tolist() + [token]
        kept = output.commit(new_tokens)
        committed += new_tokens[:kept]
        pending = committed[-1:]
        stage.cache.rewind(len(committed) - 1)
        drafter.commit(len(committed))
        if not gen.rounds:
            gen.ttft_s = time.perf_counter() - t_start
        record = RoundRecord(len(drafts), accepted, kept, draft_ms, stage0_ms, round_ms, reply.meta["stage1_ms"],
                             t_round - t_start, send_ms, t0 - t_start)
        gen.rounds.append(record)
        if adaptive:
            k_now = next_k(k_now, len(drafts), accepted, k)
        if on_round is not None:
            on_round(record, reply.meta)
    channel.send("stop")
    gen.total_s = time.perf_counter() - t_start
    return gen


def run_rank1(stage: Stage, channel: Channel, temperature: float, top_p: float, seed: int) -> int:
    """Serve rounds until rank 0 says stop; returns the number of rounds served."""
    generator = torch.Generator().manual_seed(seed)
    rounds = 0
    while True:
        t_wait = time.perf_counter()
        msg = channel.recv(("round", "stop"))
        if msg.kind == "stop":
            return rounds
        t0 = time.perf_counter()
        hidden, drafts = msg.tensors["hidden"].to(stage.device), msg.tensors["drafts"]
        start, k = msg.meta["start"], drafts.numel()
        stage.cache.rewind(start)  # rank 0 is the authority on the committed length
        stage.cache.check_room(start + hidden.shape[1])
        logits = stage(hidden, num_logits=k + 1, live=start + hidden.shape[1])[0].cpu()
        t_forward = time.perf_counter()
        if temperature > 0:
            probs = target_probs(logits, temperature, top_p)
            accepted, token = verify_sampled(probs, drafts, msg.tensors.get("q_ids"), msg.tensors.get("q_probs"), generator)
        else:
            accepted, token = verify_greedy(logits, drafts)
        t_send = time.perf_counter()
        channel.send("reply", {"accepted": accepted, "token": token, "stage1_ms": (t_send - t0) * 1000,
                               "t1": [t_wait, t0, t_forward, t_send]})  # rank 1's clock, for launch/timeline.py
        rounds += 1
