"""`specdecode bench`: every method against plain decoding and the peers, per task category.

For each prompt, every method runs to the same budget, interleaved (plain, method A,
method B, ..., peers; then again) after a warm-up, and the median of the repeats is kept. Methods: our plain decoding, the draft model at each k, prompt
lookup, `hybrid` (prompt lookup where the context repeats, else the draft model), `adaptive`
(the default: the draft model with k chosen per round by policy/adaptive.py from costs
measured once on this machine), `tuned` (per category the drafter a `tune` profile chose, its k
adaptive from the profile's measured costs and α), `medusa` (the target's trained heads
and their tree), `draft-tree` (the draft model's top-2/top-3 candidates as trees), `eagle` (the trained
EAGLE head with dynamic trees), and transformers' plain `generate`, `assistant_model=`
and `prompt_lookup_num_tokens=` on the same weights, dtype, prompts and budget. Per
category it reports speedup over our plain decoding (time per output token, summed over
the category's prompts), α, τ, acceptance by draft position, the time split, the
theoretical speedup, and whether greedy outputs were identical to plain decoding.

Theory (design.md): with acceptance α i.i.d. per position and k drafts, a round emits
E = (1 - α^(k+1)) / (1 - α) tokens and costs k draft steps plus one verify pass, so
speedup = E · t_plain_step / (k · t_draft_step + t_verify(k+1)). Real acceptance comes in
runs (a drafter right once is likely right again), so E(α) underestimates the measured τ
at larger k; the report also gives the bound with the measured τ in place of E, whose
ratio to the measured speedup is the share of time lost outside drafting and verifying.

Multi-turn questions feed the target's own earlier answers back, as MT-bench does: the
answers come from plain decoding (greedy, so every exact method would give the same).
"""

from __future__ import annotations

import importlib.metadata
import platform
import statistics
import time
from dataclasses import dataclass, field

import torch

from specdecode.policy.adaptive import expected_tokens
from specdecode.api import load_model
from specdecode.commands import llamacpp_peer
from specdecode.commands.speed import FirstTokenClock
from specdecode.models.load import quant_format
from specdecode.heads.loading import eagle_drafter, medusa_drafter
from specdecode.options import BENCH_METHODS as METHODS, DEFAULT_DRAFT, DEFAULT_TARGET, PEER_LOOKUP_K
from specdecode.plan import default_hybrid, make_draft_model, policy_for, tuned_drafter
from specdecode.drafters import PromptLookup
from specdecode.drafters.draft_tree import DraftTree
from specdecode.core.engine import decode
from specdecode.errors import SpecDecodeError
from specdecode.core.events import Stats, collect
from specdecode.core.prompts import encode_prompt
from specdecode.core.sampling import SamplingConfig
from specdecode.core.stopping import StopCondition
from specdecode.questions import conversation



def theoretical_speedup(alpha: float, k: int, plain_step_s: float, draft_step_s: float, verify_s: float) -> float:
    return expected_tokens(alpha, k) * plain_step_s / (k * draft_step_s + verify_s)


@dataclass
class Run:
    seconds: float
    tokens: list[int]
    stats: Stats | None = None
    first_token_s: float | None = None  # time to the first new token: the prompt's prefill, mostly


@dataclass
class Method:
    name: str  # e.g. "draft-model", "transformers assisted"
    k: int | None  # None: plain, adaptive or a peer choosing its own
    run: callable  # (prompt_ids, category) -> Run
    ours: bool = True
    results: dict = field(default_factory=dict)  # (category, prompt index) -> [Run]


def _ours(target, stop, sampling, seed, drafter=None, k=0):
    """drafter and k may be fixed, or a function of the category giving (drafter, k or policy)."""
    def run(prompt_ids, category):
        generator = torch.Generator().manual_seed(seed)
        started = time.perf_counter()
        the_drafter, the_k = drafter(category) if callable(drafter) else (drafter, k() if callable(k) else k)
        tokens, done = collect(decode(target.model, prompt_ids, stop, sampling, the_drafter, the_k, generator))
        return Run(time.perf_counter() - started, tokens, done.stats, done.stats.prefill_s)
    return run


