"""The drafter's single-token step over static buffers, eager or replayed from a CUDA graph.

Everything the step reads or writes lives in a buffer allocated once: the input token, the cache and
its device-side length, the round's step counter, the temperature, the output tokens and (when
sampling) the draft distributions and their noise. So the K steps of a round are K replays with no
host round trip, and the K tokens come back with one copy. On CPU the very same `_step` runs eagerly.

Greedy and sampled drafting are two variants of the step (argmax vs Gumbel-max over the top-k); each
request picks one, and on CUDA each is captured once, the first time it is used.
"""
from __future__ import annotations

import torch

from speculative.verify import MIN_TEMPERATURE


class DraftStep:
    def __init__(self, stage, max_k: int, top_k: int, use_graph: bool, static_shapes: bool | None = None):
        dev = stage.device
        self.stage = stage
        self.top_k = top_k
        self.sampling = False  # the variant the next steps run; set per request by `configure`
        self.generator = torch.Generator(device=dev)
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.token = torch.zeros((1, 1), dtype=torch.long, device=dev)  # the token the next step consumes
        self.step_idx = torch.zeros(1, dtype=torch.long, device=dev)  # which output row the step writes
        self.out_tokens = torch.zeros(max_k, dtype=torch.long, device=dev)
        self.out_q_ids = torch.zeros((max_k, top_k), dtype=torch.long, device=dev)
        self.out_q_probs = torch.zeros((max_k, top_k), dtype=torch.float32, device=dev)
        self.noise = torch.full((max_k, top_k), 0.5, dtype=torch.float32, device=dev)
        # Eager steps attend over the live slots only (cheaper on CPU); a graph needs static shapes.
        self.use_graph = use_graph
        self.static_shapes = use_graph if static_shapes is None else static_shapes
        self.live = None
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # sampling -> its captured step

    def configure(self, temperature: float, seed: int) -> None:
        """A new request: greedy (temperature 0) or sampled at `temperature`, noise seeded by `seed`."""
        self.sampling = temperature > 0
        if self.sampling:
            self.temperature.fill_(max(temperature, MIN_TEMPERATURE))
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def _step(self) -> None:
        logits = self.stage(self.token, num_logits=1, live=self.live)[0, -1]  # advances the cache length in place
        if self.sampling:
            # sample from the drafter's top-k at the given temperature with the Gumbel-max trick, so
            # the randomness is a buffer filled before the round (a graph cannot call the host RNG)
            values, ids = logits.topk(self.top_k)
            scores = (values - values[:1]) / self.temperature  # the top score 0: a tiny T cannot overflow to inf
            gumbel = -torch.log(-torch.log(self.noise.index_select(0, self.step_idx)[0]))
            choice = (scores + gumbel).argmax(-1, keepdim=True)
            token = ids.gather(0, choice)
            self.out_q_ids.index_copy_(0, self.step_idx, ids[None])
            self.out_q_probs.index_copy_(0, self.step_idx, torch.softmax(scores, -1)[None])
        else:
            token = logits.argmax(-1, keepdim=True)
        self.out_tokens.index_copy_(0, self.step_idx, token)
        self.token.copy_(token.view(1, 1))
        self.step_idx.add_(1)

    def _capture(self) -> torch.cuda.CUDAGraph:
        cache = self.stage.cache
        start = int(cache.length)
        self.step_idx.zero_()
        stream = torch.cuda.Stream(device=self.token.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs allocate the step's workspaces off the main stream
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.step_idx.zero_()
        with torch.cuda.graph(graph):
            self._step()
        cache.rewind(start)  # the warm-up steps wrote slots that the next round overwrites
        return graph

    def run(self, first_token: int, k: int, start: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """K steps from `first_token` written at slot `start` (= the cache length): drafts [k] and, when
        sampling, q ids/probs [k, top_k] (on CPU)."""
        if self.use_graph and self.sampling not in self.graphs:
            self.graphs[self.sampling] = self._capture()  # before the buffers are set: capture runs the step
        graph = self.graphs.get(self.sampling)
        self.token.fill_(first_token)
        self.step_idx.zero_()
        if self.sampling:
            self.noise.uniform_(1e-12, 1.0, generator=self.generator)
        for i in range(k):
            if graph is not None:
                graph.replay()
            else:
                self.live = None if self.static_shapes else start + i + 1
                self._step()
        # copies, also on CPU (where .cpu() would alias): the next run overwrites these buffers while the
        # caller may still hold this round's drafts (draft_ahead runs before the reply is read)
        out = lambda t: t[:k].to("cpu", copy=True)  # noqa: E731
        if self.sampling:
            return out(self.out_tokens), out(self.out_q_ids), out(self.out_q_probs)
        return out(self.out_tokens), None, None
