"""A generation's text as it grows, in deltas a stream can send.

Tokens do not map to whole characters and a stop string may arrive split over rounds, so
each time the whole text is decoded and cut before any stop string, and the delta is
what lies past the text already sent, holding back an incomplete character and a tail
that could still begin a stop string. The last call sends the rest.
"""

from __future__ import annotations

from typing import Sequence

from specdecode.core.stopping import StopCondition


class TextDeltas:
    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = tuple(stop_strings)
        self.stop = StopCondition(stop_strings=self.stop_strings, tokenizer=tokenizer)
        self.tokens: list[int] = []
        self.sent = 0  # characters already sent

    def text(self) -> str:
        return self.stop.cut_text(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        self.tokens.extend(tokens)
        text = self.text()
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                return ""
            hold = max((len(s) - 1 for s in self.stop_strings), default=0)
            for i in range(max(self.sent, end - hold), end):  # a tail that may begin a stop string waits
                if any(s.startswith(text[i:]) for s in self.stop_strings):
                    end = i
                    break
        delta, self.sent = text[self.sent:end], end
        return delta