def _transformers(hf_target, max_new_tokens, eos, sampling, seed, **kw):
    sample = {"do_sample": False} if sampling.greedy else {
        "do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None, "top_p": sampling.top_p}

    def run(prompt_ids, category):
        torch.manual_seed(seed)
        ids = torch.tensor([prompt_ids])
        clock = FirstTokenClock()
        started = time.perf_counter()
        with torch.inference_mode():
            out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     eos_token_id=list(eos), pad_token_id=eos[0], streamer=clock, **sample, **kw)
        first = None if clock.first_at is None else clock.first_at - started
        return Run(time.perf_counter() - started, out[0, len(prompt_ids):].tolist(), first_token_s=first)
    return run


def build_methods(target, draft, names, ks, lookup_k, profile, stop, sampling, seed, peers, max_new_tokens,
                  tree_widths=((2, 2, 1), (3, 1, 1))):
    methods = [Method("plain", None, _ours(target, stop, sampling, seed))]
    if "tuned" in names and profile is None:
        raise SpecDecodeError("the tuned method needs --profile (from `specdecode tune`)")
    if {"draft-model", "adaptive", "draft-tree", "hybrid"} & set(names) or (
            "tuned" in names and {"draft-model", "hybrid"} & set(profile.drafters)):
        if draft is None:
            raise SpecDecodeError("the draft-model, hybrid, adaptive and tuned (with a draft model) methods need "
                                  "--draft")
        drafter = make_draft_model(target, draft)
    for name in names:
        if name == "draft-model":
            methods += [Method(name, k, _ours(target, stop, sampling, seed, drafter, k)) for k in ks]
        elif name == "prompt-lookup" and lookup_k == "auto":  # generate's default: k adaptive, up to 16
            lookup = PromptLookup()
            methods.append(Method(name, None, _ours(target, stop, sampling, seed, lookup,
                                                    lambda lookup=lookup: policy_for(target, lookup))))
        elif name == "prompt-lookup":
            methods.append(Method(name, lookup_k, _ours(target, stop, sampling, seed, PromptLookup(), lookup_k)))
        elif name == "hybrid":  # copies where the context repeats, else the model, both lengths adaptive
            hybrid = default_hybrid(target, drafter)
            methods.append(Method(name, None, _ours(target, stop, sampling, seed, hybrid, hybrid.k_max)))
        elif name == "adaptive":  # the default: k adaptive on costs measured on this machine
            def policy():  # a fresh policy per generation
                return policy_for(target, drafter)
            methods.append(Method(name, None, _ours(target, stop, sampling, seed, drafter, policy)))
        elif name == "draft-tree":  # the draft model's top candidates as trees
            for widths in tree_widths:
                methods.append(Method(f"draft-tree {'x'.join(map(str, widths))}", None,
                                      _ours(target, stop, sampling, seed, DraftTree(drafter, widths), 0)))
        elif name == "medusa":  # the heads trained (or shipped) for the target; its tree is its own
            methods.append(Method(name, None, _ours(target, stop, sampling, seed, medusa_drafter(target), 0)))
        elif name == "eagle":  # the target's trained EAGLE head, dynamic trees
            methods.append(Method(name, None, _ours(target, stop, sampling, seed, eagle_drafter(target), 0)))
        elif name == "tuned":
            def tuned(category):  # the profile's drafter for the category, and a fresh policy
                return tuned_drafter(profile, category if category in profile.categories else None,
                                     drafter if draft is not None else None)
            methods.append(Method(name, None, _ours(target, stop, sampling, seed, tuned)))
        else:
            raise SpecDecodeError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    if peers:
        from transformers import AutoModelForCausalLM

        hf_target = AutoModelForCausalLM.from_pretrained(str(target.info.folder), dtype=target.model.dtype).eval()
        eos = target.info.eos_token_ids
        peer = lambda **kw: _transformers(hf_target, max_new_tokens, eos, sampling, seed, **kw)  # noqa: E731
        methods.append(Method("transformers plain", None, peer(), ours=False))
        if draft is not None:
            hf_draft = AutoModelForCausalLM.from_pretrained(str(draft.info.folder), dtype=target.model.dtype).eval()
            methods.append(Method("transformers assisted", None, peer(assistant_model=hf_draft), ours=False))
        peer_k = peer_lookup_k(lookup_k)
        methods.append(Method("transformers prompt-lookup", peer_k, peer(prompt_lookup_num_tokens=peer_k),
                              ours=False))
    return methods


