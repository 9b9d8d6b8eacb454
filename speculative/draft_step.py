"""The drafter's single-token step over static buffers, eager or replayed from a CUDA graph, for a batch of rows.

Everything the step reads or writes lives in a buffer allocated once: the input tokens, the cache and
its device-side lengths, the round's step counter, the temperatures, the output tokens and (when
sampling) the draft distributions and their noise. So the K steps of a round are K replays with no
host round trip, and the K tokens come back with one copy. On CPU the very same `_step` runs eagerly.

Rows (serve.max_concurrent): one step drafts for B requests at once, row b in cache slot rows[b] at that
slot's own position, so the drafter's weights are read once per step for all of them. Buffers are sized for
every slot; a batch uses their first B rows. Each slot keeps its own temperature and noise generator
(`configure(..., slot)`), so a seeded request drafts the same tokens alone or among others.

Greedy and sampled drafting are two variants of the step (argmax vs Gumbel-max over the top-k; a batch with
any sampled row runs the sampled one, its greedy rows taking the argmax); on CUDA each (variant, batch size)
is captured once, the first time it is used.
"""
from __future__ import annotations

import torch

from speculative.verify import MIN_TEMPERATURE

MaybeTensor = torch.Tensor | None


class DraftStep:
    def __init__(self, stage, max_k: int, top_k: int, use_graph: bool, static_shapes: bool | None = None):
        dev = stage.device
        slots = stage.cache.num_slots
        self.stage = stage
        self.top_k = top_k
        self.max_k = max_k
        # per slot, set by `configure` when its request starts: 0 = greedy
        self.slot_temperature = [0.0] * slots
        self.generators = [torch.Generator(device=dev) for _ in range(slots)]
        # per row of the batch being drafted
        self.temperature = torch.ones(slots, dtype=torch.float32, device=dev)
        self.greedy = torch.zeros(slots, dtype=torch.bool, device=dev)  # greedy rows of a sampled batch
        self.token = torch.zeros((slots, 1), dtype=torch.long, device=dev)  # the token each row's next step consumes
        self.step_idx = torch.zeros(1, dtype=torch.long, device=dev)  # which output column the step writes
        self.out_tokens = torch.zeros((slots, max_k), dtype=torch.long, device=dev)
        self.out_q_ids = torch.zeros((slots, max_k, top_k), dtype=torch.long, device=dev)
        self.out_q_probs = torch.zeros((slots, max_k, top_k), dtype=torch.float32, device=dev)
        self.noise = torch.full((slots, max_k, top_k), 0.5, dtype=torch.float32, device=dev)
        self.rows: dict[int, torch.Tensor] = {}  # batch size -> the slot of each row (static for its graph)
        self.rows_set: dict[int, list[int]] = {}  # batch size -> the slots its rows buffer holds
        self.row_temperatures: list[float | None] = [None] * slots  # what `temperature` and `greedy` hold, per row
        # Eager steps attend over the live positions only (cheaper on CPU); a graph needs static shapes.
        self.use_graph = use_graph
        self.static_shapes = use_graph if static_shapes is None else static_shapes
        self.live = None
        self.graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}  # (sampling, batch size) -> its captured step

    def configure(self, temperature: float, seed: int, slot: int = 0) -> None:
        """A new request in `slot`: greedy (temperature 0) or sampled at `temperature`, noise seeded by `seed`."""
        self.slot_temperature[slot] = max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0
        if temperature > 0:
            self.generators[slot].manual_seed(seed)

    @torch.inference_mode()
    def _step(self, batch: int, sampling: bool, rows) -> None:
        """One token for each of the first `batch` rows; `rows`: their slots (a list when eager over one slot)."""
        logits = self.stage(self.token[:batch], num_logits=1, live=self.live, rows=rows)[:, -1]  # advances the lengths
        if sampling:
            # sample from the drafter's top-k at the given temperature with the Gumbel-max trick, so
            # the randomness is a buffer filled before the round (a graph cannot call the host RNG)
            values, ids = logits.topk(self.top_k)
            scores = (values - values[:, :1]) / self.temperature[:batch, None]  # top score 0: a tiny T cannot overflow
            gumbel = -torch.log(-torch.log(self.noise[:batch].index_select(1, self.step_idx)[:, 0]))
            choice = (scores + gumbel).argmax(-1, keepdim=True)
            token = torch.where(self.greedy[:batch, None], logits.argmax(-1, keepdim=True), ids.gather(1, choice))
            self.out_q_ids[:batch].index_copy_(1, self.step_idx, ids[:, None])
            self.out_q_probs[:batch].index_copy_(1, self.step_idx, torch.softmax(scores, -1)[:, None])
        else:
            token = logits.argmax(-1, keepdim=True)
        self.out_tokens[:batch].index_copy_(1, self.step_idx, token)
        self.token[:batch].copy_(token)
        self.step_idx.add_(1)

    def _capture(self, batch: int, sampling: bool) -> torch.cuda.CUDAGraph:
        cache = self.stage.cache
        lengths = cache.length.clone()
        rows = self.rows[batch]
        self.step_idx.zero_()
        stream = torch.cuda.Stream(device=self.token.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs allocate the step's workspaces off the main stream
            for _ in range(2):
                self._step(batch, sampling, rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.step_idx.zero_()
        with torch.cuda.graph(graph):
            self._step(batch, sampling, rows)
        cache.length.copy_(lengths)  # the warm-up steps wrote positions that the next round overwrites
        return graph

    def run(self, first_token: int, k: int, start: int, slot: int = 0) -> tuple[torch.Tensor, MaybeTensor, MaybeTensor]:
        """K steps of one slot from `first_token` written at position `start` (= the slot's length): drafts [k] and,
        when sampling, q ids/probs [k, top_k] (on CPU)."""
        tokens, q_ids, q_probs = self.run_rows([first_token], [k], [start], [slot])
        return tokens[0], None if q_ids is None else q_ids[0], None if q_probs is None else q_probs[0]

    def run_rows(self, first_tokens: list[int], ks: list[int], starts: list[int],
                 slots: list[int]) -> tuple[torch.Tensor, MaybeTensor, MaybeTensor]:
        """max(ks) batched steps, row b from first_tokens[b] written at starts[b] (= slot slots[b]'s length):
        drafts [B, max(ks)] and, when any row samples, q ids/probs [B, max(ks), top_k] (on CPU; row b's first ks[b]
        are its own)."""
        batch, k = len(slots), max(ks)
        sampling = any(self.slot_temperature[s] > 0 for s in slots)
        self.set_rows(slots, sampling)
        key = (sampling, batch)
        if self.use_graph and key not in self.graphs:
            self.graphs[key] = self._capture(batch, sampling)  # before the tokens are set: capture runs the step
        graph = self.graphs.get(key)
        if batch == 1:
            self.token[:1].fill_(first_tokens[0])  # no host-to-device copy (a sync on CUDA) for one request
        else:
            self.token[:batch].copy_(torch.tensor(first_tokens)[:, None])
        self.step_idx.zero_()
        if sampling:
            for b, slot in enumerate(slots):
                if self.slot_temperature[slot] > 0:
                    self.noise[b].uniform_(1e-12, 1.0, generator=self.generators[slot])
        # eager: the slots as a list, so the cache reads consecutive ones in order as a view, not a copy of each
        # row's live part in every layer (the tiny drafter's round of 4 drafts over four rows after 2,048 cached
        # tokens: 21.4-23.6 ms gathered, 14.7-15.5 as a view; bench/draft_context.py --rows 4, two runs); a graph
        # (or static shapes, its stand-in): the static rows it was captured over
        rows = self.rows[batch] if graph is not None or (self.static_shapes and batch > 1) else slots
        for i in range(k):
            if graph is not None:
                graph.replay()
            else:
                self.live = None if self.static_shapes else max(starts) + i + 1
                self._step(batch, sampling, rows)
        # copies, also on CPU (where .cpu() would alias): the next run overwrites these buffers while the
        # caller may still hold this round's drafts (draft_ahead runs before the reply is read)
        out = lambda t: t[:batch, :k].to("cpu", copy=True)  # noqa: E731
        if sampling:
            return out(self.out_tokens), out(self.out_q_ids), out(self.out_q_probs)
        return out(self.out_tokens), None, None

    def set_rows(self, slots: list[int], sampling: bool) -> None:
        """The batch's slots, temperatures and greedy rows into the static buffers (outside any graph); copied to
        the device only when they changed (the same streams draft round after round)."""
        batch = len(slots)
        if batch not in self.rows:
            self.rows[batch] = torch.zeros(batch, dtype=torch.long, device=self.token.device)
        if self.rows_set.get(batch) != slots:
            self.rows[batch].copy_(torch.tensor(slots))
            self.rows_set[batch] = list(slots)
        temperatures = [self.slot_temperature[s] for s in slots]
        if sampling and self.row_temperatures[:batch] != temperatures:  # one buffer for every batch size
            self.temperature[:batch].copy_(torch.tensor([t or 1.0 for t in temperatures]))
            self.greedy[:batch].copy_(torch.tensor([t == 0 for t in temperatures]))
            self.row_temperatures[:batch] = temperatures
