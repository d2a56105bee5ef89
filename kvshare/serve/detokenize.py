"""Incremental detokenisation with stop strings, for streaming.

Text is emitted as soon as it is final: a token that ends inside a multi-byte
character (decoded as U+FFFD) is held back, and so is any tail that could be
the start of a stop string::

    generated  "Hello wor"   stop ["world"]
    emitted    "Hello "      held "wor" (could become "world")

Each token costs the same whatever the length so far (a 32k-token answer is linear, not
quadratic) and whatever the stop strings' lengths: only a window of the latest tokens is
decoded, and the stop strings are matched over the new text alone, each carrying its
state from the text before (kvshare.serve.stop_strings)::

    token ids  ... | prefix_at ... read_at | new ids
                     decoded once for context: the new text is what decoding the new ids
                     adds to it (vLLM's detokenize_incrementally: a tokenizer may write a
                     token's text differently at the start of a sequence)
    text       ... | the new text, fed to the stop matcher
"""

from __future__ import annotations

from collections.abc import Callable

from kvshare.serve.stop_strings import StopMatcher


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self._decode = decode
        self._stops = StopMatcher(stops)
        self._token_ids: list[int] = []
        self._prefix_at = 0  # first token id of the context window
        self._read_at = 0  # token ids before this are in self.text
        self._emitted = 0  # characters of the final text already handed out
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
        self.text += new_text
        at = self._stops.find(new_text)
        if at is not None:
            self.text = self.text[: len(self.text) - len(new_text) + at]
            self.is_stopped = True
            return self._take(len(self.text))
        return self._take(len(self.text) - self._stops.num_held)

    @property
    def num_scanned(self) -> int:
        """Characters the stop search has stepped, one per stop string (linear in the text's length)."""
        return self._stops.num_scanned

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
