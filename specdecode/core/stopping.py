"""When generation ends: an end-of-turn token, a stop string, or the token budget.

Speculative rounds emit several tokens at once, so the check takes the whole list of
new tokens and says how many of them to keep. A stop string may span rounds and token
boundaries, so it is searched in the decoded text of everything generated; the tokens
are kept up to and including the one that completes it (the text is cut before it).

Left out: stop token sequences given as ids, and regexes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class StopCondition:
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    max_new_tokens: int = 256
    tokenizer: object = field(default=None, compare=False)  # needed only for stop strings

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise SpecDecodeError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise SpecDecodeError("stop strings must be non-empty")
        if self.stop_strings and self.tokenizer is None:
            raise SpecDecodeError("stop strings need a tokenizer to decode the generated text")

    def check(self, new_tokens: Sequence[int], num_checked: int) -> tuple[int, str | None]:
        """Given all new tokens (of which the first num_checked were checked before), return
        (how many to keep, reason) where reason is 'eos', 'stop', 'length' or None (go on)."""
        for i in range(num_checked, len(new_tokens)):
            if new_tokens[i] in self.eos_token_ids:
                return i + 1, "eos"
        if self.stop_strings:
            keep = self._stop_string_end(new_tokens, num_checked)
            if keep is not None:
                return keep, "stop"
        if len(new_tokens) >= self.max_new_tokens:
            return self.max_new_tokens, "length"
        return len(new_tokens), None

    def _stop_string_end(self, new_tokens: Sequence[int], num_checked: int) -> int | None:
        text = self.tokenizer.decode(list(new_tokens))
        if not any(s in text for s in self.stop_strings):
            return None
        # The shortest prefix of tokens whose text holds a stop string; earlier rounds held none.
        for n in range(max(num_checked, 1), len(new_tokens) + 1):
            prefix = self.tokenizer.decode(list(new_tokens[:n]))
            if any(s in prefix for s in self.stop_strings):
                return n
        return len(new_tokens)

    def cut_text(self, text: str) -> str:
        """The text before the first stop string, if any."""
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text
