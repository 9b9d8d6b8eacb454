"""What rank 0 does with tokens the target accepted: stop on EOS, at max_new_tokens or on a stop
string, and stream the text without ever printing half a multi-byte character."""
from __future__ import annotations

import sys


class Output:
    def __init__(self, tokenizer, eos_ids: set[int], max_new_tokens: int, stop: list[str], stream: bool = False):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens
        self.stop = stop
        self.stream = stream and tokenizer is not None
        self.tokens: list[int] = []
        # when the request asks (Request.logprobs): per kept token, the target's log-probability of it and the
        # top alternatives there as (token, log-probability), most likely first
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.done = False
        self.stop_reason = None
        self._printed = 0
        # A stop string completed by the newest token lies within its last few tokens (a character
        # takes at most 4 byte-level tokens), so only that tail is decoded per token.
        self._stop_window = 4 * max(map(len, stop), default=0) + 4

    def text(self) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _tail(self) -> str:
        return self.tokenizer.decode(self.tokens[-self._stop_window:], skip_special_tokens=True)

    def commit(self, new_tokens: list[int]) -> int:
        """Append tokens one by one until a stop; returns how many were kept."""
        kept = 0
        for token in new_tokens:
            if self.done:
                break
            self.tokens.append(token)
            kept += 1
            if token in self.eos_ids:
                self.stop_reason = "eos"
            elif len(self.tokens) >= self.max_new_tokens:
                self.stop_reason = "max_new_tokens"
            elif self.stop and any(s in self._tail() for s in self.stop):
                self.stop_reason = "stop_string"
            self.done = self.stop_reason is not None
        self._stream()
        return kept

    def keep_logprobs(self, chosen, top_ids, top) -> None:
        """The log-probabilities a Reply carries for the tokens commit() just kept (the first len(chosen))."""
        for lp, ids, lps in zip(chosen.tolist(), top_ids.tolist(), top.tolist()):
            self.logprobs.append((lp, list(zip(ids, lps))))

    def _stream(self) -> None:
        if not self.stream:
            return
        text = self.text()
        if text.endswith("\ufffd") and not self.done:  # an incomplete UTF-8 sequence: wait for its rest
            return
        try:
            sys.stdout.write(text[self._printed:] + ("\n" if self.done else ""))
            sys.stdout.flush()
        except BrokenPipeError:  # the reader closed stdout (`| head`): a normal end, like a stop string
            self.stop_reason, self.done, self.stream = "stdout_closed", True, False
            return
        self._printed = len(text)
