"""Incremental detokenisation with stop strings, for streaming.

Text is emitted as soon as it is final: a token that ends inside a multi-byte
character (decoded as U+FFFD) is held back, and so is any tail that could be
the start of a stop string::

    generated  "Hello wor"   stop ["world"]
    emitted    "Hello "      held "wor" (could become "world")

Each token costs the same whatever the length so far (a 32k-token answer is linear, not
quadratic): only a window of the latest tokens is decoded, and a stop string is searched
for only in the text it could newly end in::

    token ids  ... | prefix_at ... read_at | new ids
                     decoded once for context: the new text is what decoding the new ids
                     adds to it (vLLM's detokenize_incrementally: a tokenizer may write a
                     token's text differently at the start of a sequence)
    text       ... searched | the last len(stop) - 1 characters before the new text + the new text
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self._decode = decode
        self._stops = stops
        self._longest_stop = max((len(s) for s in stops), default=0)
        self._stop_prefixes = {stop[:k] for stop in stops for k in range(1, len(stop))}
        self._token_ids: list[int] = []
        self._prefix_at = 0  # first token id of the context window
        self._read_at = 0  # token ids before this are in self.text
        self._emitted = 0  # characters of the final text already handed out
        self.num_scanned = 0  # characters the stop search has looked at (linear in the text's length)
        self.text = ""
        self.is_stopped = False

    def add(self, token_id: int) -> str:
        """Append one token; returns the newly final text (maybe empty, and always empty once stopped)."""
        if self.is_stopped:
            return ""
        self._token_ids.append(token_id)
        new_text = self._new_text()
        if not new_text:  # the token ends inside a character (or adds none): nothing can have changed
            return ""
        searched_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += new_text
        window = self.text[searched_from:]
        self.num_scanned += len(window)
        found = [at for at in (window.find(stop) for stop in self._stops) if at >= 0]
        if found:
            self.text = self.text[: searched_from + min(found)]
            self.is_stopped = True
            return self._take(len(self.text))
        for k in range(min(self._longest_stop - 1, len(self.text)), 0, -1):  # the longest tail a stop may start
            if self.text[-k:] in self._stop_prefixes:
                return self._take(len(self.text) - k)
        return self._take(len(self.text))

    def finish(self) -> str:
        """Whatever was held back, at the end of generation (with a character left incomplete, as U+FFFD)."""
        if self._read_at < len(self._token_ids) and not self.is_stopped:
            self.text += self._decode(self._token_ids[self._prefix_at :])[len(self._context()) :]
            self._read_at = len(self._token_ids)
        return self._take(len(self.text))

    def _context(self) -> str:
        return self._decode(self._token_ids[self._prefix_at : self._read_at])

    def _new_text(self) -> str:
        """The text the ids from ``_read_at`` add after the context window; "" while it ends in U+FFFD."""
        context = self._context()
        text = self._decode(self._token_ids[self._prefix_at :])
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return ""
        self._prefix_at, self._read_at = self._read_at, len(self._token_ids)
        return text[len(context) :]

    def _take(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece = self.text[self._emitted : upto]
        self._emitted = upto
        return piece
