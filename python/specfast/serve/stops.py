"""Stop strings in a reply's text: the whole reply cut at the first (`cut_at_stop`), and a
stream that holds back what could still become one (`StopHold`)."""

from __future__ import annotations


def cut_at_stop(text: str, stops: list[str]) -> str:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text


class StopHold:
    """Streams text while holding back what could still become a stop string."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent = stops, "", 0
        self.hold = max(map(len, stops), default=1) - 1

    def add(self, delta: str) -> str:
        self.text += delta
        safe = cut_at_stop(self.text, self.stops)
        end = len(safe) if len(safe) < len(self.text) else len(self.text) - self.hold
        return self._take(end)

    def rest(self, final: str) -> str:
        self.text = final
        return self._take(len(final))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
