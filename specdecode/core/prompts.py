"""Turn a user's prompt into token ids: the chat template for chat models, or raw text.

Left out: system prompts and multi-turn conversations given on the command line (the
Python API takes a list of messages for those).
"""

from __future__ import annotations

from specdecode.errors import SpecDecodeError


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool = True) -> list[int]:
    """Token ids of the prompt; with chat=True (and a template) the model's chat format."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not messages or not all(str(m.get("content", "")).strip() for m in messages):
        raise SpecDecodeError("the prompt is empty")
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    if not isinstance(prompt, str):
        raise SpecDecodeError("a list of messages needs a chat model (or chat=True)")
    return tokenizer.encode(prompt, add_special_tokens=True)


def check_fits(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    if prompt_len >= context_len:
        raise SpecDecodeError(f"the prompt has {prompt_len} tokens; the model's context holds {context_len}")
    if max_new_tokens < 0:
        raise SpecDecodeError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
