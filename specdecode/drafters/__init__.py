"""Drafters: anything that proposes the next few tokens for the target to verify."""

from specdecode.drafters.base import Drafter, Proposal, TreeDrafter, TreeProposal
from specdecode.drafters.draft_model import DraftModel, check_same_tokenizer
from specdecode.drafters.prompt_lookup import PromptLookup

__all__ = ["Drafter", "Proposal", "DraftModel", "PromptLookup", "check_same_tokenizer"]
