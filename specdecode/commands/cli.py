"""The `specdecode` command: a thin dispatcher over subcommands.

    specdecode models | pull NAME | generate | check | speed | bench | tune | train | demo | serve | load

User errors (`SpecDecodeError`) print one line on stderr and exit with status 2. Each
command imports its module when it runs: torch and transformers take seconds to load,
and flags are checked before they do.
"""

from __future__ import annotations

import argparse
import json
import sys

from specdecode.commands import cli_heads, cli_serve
from specdecode.commands import load as cli_load
from specdecode.commands import models as cli_models
from specdecode.errors import SpecDecodeError
from specdecode.options import (BENCH_METHODS, DEFAULT_DRAFT, DEFAULT_TARGET, DRAFTERS, DTYPE_HELP, HYBRID,
                                PEER_LOOKUP_K, TUNABLE, check_request)
from specdecode.questions import load_prompt_file
from specdecode.suites import LONG_SUITES, SUITES, load_suite

ACCEPTED_STYLE = ("\033[32m", "\033[0m")  # drafted-and-accepted tokens in green


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampled output repeatable")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply, streamed, optionally with speculation")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, transformers folder or .gguf")
    p.add_argument("--draft", help="draft model (registry name or path); implies --drafter draft-model")
    p.add_argument("--drafter", choices=DRAFTERS, help="how to draft; none = plain decoding")
    p.add_argument("--k", type=_k_value, default=None,
                   help="draft tokens per round, or 'auto' to adapt k to the acceptance seen")
    p.add_argument("--profile", help="a profile from `specdecode tune`: it picks the drafter (unless given) "
                   "and seeds an adaptive k with measured costs")
    p.add_argument("--category", help="the profile's category of this prompt (default: the mean over categories)")
    p.add_argument("--heads", "--head", dest="heads",
                   help="Medusa heads / EAGLE head folder (default: the ones trained for the target)")
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt is raw text")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.add_argument("--show-accepted", action="store_true", help="mark drafted-and-accepted tokens in green")
    add_sampling_args(p)
    p.set_defaults(func=run_generate)


def _k_value(text: str):
    return text if text == "auto" else int(text)


def run_generate(args) -> int:
    check_request(args.drafter, args.draft, args.k, args.profile, args.category, args.heads, args.dtype)
    if args.max_new_tokens < 0:
        raise SpecDecodeError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    from specdecode.api import Generation, load_model, stream
    from specdecode.core.events import Round
    from specdecode.core.stopping import StopCondition
    from specdecode.commands.textstream import TextStream

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    events = stream(prompt, args.target, draft=args.draft, drafter=args.drafter, k=args.k,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop, chat=not args.raw, dtype=args.dtype,
                    profile=args.profile, category=args.category, heads=args.heads)
    tokenizer = None
    tokens: list[int] = []
    text_stream = None
    for event in events:
        if tokenizer is None:
            tokenizer = load_model(args.target, args.dtype).tokenizer
            text_stream = TextStream(tokenizer)
        if not isinstance(event, Round):
            break
        tokens += event.token_ids
        if args.json:
            continue
        accepted, rest = event.token_ids[:event.num_accepted], event.token_ids[event.num_accepted:]
        if args.show_accepted and accepted:
            sys.stdout.write(ACCEPTED_STYLE[0] + text_stream.add(accepted) + ACCEPTED_STYLE[1])
        else:
            rest = event.token_ids
        sys.stdout.write(text_stream.add(rest))
        sys.stdout.flush()
    stop = StopCondition(stop_strings=tuple(args.stop), tokenizer=tokenizer)
    text = stop.cut_text(tokenizer.decode(tokens, skip_special_tokens=True))
    result = Generation(text, tokens, event.reason, event.stats)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        s = event.stats
        print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.2f} tok/s, finish: {event.reason}"
              + (f", α {s.acceptance_rate:.2f}, τ {s.mean_accepted_length:.2f}" if s.draft_tokens else "") + "]",
              file=sys.stderr)
    return 0


