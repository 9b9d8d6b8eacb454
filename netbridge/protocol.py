"""Every message between the ranks, in one place.

    rank 0                                   the later ranks (the last one answers)
    Hellos([Hello(layers, dtype, quant, -->  checks it against its own; both Hellos back, or Error;
        cuts, what it may hold, speed)])     both then settle the same cuts from the two Hellos
    Lookup(hashes, weights, held)       -->  cache.dir: a long prompt's saved blocks; each rank lowers `held`
                                        <--  to what it holds on disk; the last rank's comes back (speculative.prefixes)
    Restore(hashes, weights, start, n)  -->  cache.dir: load tokens [start, n) from disk; save the prompt's blocks
    Request(params, slot, copy_from)    -->  a new generation in `slot`: its SamplingParams (temperature, top_p,
                                             seed, [a grammar it masks by, how many top log-probabilities each
                                             Reply carries]), which its verifier uses
    Prefill(start, hidden)              -->  a long prompt's leading chunks: extend the cache, no reply
    Round(slot, start, hidden, drafts,  -->  forward its slice from `start` in `slot`, verify; `batch` Rounds of
          [q], batch)                        several slots run as one forward; they travel as one frame (send_all)
                                        <--  Reply(accepted, token, last_ms, marks, [logprobs], [error]), one per
                                                 Round, a batch's in one frame; `error`: its request's grammar
                                                 failed, that request ends
    ... more Rounds, more Requests (serving: several generations live at once, each in its own slot) ...
    Idle                                -->  nothing to do yet (serving): the link is alive
    Bye                                 -->  the session is over
    Error(error)                        <->  the sender failed; the receiver reports it and exits

With N > 2 ranks the same messages go around a ring 0 -> 1 -> ... -> N-1 -> 0: a middle rank runs its
layers over a Prefill's or a Round's hidden states and passes the message on with its own (adding its
clock marks to Round.marks); everything else it passes on as it came. The last rank's Reply (or Hellos,
or Error) closes the ring at rank 0. In the handshake each rank adds its Hello to the Hellos it received
(launch.handshake), and the whole list goes on around until every rank has it.

A message is a dataclass: its tensor fields travel as tensors, the rest as the frame's JSON `meta`
(netbridge.frames). `send` and `recv` are the only way the ranks talk; `recv` turns an Error from the
peer, a kind it did not expect and a missing field into one PeerError line.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from netbridge.channel import Channel, PeerError
from netbridge.frames import Message

VERSION = 18  # bumped when a message changes; Hello carries it


@dataclass
class Hello:
    """The model a rank runs, and what it may hold and how fast it is (model_parallel.split.RankCosts)."""
    num_layers: int
    dtype: str
    quant: str
    cuts: list[int] | None = None  # model.split as cuts (the first layer of ranks 1..N-1); None: auto on this rank
    budget: int = 0  # bytes this rank may hold (model.max_memory)
    fixed_bytes: int = 0  # bytes it holds besides its layers (embeddings, drafter; norm + head)
    layer_bytes: int = 0  # one layer with its KV cache
    layer_ms: float = 0.0  # one layer over a round's block, timed on this rank (0: not timed)
    fixed_ms: float = 0.0  # the rest of its work per round (drafter steps; head)
    slots: int = 1  # KV slots it asks for (1 one-shot, serve.max_concurrent; 0: as many as fit); the fewest asked win
    slot_bytes: list[int] = field(default_factory=lambda: [0, 0])  # each slot adds: besides its layers, per layer
    link: dict | None = None  # its link on to the next rank as it measured it (netbridge.link_probe.LinkProbe's fields)
    layer_token_ms: float = 0.0  # one layer's ms per token more than the block (prefill, speculative.cost_model)
    draft_step_ms: float = 0.0  # rank 0: one drafter step, of fixed_ms
    prefill_ms: dict = field(default_factory=dict)  # RankCosts' attend_ms, draft_token_ms, draft_attend_ms
    version: int = VERSION


@dataclass
class Hellos:
    """The handshake's one message: the Hellos of ranks 0..r, as rank r sends them on (launch.handshake)."""
    hellos: list[Hello]

    def __post_init__(self):  # as received: each Hello's fields (a missing or unknown one: recv's protocol error)
        self.hellos = [h if isinstance(h, Hello) else Hello(**h) for h in self.hellos]


@dataclass
class SamplingParams:
    """How one generation samples: the entry builds it from gen.*, the HTTP layer from a request's fields
    (launch/serve/fields.py); Session.admit takes it and a Request carries it to the last rank, which verifies
    with it."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    grammar: str | None = None  # structured outputs: llguidance's grammar text (speculative.grammar); the last rank masks
    logprobs: int | None = None  # the committed tokens' log-probabilities wanted, with this many top alternatives (0..20)


@dataclass
class Request:
    """A new generation in `slot`: the last rank verifies the slot's rounds with `params` until its next Request."""
    params: SamplingParams = field(default_factory=SamplingParams)
    slot: int = 0  # the KV slot this generation owns on every rank (serve.max_concurrent)
    copy_from: int | None = None  # a live request's slot whose first `copied` tokens this prompt shares: every
    copied: int = 0  # rank copies them into `slot` first, so only the rest is prefilled (Session.shared_prefix)

    def __post_init__(self):  # as received: the params' fields (a missing or unknown one: recv's protocol error)
        if isinstance(self.params, dict):
            self.params = SamplingParams(**self.params)


