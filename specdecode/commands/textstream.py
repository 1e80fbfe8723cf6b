"""Turn a growing list of token ids into text deltas for printing.

Tokens do not map to whole characters (a multi-byte character can span tokens), so the
whole generated text is decoded each time and only the part past what was already shown
is returned, holding back a trailing incomplete character.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = 0  # characters already returned

    def add(self, tokens) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self.shown = text[self.shown:], len(text)
        return delta
