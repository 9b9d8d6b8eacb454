"""What rank 0 does with tokens the target accepted: stop on EOS, at max_new_tokens or on a stop
string, and stream the text without ever printing half a multi-byte character. The text is decoded a few
tokens at a time (Detokenizer), so a round costs text work in proportion to its new tokens, not to the answer."""
from __future__ import annotations

import sys

PARTIAL = "\ufffd"  # how a decode shows a character whose bytes have not all arrived


class Detokenizer:
    """The text of a growing list of tokens, exactly tokenizer.decode(tokens, skip_special_tokens=True), decoded
    incrementally as vLLM and the tokenizers library's DecodeStream do: each new token is decoded in a window
    that starts with the tokens of the last step that added text (the context), and the new text is what the
    window's text has beyond the context's. The context is what a token's text depends on: the earlier bytes of
    a character split over byte tokens, or the leading space a SentencePiece tokenizer strips only from the
    first token it decodes. A token costs a decode of a few tokens, whatever the length of the text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.skipped = skipped_ids(tokenizer)
        self.tokens: list[int] = []  # every token but those skipped (needed only to start over, see _resync)
        self.window: list[int] = []  # the context, then the tokens since
        self.read = 0  # window[:read] is the context ...
        self.context = ""  # ... and this its text
        self.whole = ""  # the text up to the window's end when it ends on a whole character, else up to the context's
        self.pending = ""  # the text after `whole`: ends in PARTIAL while a character waits for its other bytes
        # per token: the length of decode(tokens[:n + 1]) when those tokens end on a whole character, else None
        self.ends: list[int | None] = []

    def text(self) -> str:
        return self.whole + self.pending if self.pending else self.whole

    def since(self, start: int) -> str:
        """text()[start:], without building the whole text."""
        if start >= len(self.whole):
            return self.pending[start - len(self.whole):]
        return self.whole[start:] + self.pending

    def add(self, token: int) -> None:
        if token not in self.skipped:  # decode skips it wherever it stands: it never changes the text
            self.tokens.append(token)
            self.window.append(token)
            self._step()
        self.ends.append(None if self.pending else len(self.whole))

    def _step(self) -> None:
        text = self._decode(self.window)
        if not text.startswith(self.context):  # this tokenizer's text for earlier tokens changed with a later one
            self._resync()
            return
        new = text[len(self.context):]
        if not new or new.endswith(PARTIAL):  # half a character (or nothing yet): the window grows until it is whole
            self.pending = new
            return
        self.whole += new
        self.pending = ""
        self.window = self.window[self.read:]  # the next context: the tokens that just added text
        self.read = len(self.window)
        self.context = self._decode(self.window)

    def _resync(self) -> None:
        """Decode everything once more and take the newest token as the context: for a tokenizer whose decode
        is not stable under appending (one that cleans up spaces around punctuation); never for byte-level BPE."""
        text = self._decode(self.tokens)
        cut = len(text) - 1 if text.endswith(PARTIAL) else len(text)
        self.whole, self.pending = text[:cut], text[cut:]
        self.window, self.read = self.window[-1:], 1
        self.context = self._decode(self.window)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def skipped_ids(tokenizer) -> set[int]:
    """The tokens decode(skip_special_tokens=True) drops: a fast tokenizer's added tokens marked special. Any
    other tokenizer: none (each token is then decoded, which is still exact)."""
    if not hasattr(tokenizer, "backend_tokenizer"):
        return set()
    return {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}


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
        self._text = Detokenizer(tokenizer) if tokenizer is not None else None
        # a stop string that the newest token completes begins at most this far before the text it added
        self._stop_reach = max(map(len, stop), default=1) - 1

    def text(self) -> str | None:
        return None if self._text is None else self._text.text()

    def text_end(self, n: int) -> int | None:
        """The length of the text of the first n tokens (a prefix of text()), or None when the n-th ends within
        a character."""
        return self._text.ends[n - 1] if n else 0

    def commit(self, new_tokens: list[int]) -> int:
        """Append tokens one by one until a stop; returns how many were kept."""
        kept = 0
        for token in new_tokens:
            if self.done:
                break
            self.tokens.append(token)
            kept += 1
            stopped = self._add_text(token)
            if token in self.eos_ids:
                self.stop_reason = "eos"
            elif len(self.tokens) >= self.max_new_tokens:
                self.stop_reason = "max_new_tokens"
            elif stopped:
                self.stop_reason = "stop_string"
            self.done = self.stop_reason is not None
        self._stream()
        return kept

    def _add_text(self, token: int) -> bool:
        """Decode the token into the text; whether the text now holds a stop string. Only the text this token
        added and the few characters before it are searched: an earlier stop string would have stopped earlier."""
        if self._text is None:
            return False
        start = max(0, len(self._text.whole) - self._stop_reach)  # `pending` may change: searched again
        self._text.add(token)
        if not self.stop:
            return False
        tail = self._text.since(start)
        return any(s in tail for s in self.stop)

    def keep_logprobs(self, chosen, top_ids, top) -> None:
        """The log-probabilities a Reply carries for the tokens commit() just kept (the first len(chosen))."""
        for lp, ids, lps in zip(chosen.tolist(), top_ids.tolist(), top.tolist()):
            self.logprobs.append((lp, list(zip(ids, lps))))

    def _stream(self) -> None:
        if not self.stream:
            return
        text = self._text.text() if self.done else self._text.whole  # until the end, no half character
        try:
            sys.stdout.write(text[self._printed:] + ("\n" if self.done else ""))
            sys.stdout.flush()
        except BrokenPipeError:  # the reader closed stdout (`| head`): a normal end, like a stop string
            self.stop_reason, self.done, self.stream = "stdout_closed", True, False
            return
        self._printed = len(text)
