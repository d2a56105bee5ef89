"""Incremental detokenisation with stop strings, for streaming.

Text is emitted as soon as it is final: a token that ends inside a multi-byte
character (decoded as U+FFFD) is held back, and so is any tail that could be
the start of a stop string::

    generated  "Hello wor"   stop ["world"]
    emitted    "Hello "      held "wor" (could become "world")

Each token costs the same whatever the length so far (a 32k-token answer is linear, not
quadratic) and whatever the stop strings' lengths: only a window of the latest tokens is
decoded, and the stop strings are matched over the new text alone, each carrying its
state from the text before (``StopMatcher``, below)::

    token ids  ... | prefix_at ... read_at | new ids
                     decoded once for context: the new text is what decoding the new ids
                     adds to it (vLLM's detokenize_incrementally: a tokenizer may write a
                     token's text differently at the start of a sequence)
    text       ... | the new text, fed to the stop matcher

``StopMatcher`` finds the stop strings as the text arrives: Knuth-Morris-Pratt, one state per stop string.
Each stop string keeps the length of the longest tail of the text so far that is a prefix of it (its
state); a new character extends that tail or falls back along the string's failure table::

    stop      "abab"         failure [0, 0, 1, 2]   (the longest proper border of stop[: i + 1])
    text      "... x a b a"  state 3: "aba" may begin the stop, so those 3 characters are held back
    + "b"                    state 4 = len(stop): the stop ends here and began 3 characters before

The text is looked at once, in the order it arrives: a token costs time linear in the characters it adds
(amortised over the generation: a state falls back at most as far as it rose), whatever the stop strings'
lengths, and memory is one table of len(stop) integers per stop string, not every prefix of it.
"""

from __future__ import annotations

from collections.abc import Callable


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


def failure_table(stop: str) -> list[int]:
    """``table[i]``: the length of the longest proper prefix of ``stop[: i + 1]`` that is also its suffix."""
    table = [0] * len(stop)
    border = 0
    for i in range(1, len(stop)):
        while border and stop[i] != stop[border]:
            border = table[border - 1]
        if stop[i] == stop[border]:
            border += 1
        table[i] = border
    return table


class StopMatcher:
    """Where the first stop string begins in a generated text fed in pieces, and how much of its tail to hold."""

    def __init__(self, stops: list[str]) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string must not be empty")
        self._stops = stops
        self._failures = [failure_table(stop) for stop in stops]
        self._states = [0] * len(stops)
        self.num_scanned = 0  # characters stepped, one per stop string: linear in the text's length

    @property
    def num_held(self) -> int:
        """The longest tail of the text so far that may still begin a stop string (never a whole one)."""
        return max(self._states, default=0)

    def find(self, piece: str) -> int | None:
        """Feed the next ``piece`` of text; the start, counted from the start of ``piece`` (negative: it began
        in earlier text), of the stop string that begins first among those ending in ``piece``, else None.

        Once it returns a start the text is over: later calls see states past that stop.
        """
        earliest: int | None = None
        for s, stop in enumerate(self._stops):
            failure, state = self._failures[s], self._states[s]
            for i, char in enumerate(piece):
                while state and stop[state] != char:
                    state = failure[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):  # this stop's first end in the piece: its earliest start there
                    start = i + 1 - len(stop)
                    earliest = start if earliest is None else min(earliest, start)
                    break
            self._states[s] = state
            self.num_scanned += len(piece)
        return earliest
