"""A reply's text as it streams: detokenized pieces in, client-safe text out, stop strings found.

Invariant: the text handed out never contains the start of a stop match. Only the longest tail
that could still begin a stop string is held back; everything before it is final. On a match
the reply ends before the match, and the matched text is never handed out, even when the match
spans several tokens or streamed chunks.
"""


class ReplyText:
    def __init__(self, detokenizer, stop: tuple[str, ...] = ()):
        self.detokenizer = detokenizer
        self.stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, token_id: int) -> str:
        """Text made final by this token; sets `stopped` when a stop string completes."""
        return self._feed(self.detokenizer.push(token_id))

    def finish(self) -> str:
        """The rest of the text, once no more tokens will come."""
        if self.stopped:
            return ""
        text = self._feed(self.detokenizer.flush())
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    def _feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        if not self.stop:
            self._held = ""
            return text
        found = [(i, n, s) for n, s in enumerate(self.stop) if (i := text.find(s)) >= 0]
        cut = min(found)[0] if found else -1
        if cut >= 0:
            self.stopped = True
            self.matched = min(found)[2]  # the stop string that ended the reply
            self._held = ""
            return text[:cut]
        keep = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