def add_speed(sub) -> None:
    p = sub.add_parser("speed", help="plain decoding: native vs transformers, and the memory-bandwidth limit")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"registry name, transformers folder or .gguf (default: {DEFAULT_TARGET})")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per timed run (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per backend; the median is kept (default: 3)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="time a prompt of this many tokens of standard-library source: its prefill rate and the "
                        "decoding rate after it (default: a short built-in prompt)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run_speed_cmd)


def _report(args, measure, formatted) -> int:
    """Run `measure(log)` and print its result: one JSON object with --json (progress to
    stderr then), else the formatted table."""
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    result = measure(log)
    print(json.dumps(result) if args.json else formatted(result))
    return 0


def run_speed_cmd(args) -> int:
    from specdecode.commands.speed import format_speed, run_speed

    return _report(args, lambda log: run_speed(args.target, args.dtype, args.new_tokens, args.repeats, log=log,
                                                  prompt_tokens=args.prompt_tokens),
                   format_speed)


def add_quality(sub) -> None:
    p = sub.add_parser("quality", help="what a quantized dtype costs: KL, top-1 agreement and perplexity "
                                       "against a float dtype of the same model, on a fixed text")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"registry name, transformers folder or .gguf (default: {DEFAULT_TARGET})")
    p.add_argument("--dtype", default="gguf", help="the dtype measured (default: gguf): " + DTYPE_HELP)
    p.add_argument("--reference", default="bf16", help="the dtype it is measured against (default: bf16; fp32 "
                                                         "for the exact dequantized values)")
    p.add_argument("--tokens", type=int, default=2048, help="positions compared (default: 2048)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per pass (default: 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=run_quality_cmd)


def run_quality_cmd(args) -> int:
    from specdecode.commands.quality import format_quality, run_quality

    return _report(args, lambda log: run_quality(args.target, args.dtype, args.reference, args.tokens, args.chunk,
                                                 log=log), format_quality)


def _lookup_k(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {text!r}") from None


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_questions_args(p: argparse.ArgumentParser, default_limit: int) -> None:
    p.add_argument("--suites", type=_csv, default=list(SUITES),
                   help=f"categories (default: {','.join(SUITES)}; long prompts: {','.join(LONG_SUITES)})")
    p.add_argument("--prompts", help="a Spec-Bench / MT-bench question file (JSONL) instead of the suites")
    p.add_argument("--limit", type=int, default=default_limit, help="prompts per category")


def load_questions(args):
    if args.limit is not None and args.limit < 1:
        raise SpecDecodeError(f"--limit must be >= 1, got {args.limit}")
    if args.prompts:
        questions, counts = [], {}
        for q in load_prompt_file(args.prompts):
            counts[q.category] = counts.get(q.category, 0) + 1
            if args.limit is None or counts[q.category] <= args.limit:
                questions.append(q)
        return questions
    return [q for name in args.suites for q in load_suite(name, args.limit)]


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="every method vs plain decoding and transformers, per task category")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"registry name, transformers folder or .gguf (default: {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for draft-model and adaptive ('' = none)")
    p.add_argument("--methods", type=_csv, default=None,
                   help=f"of {','.join(BENCH_METHODS)} (default: all but medusa and eagle, which need trained heads; "
                        "tuned only with --profile)")
    p.add_argument("--k", type=_csv, default=["2", "3", "4"], help="draft lengths for the draft model")
    p.add_argument("--lookup-k", type=_lookup_k, default=4,
                   help="draft length for prompt lookup, or 'auto': generate's adaptive k, which grows on long "
                        f"accepted copies (the peers then look up {PEER_LOOKUP_K}) (default: 4)")
    p.add_argument("--tree-widths", type=_csv, default=["2x2x1", "3x1x1"],
                   help="draft-tree shapes: top-w candidates per depth, e.g. 2x2x1 (at most 10 nodes)")
    add_questions_args(p, default_limit=10)
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens per answer (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling (default: 0)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each method per prompt; the median is kept "
                   "(default: 3)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' generate: plain, assisted, prompt lookup")
    p.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True,
                   help="also run llama.cpp on the target's GGUF file, plain and with prompt lookup (greedy; needs "
                        "the [llamacpp] extra; skipped with a note without it)")
    p.add_argument("--profile", help="a `specdecode tune` profile for the tuned method")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP + " (target and draft alike)")
    p.add_argument("--out", default="out/bench", help="folder for results.json, report.md and plots")
    p.set_defaults(func=run_bench_cmd)


