"""Drafters: anything that proposes the next few tokens for the target to verify."""

from .base import Drafter, Proposal
from .draft_model import DraftModel, check_same_tokenizer
from .prompt_lookup import PromptLookup

__all__ = ["Drafter", "Proposal", "DraftModel", "PromptLookup", "check_same_tokenizer"]
