"""The names a front end chooses from (targets, drafters) and the checks on a request's
drafting arguments that need no model, so that a bad flag fails in milliseconds, before
torch or any model loads. Imports nothing heavy.
"""

from __future__ import annotations

from specdecode.errors import SpecDecodeError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DRAFTERS = ("draft-model", "prompt-lookup", "hybrid", "medusa", "draft-tree", "eagle")
TREE_DRAFTERS = ("medusa", "eagle", "draft-tree")
# Weights and activations: float dtypes, and quantized weights (bf16 activations) run on
# GGUF blocks: "gguf" the file's own types, "q8_0" and "q4_0" a float model quantized.
DTYPES = ("bf16", "fp32", "gguf", "q8_0", "q4_0")
DTYPE_ALIASES = ("bfloat16", "float32")  # torch's names for bf16 and fp32
DTYPE_HELP = ("bf16 (default), fp32, or quantized weights: gguf (the GGUF file's own blocks), "
              "q8_0 or q4_0 (a float model quantized at load)")


def check_request(drafter: str | None, draft: str | None, k: int | str | None, profile: str | None,
                  category: str | None, heads: str | None = None, dtype: str | None = None) -> None:
    """Every check on a request's drafting arguments (and dtype) that needs no model: fails
    in milliseconds, before anything loads."""
    if dtype is not None and dtype.lower() not in DTYPES + DTYPE_ALIASES:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if drafter is not None and drafter not in DRAFTERS:
        raise SpecDecodeError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    if isinstance(k, bool) or not (k is None or k == "auto" or isinstance(k, int)):
        raise SpecDecodeError(f"k must be a number or 'auto', got {k!r}")
    if isinstance(k, int) and k < 1:
        raise SpecDecodeError(f"the draft length k must be >= 1, got {k}")
    if profile is not None:
        if k is not None:
            raise SpecDecodeError("pass --k or --profile, not both: the profile chooses k")
        return
    if category is not None:
        raise SpecDecodeError("--category selects a category of a --profile")
    if drafter is None and draft is None:
        if heads is not None:
            raise SpecDecodeError("--heads goes with --drafter medusa or eagle")
        if k is not None:
            raise SpecDecodeError("--k needs a drafter (--draft, --drafter or --profile)")
        return
    name = drafter or "draft-model"
    if draft is not None and name not in ("draft-model", "draft-tree", "hybrid"):
        raise SpecDecodeError(f"--draft names a draft model; it does not go with the {name} drafter")
    if heads is not None and name not in ("medusa", "eagle"):
        raise SpecDecodeError("--heads/--head goes with --drafter medusa or eagle")
    if k is not None and name in TREE_DRAFTERS:
        raise SpecDecodeError(f"--k does not apply to {name}: it verifies a tree chosen from measured acceptance")
    if k is not None and name == "hybrid":
        raise SpecDecodeError("--k does not apply to the hybrid drafter: copies go up to 8 tokens and the "
                              "draft model's k adapts")

# Chain drafters `tune` measures (trees are shaped when trained); the hybrid is probed after its parts.
HYBRID = "hybrid"
TUNABLE = ("draft-model", "prompt-lookup", HYBRID)
BENCH_METHODS = ("draft-model", "prompt-lookup", "hybrid", "adaptive", "tuned", "medusa", "draft-tree", "eagle")

PEER_LOOKUP_K = 10  # the bench peers' prompt-lookup length when ours adapts (llama-cpp-python's default)
