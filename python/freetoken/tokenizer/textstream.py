"""Token ids to text, incrementally: UTF-8 reassembly across tokens and stop strings."""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["StopFilter", "TextStream"]


class StopFilter:
    """Holds back text that may be the start of a stop string; cuts at the first one found."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string found

    def feed(self, text: str) -> str:
        """Adds text; returns what is certainly before any stop string."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits)
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        """Ends the text: returns what was held back (nothing once a stop string was seen)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class TextStream:
    """Pieces (bytes) in, text out: a character split across tokens is emitted once whole,
    and text is cut at the first stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopFilter(stops)

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared; no more text follows."""
        return self._stops.stopped

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched

    def feed(self, piece: bytes) -> str:
        """Adds one token's bytes; returns the text that can be emitted now."""
        return self._stops.feed(self._utf8.decode(piece))

    def finish(self) -> str:
        """Ends the stream; returns the text still held back."""
        tail = self._stops.feed(self._utf8.decode(b"", final=True))
        return tail + self._stops.flush()
