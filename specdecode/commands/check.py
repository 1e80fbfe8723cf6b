"""`specdecode check`: does this configuration keep the target's output exactly?

Two checks on the configuration a user is about to deploy (target, drafter, k, dtype,
sampling flags), each against plain decoding of the same target:

1. Greedy: each prompt is decoded with and without speculation; the token lists must be
   identical. At the first difference the report gives both tokens and the target's
   margin there (the gap between its top two logits, recomputed by one pass over the
   prompt and the common prefix): a margin near 0 points at a rounding near-tie, a large
   one at a broken rule.
2. Sampled (temperature > 0): for each of a few prompts, N runs draw the first tokens
   with speculation (the engine, as deployed) and N without (plain sampling from the
   target), with independent random streams. Speculation is lossless when the joint
   distribution of the generated tokens is the target's, so the marginal distribution
   of the token at each generated position must be the same in both arms. Each position
   gets a chi-square test of homogeneity (rare tokens pooled, core/conformance.py) and
   the total variation distance between the two empirical distributions. Positions
   1..P are tested: position 0 is sampled from the prefill before any drafter takes
   part. A run that ends (end of turn) before a position counts as its own category
   there. The false-alarm rate alpha is family-wise: a test fails below
   alpha / (positions x prompts) (Bonferroni). A position where nearly every run emits
   one token leaves a single bin after pooling, and no test; the report says so.

The check passes when every greedy pair is identical and no p-value falls below the
threshold. A check whose speculative runs never drafted a token tested nothing; the
report says how many tokens were drafted and accepted. What the sampled check can see
depends on N and the prompt: at the defaults it catches gross errors (a rule that keeps
every draft fails at p < 1e-4 where drafts often miss), while a small bias needs many
more runs, the distance it can tell from noise shrinking as 1/sqrt(N).

Each sampled run needs only the first P + 1 tokens, so the runs stop there. The prompt's
prefill is computed once per prompt and shared by every sampled run (`SharedPrefill`):
the target's cache slots of the prompt are kept and only the slots after it are written
again, which gives each run exactly the logits and cache a fresh prefill gives (the
prefill is deterministic) at the cost of the decoding steps alone. The plain runs need
no engine: they are sampled REFERENCE_BATCH at a time, one target pass over a batch of
rows per position, each row from the target's distribution after its own tokens (run
by run through the engine where the model's cache is not the native KVCache).

`lossy_rule_for_testing` swaps a deliberately broken chain acceptance rule into the engine for
the duration of a check, so the tests can show the check catches one: "sampled" keeps
every draft token whatever the target's probability of it (the output then follows the
drafter where it drafts), "greedy" does the same against the target's argmax, "both" both.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Sequence
from unittest import mock

import torch
from tqdm import tqdm

from specdecode.api import load_model
from specdecode.commands.check_report import summary
from specdecode.core import engine
from specdecode.core.conformance import bonferroni, homogeneity
from specdecode.core.engine import decode
from specdecode.core.events import Round, collect
from specdecode.core.prompts import encode_prompt
from specdecode.core.sampling import SamplingConfig, logits_to_probs, sample
from specdecode.core.stopping import StopCondition
from specdecode.errors import SpecDecodeError
from specdecode.models.kv_cache import KVCache
from specdecode.options import DEFAULT_TARGET, check_request
from specdecode.plan import plan
from specdecode.questions import Question
from specdecode.suites import load_suite

DEFAULT_TEMPERATURE = 0.8
# Sized to take about 3 minutes with the Qwen pair on 2 cores (AVX2), where a speculative
# run costs about a second and a plain pass over 32 rows a few; SmolLM2 with prompt lookup
# takes well under a minute. More --samples and --sampled-prompts test more finely.
DEFAULT_GREEDY_TOKENS = 32
DEFAULT_SAMPLES = 100
DEFAULT_POSITIONS = 3
DEFAULT_ALPHA = 0.01
DEFAULT_SAMPLED_PROMPTS = 1
MIN_SAMPLES = 10
# The built-in prompts, one per kind, short ones (so the prefills cost little): prose,
# copy-heavy code, code from a signature, arithmetic. The sampled check takes the first
# --sampled-prompts of them. Prose comes first: a request whose first tokens vary from run
# to run and which drafters often miss. The first tokens of a code answer or of a chat
# model's "Certainly! ..." are nearly certain, which leaves a position test nothing to
# compare (Qwen2.5-Coder-1.5B, temperature 0.8, 64 runs: 9-19 distinct tokens at
# positions 0-3 for this poem, 2-5 for chat/01); and where drafts mostly hit (a story to
# continue, a sentence to rewrite) a rule that keeps every draft changes the output
# little, so no test sees it (SmolLM2 with prompt lookup, 100 runs: that rule fails this
# prompt at p < 1e-4 and passes on those two).
PROSE = Question("prose/sea-poem", "prose", ("Write a short poem about the sea.",))
BUILTIN_PROMPTS = (("code-edit", "code-edit/shutil.copyfileobj"), ("code-completion", "HumanEval/24"),
                   ("math", "math/01"))
END = -1  # the category of a position a run never reached (it ended first)
EXTRA_TOKENS = 16  # budget past the tested positions, so the stop never shortens a draft there
LOSSY_RULES = ("greedy", "sampled", "both")
REFERENCE_BATCH = 32  # plain runs sampled per target pass


@dataclass(frozen=True)
class CheckSettings:
    target: str = DEFAULT_TARGET
    draft: str | None = None
    drafter: str | None = None
    k: int | str | None = None
    heads: str | None = None
    profile: str | None = None
    dtype: str | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 0
    top_p: float = 1.0
    greedy_tokens: int = DEFAULT_GREEDY_TOKENS
    samples: int = DEFAULT_SAMPLES
    positions: int = DEFAULT_POSITIONS
    alpha: float = DEFAULT_ALPHA
    seed: int = 0
    sampled_prompts: int = DEFAULT_SAMPLED_PROMPTS

    def validate(self) -> None:
        """Every check that needs no model; raises SpecDecodeError with one line."""
        check_request(self.drafter, self.draft, self.k, self.profile, None, self.heads)
        if self.drafter is None and self.draft is None and self.profile is None:
            raise SpecDecodeError("check compares speculative with plain decoding: name a drafter "
                                  "(--draft, --drafter or --profile)")
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # raises on a bad value
        for flag, value, least in (("--greedy-tokens", self.greedy_tokens, 1), ("--samples", self.samples, MIN_SAMPLES),
                                   ("--positions", self.positions, 1),
                                   ("--sampled-prompts", self.sampled_prompts, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SpecDecodeError(f"{flag} must be an integer >= {least}, got {value!r}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 < self.alpha < 1.0):  # also rejects NaN
            raise SpecDecodeError(f"--alpha must be in (0, 1), got {self.alpha!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SpecDecodeError(f"--seed must be an integer, got {self.seed!r}")


def builtin_prompts() -> list[Question]:
    """PROSE, then the suites' questions of BUILTIN_PROMPTS (a suite's first question
    stands in for one this Python cannot build)."""
    prompts = [PROSE]
    for suite, question_id in BUILTIN_PROMPTS:
        questions = load_suite(suite)
        prompts.append(next((q for q in questions if q.question_id == question_id), questions[0]))
    return prompts


class SharedPrefill:
    """The target model with the prefill of the last prompt kept, for many short runs
    of one prompt. `new_cache` hands out the same cache again; a prefill (a pass at
    cache length 0 with no explicit positions or mask) of the same tokens with the same
    arguments as the last one then only moves the cache's length past the prompt, whose
    slots still hold its keys and values, and returns the same output. Later passes
    write the slots after the prompt, as they would in a fresh cache. Caches other than
    KVCache (the transformers adapter's) are not shared."""

    def __init__(self, model):
        self.model = model
        self._cache: KVCache | None = None
        self._key = None
        self._out = None
        self._length = 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def new_cache(self, batch_size: int = 1, max_len: int | None = None):
        cache = self._cache
        if (cache is not None and cache.batch_size == batch_size
                and (max_len is None or max_len <= cache.max_len)):
            cache.rewind(cache.length)
            return cache
        cache = self.model.new_cache(batch_size, max_len)
        self._cache, self._key = (cache, None) if isinstance(cache, KVCache) else (None, None)
        return cache

    def __call__(self, tokens: torch.Tensor, cache, **kwargs):
        if cache is not self._cache or cache.length != 0 or kwargs.get("positions") is not None \
                or kwargs.get("mask") is not None:
            return self.model(tokens, cache, **kwargs)
        key = (tuple(tokens.flatten().tolist()), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key == self._key:
            cache.advance(self._length)
            return self._out
        self._key = None
        out = self.model(tokens, cache, **kwargs)
        self._key, self._out, self._length = key, out, cache.length
        return out


def _fresh(k):
    """A draft-length policy starts each generation unobserved; an int is itself."""
    return k.fresh() if hasattr(k, "fresh") else k


def _describe_k(drafter, k) -> str:
    if drafter is not None and drafter.is_tree:
        return "tree"
    if isinstance(k, int):
        return str(k)
    return f"adaptive (up to {k.k_max})" if hasattr(k, "k_max") else type(k).__name__


# ---- deliberately lossy rules, for the tests ------------------------------------------

def _keep_every_draft_sampled(draft_tokens, draft_probs, target_probs, generator=None):
    """LOSSY: every draft token kept whatever the target thinks of it, then a bonus token."""
    k = draft_tokens.shape[0]
    return k, int(sample(target_probs[k], generator))


def _keep_every_draft_greedy(draft_tokens, target_tokens):
    """LOSSY: every draft token kept whether or not it is the target's argmax."""
    k = draft_tokens.shape[0]
    return k, int(target_tokens[k])


def _lossy_patches(which: str | None) -> list:
    if which is None:
        return []
    if which not in LOSSY_RULES:
        raise ValueError(f"lossy_rule_for_testing must be one of {LOSSY_RULES} or None, got {which!r}")
    patches = []
    if which in ("greedy", "both"):
        patches.append(mock.patch.object(engine, "greedy_chain", _keep_every_draft_greedy))
    if which in ("sampled", "both"):
        patches.append(mock.patch.object(engine, "rejection_chain", _keep_every_draft_sampled))
    return patches


# ---- the two checks --------------------------------------------------------------------

def _greedy_case(model, tokenizer, question: Question, ids: list[int], eos, drafter, k, tokens: int) -> dict:
    stop = StopCondition(eos, max_new_tokens=tokens)
    plain, _ = collect(decode(model, ids, stop, SamplingConfig(), None, 0))
    spec, done = collect(decode(model, ids, stop, SamplingConfig(), drafter, _fresh(k)))
    first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if first is None and len(plain) != len(spec):
        first = min(len(plain), len(spec))
    case = {"prompt": question.question_id, "category": question.category, "prompt_tokens": len(ids),
            "plain_tokens": len(plain), "speculative_tokens": len(spec), "identical": first is None,
            "first_mismatch": first, "drafted": done.stats.draft_tokens, "accepted": done.stats.accepted_tokens}
    if first is not None:
        plain_token = plain[first] if first < len(plain) else None
        spec_token = spec[first] if first < len(spec) else None
        context = ids + plain[:first]
        logits = model.model(torch.tensor([context]), model.model.new_cache(1, len(context) + 1),
                             num_logits=1).logits[0, -1]
        top = logits.topk(2).values.tolist()
        case.update(plain_token=plain_token, speculative_token=spec_token, margin=top[0] - top[1],
                    plain_text=None if plain_token is None else tokenizer.decode([plain_token]),
                    speculative_text=None if spec_token is None else tokenizer.decode([spec_token]))
    return case


def _first_tokens(model, ids, stop, sampling, drafter, k, generator, n: int) -> tuple[list[int], int, int]:
    """The first n generated tokens of one run (END where it ended sooner), and the
    tokens it drafted and accepted on the way."""
    tokens: list[int] = []
    drafted = accepted = 0
    events = decode(model, ids, stop, sampling, drafter, _fresh(k), generator)
    try:
        for event in events:
            if not isinstance(event, Round):
                break
            tokens += event.token_ids
            drafted += event.num_drafted
            accepted += event.num_accepted
            if len(tokens) >= n:
                break
    finally:
        events.close()
    return tokens[:n] + [END] * (n - len(tokens)), drafted, accepted


def _seed(seed: int, prompt_index: int, arm: int) -> int:
    """Distinct, reproducible streams for each (prompt, arm): the arms must be independent."""
    return (seed * 1_000_003 + prompt_index * 2 + arm) % (2 ** 63)


def _reference_runs(model: SharedPrefill, ids: list[int], eos, sampling: SamplingConfig, generator, runs: int,
                    n: int) -> list[list[int]] | None:
    """The first n tokens of `runs` runs of plain sampling from the target, REFERENCE_BATCH
    runs per pass: the prompt's keys and values are copied into a batch cache and each
    step samples every row's next token from the target's distribution after that row's
    own tokens. A token after an end-of-turn token is END, as in a run that stopped.
    None where the model's cache is not a KVCache (the caller then decodes run by run)."""
    cache = model.new_cache(1, len(ids) + n + 1)
    if not isinstance(cache, KVCache):
        return None
    out = model(torch.tensor([ids]), cache, num_logits=1, hidden_layers=())  # the engine's prefill call
    first = logits_to_probs(out.logits[0, -1], sampling)  # (V,)
    length = len(ids)
    result: list[list[int]] = []
    for start in range(0, runs, REFERENCE_BATCH):
        rows = min(REFERENCE_BATCH, runs - start)
        batch = model.model.new_cache(rows, length + n)
        batch.keys[:, :, :, :length] = cache.keys[:, :, :, :length]  # (layers, 1 -> rows, heads, slots, dim)
        batch.values[:, :, :, :length] = cache.values[:, :, :, :length]
        batch.advance(length)
        tokens = sample(first.expand(rows, -1).contiguous(), generator)  # (rows,)
        steps = [tokens]
        for _ in range(n - 1):
            logits = model.model(tokens[:, None], batch, num_logits=1).logits[:, -1]  # (rows, V)
            tokens = sample(logits_to_probs(logits, sampling), generator)
            steps.append(tokens)
        for run in torch.stack(steps, dim=1).tolist():  # (rows, n)
            end = next((i + 1 for i, token in enumerate(run) if token in eos), n)
            result.append(run[:end] + [END] * (n - end))
    return result


def _sampled_case(model, question: Question, index: int, ids: list[int], eos, drafter, k,
                  settings: CheckSettings, bar) -> tuple[list[dict], dict]:
    sampling = SamplingConfig(settings.temperature, settings.top_k, settings.top_p)
    n = settings.positions + 1
    stop = StopCondition(eos, max_new_tokens=n + EXTRA_TOKENS)
    reference_generator = torch.Generator().manual_seed(_seed(settings.seed, index, 0))
    reference = _reference_runs(model, ids, eos, sampling, reference_generator, settings.samples, n)
    if reference is None:  # plain decoding, run by run
        reference = [_first_tokens(model, ids, stop, sampling, None, 0, reference_generator, n)[0]
                     for _ in range(settings.samples)]
    bar.update(settings.samples)
    generator = torch.Generator().manual_seed(_seed(settings.seed, index, 1))
    speculative = []
    drafted = accepted = 0
    for _ in range(settings.samples):
        tokens, d, a = _first_tokens(model, ids, stop, sampling, drafter, k, generator, n)
        speculative.append(tokens)
        drafted, accepted = drafted + d, accepted + a
        bar.update(1)
    tests = []
    for position in range(1, n):
        result = homogeneity([run[position] for run in reference], [run[position] for run in speculative])
        tests.append({"prompt": question.question_id, "category": question.category, "position": position,
                      **result.to_dict()})
    return tests, {"prompt": question.question_id, "category": question.category, "runs": settings.samples,
                   "drafted": drafted, "accepted": accepted}


def run_check(settings: CheckSettings, questions: Sequence[Question] | None = None, *, progress: bool = False,
              lossy_rule_for_testing: str | None = None) -> dict:
    """Both checks on one configuration; returns the report as a dict (check_report.format_check prints it).
    `questions`: the prompts (their first turns); default: builtin_prompts()."""
    settings.validate()
    lossy = _lossy_patches(lossy_rule_for_testing)
    questions = list(questions) if questions is not None else builtin_prompts()
    if not questions:
        raise SpecDecodeError("check needs at least one prompt")
    started = time.perf_counter()
    target = load_model(settings.target, settings.dtype)
    drafter, k = plan(target, settings.drafter, settings.draft, settings.k, settings.profile, None, settings.dtype,
                      settings.heads)
    model = SharedPrefill(target.model)
    eos = frozenset(target.info.eos_token_ids)
    prompt_ids = [encode_prompt(target.tokenizer, q.turns[0]) for q in questions]
    sampled_count = min(settings.sampled_prompts, len(questions)) if settings.temperature > 0 else 0
    loaded = time.perf_counter()

    total = 2 * len(questions) + 2 * sampled_count * settings.samples
    with ExitStack() as stack, tqdm(total=total, desc="check", unit="run", file=sys.stderr, disable=None if progress else True,
                                    leave=False) as bar:
        for patch in lossy:
            stack.enter_context(patch)
        greedy = []
        for question, ids in zip(questions, prompt_ids):
            greedy.append(_greedy_case(model, target.tokenizer, question, ids, eos, drafter, k,
                                       settings.greedy_tokens))
            bar.update(2)
        greedy_done = time.perf_counter()
        tests, drafting = [], []
        for index in range(sampled_count):
            case_tests, case_drafting = _sampled_case(model, questions[index], index, prompt_ids[index], eos,
                                                      drafter, k, settings, bar)
            tests += case_tests
            drafting.append(case_drafting)
    finished = time.perf_counter()

    threshold = bonferroni(settings.alpha, len(tests))
    for test in tests:
        test["failed"] = test["p_value"] < threshold
    passed = all(case["identical"] for case in greedy) and not any(test["failed"] for test in tests)
    config = asdict(settings)
    config.update(drafter=getattr(drafter, "name", type(drafter).__name__), k=_describe_k(drafter, k),
                  dtype=str(target.model.dtype).removeprefix("torch.") if hasattr(target.model, "dtype")
                  else settings.dtype)
    result = {"config": config, "greedy": greedy, "sampled": tests, "sampled_drafting": drafting,
              "alpha": settings.alpha, "tests": len(tests), "bonferroni_threshold": threshold, "passed": passed,
              "seconds": {"load": loaded - started, "greedy": greedy_done - loaded, "sampled": finished - greedy_done,
                          "total": finished - started}}
    result["summary"] = summary(result)
    return result