@dataclass
class Lookup:
    """cache.dir: which of a prompt's blocks every rank holds on disk (speculative.prefixes). Each rank reads its own,
    lowers `held` to what it has, adds its weights' identity and sends it on; the last rank's goes to rank 0."""
    hashes: list[str]  # the prompt's whole blocks (kvcache.disk.prefix_hashes): no token ids travel
    weights: list[str]  # the weights' identity of each rank so far (model_parallel.identity), in rank order
    held: int  # leading blocks every rank so far holds
    block: int  # tokens a block


@dataclass
class Restore:
    """cache.dir, ahead of a Request whose prompt is long enough to save: load tokens [start, tokens) of the last
    Lookup's blocks (start: what the caches already hold) and save the prompt's blocks once its first Round ran."""
    hashes: list[str]
    weights: list[str]
    block: int
    start: int
    tokens: int
    slot: int = 0  # the slot the tokens are loaded into


@dataclass
class Prefill:
    """A chunk of a long prompt ahead of its first Round: each later rank only extends its cache (no reply), so it
    runs its layers over one chunk while rank 0 runs its own over the next."""
    start: int
    hidden: torch.Tensor  # [1, T, H]
    slot: int = 0


@dataclass
class Round:
    start: int  # the committed length before this block: every later rank rewinds its cache here
    hidden: torch.Tensor  # [1, T, H]: rank 0's slice over [pending..., d1..dK]
    drafts: torch.Tensor  # [K]
    q_ids: torch.Tensor | None = None  # [K, m] when sampling: the support of each draft's distribution
    q_probs: torch.Tensor | None = None  # [K, m]
    marks: list[list[float]] | None = None  # N > 2: each middle rank's clock marks, as in Reply.marks
    guess: int | None = None  # a block sent on a bet (spec.in_flight): the token it begins with, which the
    # round before must give; the last rank skips a block whose bet it already knows failed
    slot: int = 0  # whose round: the slot of the generation it belongs to
    batch: int = 1  # this Round and the batch - 1 after it (in one frame: send_all) run as one forward on every rank;
    # each gets its own Reply, in order


@dataclass
class Reply:
    accepted: int
    token: int  # the target's next token after the accepted drafts
    last_ms: float  # the last rank's forward and verification
    marks: list[float] = field(default_factory=list)  # the last rank's clock: wait, start, forward done, send
    middle_marks: list[list[float]] | None = None  # N > 2: Round.marks as the last rank received them
    logprobs: torch.Tensor | None = None  # params.logprobs: [accepted + 1] the committed tokens' (verify.token_logprobs)
    top_ids: torch.Tensor | None = None  # [accepted + 1, n] the most likely tokens at each, and theirs:
    top_logprobs: torch.Tensor | None = None  # [accepted + 1, n]
    error: str | None = None  # the request's grammar failed (speculative.grammar.GrammarFailure): it ends with this


@dataclass
class Idle:
    pass


@dataclass
class Bye:
    pass


@dataclass
class Error:
    error: str


MESSAGES = {cls.__name__.lower(): cls for cls in (Hellos, Request, Lookup, Restore, Prefill, Round, Reply, Idle, Bye,
                                                  Error)}


def send(channel: Channel, msg) -> None:
    raw = as_message(msg)
    channel.send(raw.kind, raw.meta, **raw.tensors)


def send_all(channel: Channel, msgs: list) -> None:
    """`msgs` in one frame (a batch's Rounds, their Replies): the peer's recv returns them one by one."""
    channel.send_all([as_message(msg) for msg in msgs])


def as_message(msg) -> Message:
    """A message dataclass as the frame's kind, JSON meta and tensors."""
    meta, tensors = {}, {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f.name] = value
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):  # Hellos
            meta[f.name] = [dataclasses.asdict(v) for v in value]
        elif dataclasses.is_dataclass(value):  # Request.params
            meta[f.name] = dataclasses.asdict(value)
        elif value is not None:
            meta[f.name] = value
    return Message(type(msg).__name__.lower(), meta, tensors)


def recv(channel: Channel, *expect: type):
    """The next message, which must be one of `expect` (Channel.recv turns an Error from the peer or
    another kind into a PeerError line); a message missing a field is one too."""
    raw = channel.recv(tuple(cls.__name__.lower() for cls in expect))
    try:
        return MESSAGES[raw.kind](**raw.meta, **raw.tensors)
    except TypeError:
        raise PeerError(f"protocol error: a {raw.kind!r} message with fields {sorted({**raw.meta, **raw.tensors})}; "
                        "are all ranks the same Tandem version?") from None