def peer_lookup_k(lookup_k: int | str) -> int:
    """The peers' prompt-lookup length: ours, or PEER_LOOKUP_K where ours adapts ("auto")."""
    return PEER_LOOKUP_K if lookup_k == "auto" else lookup_k


def llamacpp_methods(target, max_new_tokens: int, lookup_k: int | str, temperature: float, log) -> list[Method]:
    """llama.cpp's plain decoding and prompt lookup on the target's GGUF file (llamacpp_peer.py),
    or none, with a one-line note saying why."""
    gguf, why = llamacpp_peer.target_gguf(target.info.folder, temperature)
    if why is not None:
        log(f"llama.cpp peer skipped: {why}")
        return []
    log(f"loading llama.cpp on {gguf.name}")
    runs = llamacpp_peer.peer_runs(gguf, torch.get_num_threads(), max_new_tokens, target.info.eos_token_ids,
                                   peer_lookup_k(lookup_k))
    def timed(run):
        def as_run(ids, category):
            seconds, tokens, first = run(ids, category)
            return Run(seconds, tokens, first_token_s=first)
        return as_run

    return [Method(name, k, timed(run), ours=False) for name, k, run in runs]


def expand_turns(target, questions, stop) -> list[tuple[str, list[int]]]:
    """(category, prompt ids) for every turn; later turns carry plain decoding's answers."""
    prompts = []
    for q in questions:
        answers: list[str] = []
        for turn in range(len(q.turns)):
            prompt_ids = encode_prompt(target.tokenizer, conversation(q, answers))
            prompts.append((q.category, prompt_ids))
            if turn + 1 < len(q.turns):
                tokens, _ = collect(decode(target.model, prompt_ids, stop))
                answers.append(target.tokenizer.decode(tokens, skip_special_tokens=True))
    return prompts


def run_bench(questions, target_name=DEFAULT_TARGET, draft_name: str | None = DEFAULT_DRAFT,
              methods=("draft-model", "prompt-lookup", "adaptive"), ks=(2, 3, 4), lookup_k=4,
              max_new_tokens=64, repeats=3, temperature=0.0, seed=0, peers=True, profile=None,
              log=print, tree_widths=((2, 2, 1), (3, 1, 1)), dtype: str | None = None,
              llama_cpp: bool = True) -> dict:
    from tqdm import tqdm

    target = load_model(target_name, dtype)
    draft = load_model(draft_name, dtype, as_draft=True) if draft_name else None
    if peers and quant_format(dtype):  # transformers would run other, float weights: not a like-for-like peer
        log(f"transformers peers skipped: they cannot run {dtype} weights")
        peers = False
    sampling = SamplingConfig(temperature)
    stop = StopCondition(frozenset(target.info.eos_token_ids), max_new_tokens=max_new_tokens)
    log("loading the methods (and transformers' copies of the weights for the peers)")
    method_list = build_methods(target, draft, methods, ks, lookup_k, profile, stop, sampling, seed, peers,
                                max_new_tokens, tree_widths)
    if llama_cpp:
        method_list += llamacpp_methods(target, max_new_tokens, lookup_k, temperature, log)
    prompts = expand_turns(target, questions, stop)

    log("warm-up: every method once")
    for m in method_list:
        m.run(prompts[0][1], prompts[0][0])
    bar = tqdm(total=len(prompts) * repeats * len(method_list), desc="bench", unit="run")
    for index, (category, prompt_ids) in enumerate(prompts):
        for _ in range(repeats):
            for m in method_list:
                bar.set_postfix_str(f"{category} / {label(m)}")
                m.results.setdefault((category, index), []).append(m.run(prompt_ids, category))
                bar.update()
    bar.close()

    rows = [row for category in dict.fromkeys(c for c, _ in prompts)
            for row in summarize(category, method_list, greedy=temperature == 0)]
    return {"target": target_name, "draft": draft_name,
            "dtype": quant_format(dtype) or str(target.model.dtype).removeprefix("torch."),
            "temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens, "repeats": repeats,
            "prompts": len(prompts), "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "versions": versions(),
            "target_sha256": target.info.sha256, "draft_sha256": draft.info.sha256 if draft else None,
            "target_bytes": target.model.memory_bytes, "draft_bytes": draft.model.memory_bytes if draft else None,
            "rows": rows}


