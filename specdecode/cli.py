"""The `specdecode` command: a thin dispatcher over subcommands.

    specdecode models | pull NAME | generate | speed | demo

User errors (`SpecDecodeError`) print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import cli_models
from .errors import SpecDecodeError

ACCEPTED_STYLE = ("\033[32m", "\033[0m")  # drafted-and-accepted tokens in green


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None, help="makes sampled output repeatable")


def add_generate(sub) -> None:
    from .api import DEFAULT_TARGET, DRAFTERS

    p = sub.add_parser("generate", help="generate a reply, streamed, optionally with speculation")
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, transformers folder or .gguf")
    p.add_argument("--draft", help="draft model (registry name or path); implies --drafter draft-model")
    p.add_argument("--drafter", choices=DRAFTERS, help="how to draft; none = plain decoding")
    p.add_argument("--k", type=_k_value, default=None,
                   help="draft tokens per round, or 'auto' to adapt k to the acceptance seen")
    p.add_argument("--profile", help="a profile from `specdecode tune`: measured costs choose k, adaptively")
    p.add_argument("--category", help="the profile's category whose acceptance seeds k (default: their mean)")
    p.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt is raw text")
    p.add_argument("--dtype", default=None, help="bf16 (default) or fp32")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    p.add_argument("--show-accepted", action="store_true", help="mark drafted-and-accepted tokens in green")
    add_sampling_args(p)
    p.set_defaults(func=run_generate)


def _k_value(text: str):
    return text if text == "auto" else int(text)


def run_generate(args) -> int:
    from .api import Generation, load_model, stream
    from .events import Round
    from .stopping import StopCondition
    from .textstream import TextStream

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    events = stream(prompt, args.target, draft=args.draft, drafter=args.drafter, k=args.k,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop, chat=not args.raw, dtype=args.dtype,
                    profile=args.profile, category=args.category)
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
    from .api import DEFAULT_TARGET

    p = sub.add_parser("speed", help="plain decoding: native vs transformers, and the memory-bandwidth limit")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--dtype", default=None, help="bf16 (default) or fp32; both backends use it")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_speed_cmd)


def run_speed_cmd(args) -> int:
    from .speed import format_speed, run_speed

    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    result = run_speed(args.target, args.dtype, args.new_tokens, args.repeats, log=log)
    print(json.dumps(result) if args.json else format_speed(result))
    return 0


def add_bench(sub) -> None:
    from .api import DEFAULT_DRAFT, DEFAULT_TARGET

    p = sub.add_parser("bench", help="every method vs plain decoding and transformers, per prompt kind")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--k", default="2,3,4", help="draft lengths for the draft model, comma-separated")
    p.add_argument("--lookup-k", type=int, default=4, help="draft length for prompt lookup")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-peers", dest="peers", action="store_false", help="skip transformers' generate")
    p.add_argument("--out", default="out/bench", help="folder for results.json and report.md")
    p.set_defaults(func=run_bench_cmd)


def run_bench_cmd(args) -> int:
    from pathlib import Path

    from .bench import format_table, run_bench

    ks = tuple(int(k) for k in args.k.split(","))
    if any(k < 1 for k in ks):
        raise SpecDecodeError(f"every k must be >= 1, got {args.k}")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    result = run_bench(args.target, args.draft, ks, args.lookup_k, args.max_new_tokens, args.repeats,
                       args.peers, Path(args.out), log=log)
    print(format_table(result))
    return 0


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the default pair on a few prompts: speculative vs plain")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--dtype", default=None)
    p.set_defaults(func=run_demo_cmd)


def run_demo_cmd(args) -> int:
    from .demo import run_demo

    run_demo(max_new_tokens=args.max_new_tokens, k=args.k, dtype=args.dtype)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cli_models.add_commands(sub)
    add_generate(sub)
    add_speed(sub)
    add_bench(sub)
    add_demo(sub)
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