def run_bench_cmd(args) -> int:
    from pathlib import Path

    from specdecode.commands.bench import run_bench
    from specdecode.commands.report import table, verdict_table, write_report
    from specdecode.policy.profile import Profile

    ks = tuple(int(k) for k in args.k)
    if any(k < 1 for k in ks):
        raise SpecDecodeError(f"every k must be >= 1, got {','.join(args.k)}")
    if args.repeats < 1:
        raise SpecDecodeError("--repeats must be >= 1")
    tree_widths = tuple(_widths(w) for w in args.tree_widths)
    questions = load_questions(args)
    profile = Profile.load(args.profile) if args.profile else None
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    methods = args.methods or [m for m in BENCH_METHODS if (m != "tuned" or profile is not None)
                               and m not in ("medusa", "eagle")
                               and (args.draft or m not in ("draft-model", "adaptive"))]
    result = run_bench(questions, args.target, args.draft or None, tuple(methods), ks, args.lookup_k,
                       args.max_new_tokens, args.repeats, args.temperature, args.seed, args.peers, profile, log=log,
                       tree_widths=tree_widths, dtype=args.dtype, llama_cpp=args.llama_cpp)
    for path in write_report(result, Path(args.out)):
        log(f"wrote {path}")
    print(table(result))
    verdict = verdict_table(result)
    if verdict:
        print("\n" + verdict)
    return 0


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split("x"))
    except ValueError:
        raise SpecDecodeError(f"a tree shape is widths per depth like 2x2x1, got {text!r}") from None
    nodes, level = 0, 1
    for w in widths:
        level *= w
        nodes += level
    if not widths or min(widths) < 1 or nodes > 10:
        raise SpecDecodeError(f"tree {text}: widths must be >= 1 and give at most 10 nodes (it has {nodes}): "
                              "more rows would round differently in a bf16 verify pass")
    return widths


def add_tune(sub) -> None:
    p = sub.add_parser("tune", help="measure costs and acceptance; choose drafter and k (or off) per category")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"registry name, transformers folder or .gguf (default: {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for the draft-model drafter ('' = none)")
    p.add_argument("--drafters", type=_csv, default=list(TUNABLE),
                   help=f"of {','.join(TUNABLE)} (without --draft: prompt-lookup only); tree drafters choose "
                   "their trees when trained")
    add_questions_args(p, default_limit=3)
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens per answer (default: 64)")
    p.add_argument("--k-max", type=int, default=8, help="largest draft length k to consider (default: 8)")
    p.add_argument("--out", help="profile path (default: $SPECDECODE_HOME/profiles/TARGET+DRAFT.json)")
    p.set_defaults(func=run_tune_cmd)


def run_tune_cmd(args) -> int:
    from specdecode.commands.tune import run_tune
    from specdecode.policy.profile import default_profile_path

    drafters = [d for d in args.drafters if d not in ("draft-model", HYBRID) or args.draft]
    unknown = [d for d in drafters if d not in TUNABLE]
    if unknown or not drafters:
        raise SpecDecodeError(f"--drafters must name some of {', '.join(TUNABLE)} "
                              "(draft-model and hybrid need --draft)")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    profile = run_tune(args.target, drafters, args.draft or None, load_questions(args), args.max_new_tokens,
                       k_max=args.k_max, log=log)
    path = profile.save(args.out or default_profile_path(args.target, profile.drafters.get("draft-model", {}).get("draft")))
    singles = [name for name in profile.drafters if name in drafters and name != HYBRID]
    hybrid = " hybrid probe" if HYBRID in profile.drafters else ""
    print(f"{'category':<16}" + "".join(f" {'α ' + name:>18}" for name in singles)
          + f"{hybrid} {'chosen':>14} {'k':>4} {'expected':>9}")
    for name, c in profile.categories.items():
        probe = c.get("hybrid")
        print(f"{name:<16}" + "".join(f" {c['alpha'][d]:>18.2f}" for d in singles)
              + (f" {probe['tokens'] / probe['cost']:>11.2f}x" if probe else "")
              + f" {c['drafter']:>14} {c['k'] or 'off':>4} {c['expected_speedup']:>8.2f}x")
    one = profile.verify_seconds[1]
    print("draft step / plain step c: " + ", ".join(f"{n} {d['step_s'] / one:.3f}" for n, d in profile.drafters.items())
          + f"; verify 8 / 1 = {profile.costs(drafters[0]).verify(8):.2f}, "
          f"64 / 1 = {profile.costs(drafters[0]).verify(64):.2f}")
    print(f"saved {path}  (use: specdecode generate --profile {path} [--category NAME])")
    from specdecode.commands import vllm_config

    print(f"saved {vllm_config.write(profile, path.with_suffix('.vllm.json'))}  (each category's "
          "--speculative-config for vLLM)")
    return 0


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the default pair on a few prompts: speculative vs plain")
    p.add_argument("--max-new-tokens", type=int, default=96, help="most tokens per answer (default: 96)")
    p.add_argument("--k", type=int, default=None, help="fixed draft length (default: adaptive)")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--profile", help="a `specdecode tune` profile: k chosen adaptively from its measurements")
    p.set_defaults(func=run_demo_cmd)