def label(m: Method) -> str:
    return m.name if m.k is None or not m.ours else f"{m.name} k={m.k}"


def versions() -> dict:
    return {p: importlib.metadata.version(p) for p in ("specdecode", "torch", "transformers")}


def summarize(category: str, methods: list[Method], greedy: bool = True) -> list[dict]:
    """Rows of one category. `identical_to_plain` is checked for greedy runs; sampled runs
    draw other random numbers than plain decoding, so theirs is None (the sampling rules'
    losslessness is proven by the statistical tests instead)."""
    plain = methods[0]
    keys = [key for key in plain.results if key[0] == category]

    def seconds_per_token(m, key):
        return statistics.median(r.seconds / max(1, len(r.tokens)) for r in m.results[key])

    plain_total = sum(seconds_per_token(plain, key) for key in keys)
    plain_step = statistics.median(r.stats.verify_s / max(1, r.stats.rounds) for key in keys for r in plain.results[key])
    rows = []
    for m in methods:
        runs = [r for key in keys for r in m.results[key]]
        total = sum(seconds_per_token(m, key) for key in keys)
        firsts = [statistics.median(r.first_token_s for r in m.results[key]) for key in keys
                  if all(r.first_token_s is not None for r in m.results[key])]
        row = {"category": category, "method": m.name, "k": m.k, "speedup": plain_total / total,
               "tokens_per_s": len(keys) / total,
               "time_to_first_token_s": statistics.mean(firsts) if len(firsts) == len(keys) else None}
        if m.ours:
            stats = merged(r.stats for r in runs)
            row.update(acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
                       acceptance_by_position=stats.acceptance_by_position,
                       identical_to_plain=all(r.tokens == plain.results[key][0].tokens
                                              for key in keys for r in m.results[key]) if greedy else None,
                       time_split={"draft": stats.draft_s, "verify": stats.verify_s,
                                   "prefill": stats.prefill_s, "other": stats.other_s})
            if stats.draft_tokens and stats.rounds:
                verify = stats.verify_s / stats.rounds
                draft_step = stats.draft_s / stats.draft_tokens
                k_mean = stats.draft_tokens / stats.rounds
                alpha = stats.acceptance_rate
                row["theoretical_speedup"] = expected_tokens(alpha, round(k_mean)) * plain_step / (
                    k_mean * draft_step + verify)
                row["bound_speedup"] = stats.mean_accepted_length * plain_step / (k_mean * draft_step + verify)
        else:
            row["identical_to_plain"] = None  # transformers' kernels round differently from ours
        rows.append(row)
    return rows


def merged(all_stats) -> Stats:
    """One Stats for many runs; τ stays per run (each run's prefill token is not a round)."""
    total, runs = Stats(), 0
    for s in all_stats:
        runs += 1
        for name in ("prompt_tokens", "new_tokens", "rounds", "draft_tokens", "accepted_tokens",
                     "prefill_s", "draft_s", "verify_s", "wall_s"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for mine, theirs in ((total.drafted_at, s.drafted_at), (total.accepted_at, s.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n
    total.new_tokens -= max(0, runs - 1)  # Stats counts one prefill token
    return total