def run_demo_cmd(args) -> int:
    from specdecode.commands.demo import run_demo

    run_demo(max_new_tokens=args.max_new_tokens, k=args.k, dtype=args.dtype, profile=args.profile)
    return 0


def add_check(sub) -> None:
    p = sub.add_parser("check", help="test that a configuration is lossless: greedy identity and per-position "
                       "chi-square tests against plain decoding; exit 1 on a failure")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"registry name, transformers folder or .gguf (default: {DEFAULT_TARGET})")
    p.add_argument("--draft", help="draft model (registry name or path); implies --drafter draft-model")
    p.add_argument("--drafter", choices=DRAFTERS, help="how to draft")
    p.add_argument("--k", type=_k_value, default=None, help="draft tokens per round, or 'auto' (default)")
    p.add_argument("--heads", "--head", dest="heads", help="Medusa heads / EAGLE head folder")
    p.add_argument("--profile", help="a profile from `specdecode tune`: it picks the drafter (unless given) and k")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--temperature", type=float, default=0.8,
                   help="of the sampled check; 0 = the greedy check only (default: 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    p.add_argument("--prompts", help="a Spec-Bench / MT-bench question file (JSONL; first turns) instead of "
                   "the built-in prompts (prose, code edit, code completion, math)")
    p.add_argument("--greedy-tokens", type=int, default=32,
                   help="tokens decoded per prompt in the greedy check (default: 32)")
    p.add_argument("--samples", type=int, default=100, help="runs per arm (speculative, plain) and prompt in the "
                   "sampled check (default: 100)")
    p.add_argument("--positions", type=int, default=3, help="generated positions tested, from the second; the "
                   "first comes from the prefill, before any drafting (default: 3)")
    p.add_argument("--sampled-prompts", type=int, default=1,
                   help="prompts of the sampled check, the first ones (default: 1)")
    p.add_argument("--alpha", type=float, default=0.01, help="family-wise false-alarm rate, Bonferroni over "
                   "positions x prompts (default: 0.01)")
    p.add_argument("--seed", type=int, default=0, help="seed of both arms' draws (default: 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object: config, results, passed")
    p.set_defaults(func=run_check_cmd)


def run_check_cmd(args) -> int:
    # Every flag is checked before torch loads; CheckSettings.validate checks again for API callers.
    check_request(args.drafter, args.draft, args.k, args.profile, None, args.heads, args.dtype)
    if args.drafter is None and args.draft is None and args.profile is None:
        raise SpecDecodeError("check compares speculative with plain decoding: name a drafter "
                              "(--draft, --drafter or --profile)")
    for flag, value, least in (("--greedy-tokens", args.greedy_tokens, 1), ("--samples", args.samples, 10),
                               ("--positions", args.positions, 1), ("--sampled-prompts", args.sampled_prompts, 1),
                               ("--top-k", args.top_k, 0)):
        if value < least:
            raise SpecDecodeError(f"{flag} must be an integer >= {least}, got {value!r}")
    if not 0.0 <= args.temperature < float("inf"):  # also NaN
        raise SpecDecodeError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature!r}")
    if not 0.0 < args.top_p <= 1.0:
        raise SpecDecodeError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p!r}")
    if not 0.0 < args.alpha < 1.0:
        raise SpecDecodeError(f"--alpha must be in (0, 1), got {args.alpha!r}")
    questions = load_prompt_file(args.prompts) if args.prompts else None
    from specdecode.commands.check import CheckSettings, run_check
    from specdecode.commands.check_report import format_check

    settings = CheckSettings(args.target, args.draft, args.drafter, args.k, args.heads, args.profile, args.dtype,
                             args.temperature, args.top_k, args.top_p, args.greedy_tokens, args.samples,
                             args.positions, args.alpha, args.seed, args.sampled_prompts)
    settings.validate()
    result = run_check(settings, questions, progress=True)
    print(json.dumps(result) if args.json else format_check(result))
    return 0 if result["passed"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cli_models.add_commands(sub)
    add_generate(sub)
    add_speed(sub)
    add_quality(sub)
    add_bench(sub)
    add_tune(sub)
    cli_heads.add_commands(sub)
    add_demo(sub)
    add_check(sub)
    cli_serve.add_commands(sub)
    cli_load.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecDecodeError as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecdecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
