"""The command line of heads: `specdecode train medusa|eagle`, `specdecode export` and
`specdecode import`. Each command imports its module when it runs, as cli.py does: torch
takes seconds to load, and flags are checked before it."""

from __future__ import annotations

import argparse
import sys

from specdecode.errors import SpecDecodeError
from specdecode.options import DEFAULT_TARGET


def add_commands(sub) -> None:
    add_train(sub)
    add_exchange(sub)


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train drafter heads on a frozen target (self-distillation)")
    kinds = p.add_subparsers(dest="kind", required=True)
    m = kinds.add_parser("medusa", help="Medusa heads: extra heads on the target's last hidden state")
    m.add_argument("--heads", type=int, default=3, help="number of heads (offsets +2, +3, ...)")
    e = kinds.add_parser("eagle", help="an EAGLE head: one decoder layer predicting the target's next feature")
    e.add_argument("--intermediate-size", type=int,
                   help="width of the head's MLP (default: the target's); narrower drafts faster")
    e.add_argument("--layout", choices=("eagle3", "fused"), default="eagle3",
                   help="eagle3: EAGLE-3's layer and own LM head, which vLLM and SGLang load (`specdecode "
                        "export`); fused: [feature; embedding] through one product, predicting features")
    e.add_argument("--feature-layers", type=_layer_list, default=(),
                   help="target layers the head reads, e.g. 2,15,27 (default: 2, L/2, L-3 for eagle3; "
                        "the final layer alone for fused)")
    for kind in (m, e):
        kind.add_argument("--target", default=DEFAULT_TARGET,
                          help=f"registry name, transformers folder or .gguf (default: {DEFAULT_TARGET})")
        kind.add_argument("--tokens", type=int, default=100_000, help="tokens of standard-library source")
        kind.add_argument("--answers", type=int, default=24, help="prompts the target answers for training")
        kind.add_argument("--answer-tokens", type=int, default=128,
                          help="most tokens of each of the target's answers (default: 128)")
        kind.add_argument("--epochs", type=float, default=2.0, help="passes over the data; fractions allowed "
                          "(default: 2)")
        kind.add_argument("--out", help="artifact folder (default: beside the target's cached weights)")
        kind.add_argument("--reshape-only", action="store_true",
                          help="no training: choose the tree of the existing heads again, for this machine")
        kind.add_argument("--from", dest="source", help="with --reshape-only: the heads' folder (default: the "
                          "ones trained or shipped for the target); eagle without it: a head to continue training")
        kind.add_argument("--dtype", help="with --reshape-only: fit the tree to the target on these weights "
                          "(default bf16; gguf: the GGUF's blocks, whose tree is kept apart, in medusa-gguf or "
                          "eagle-gguf); heads always train on the bf16 target")
        kind.set_defaults(func=run_train_cmd)


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of layer numbers, not {text!r}") from None


def run_train_cmd(args) -> int:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.source and not args.reshape_only and args.kind != "eagle":
        raise SpecDecodeError("--from goes with --reshape-only (or with train eagle, to continue a head)")
    if args.dtype and not args.reshape_only:
        raise SpecDecodeError("--dtype goes with --reshape-only: heads train on the bf16 target")
    if args.reshape_only:
        from specdecode.heads.refit import reshape_eagle, reshape_medusa

        reshape = reshape_medusa if args.kind == "medusa" else reshape_eagle
        folder = reshape(args.target, args.source, args.out, log=log, dtype=args.dtype)
    elif args.kind == "medusa":
        from specdecode.heads.medusa.train import run_train_medusa

        folder = run_train_medusa(args.target, args.heads, args.tokens, args.answers, args.answer_tokens,
                                  args.epochs, args.out, log=log)
    else:
        from specdecode.heads.eagle.train import run_train_eagle

        folder = run_train_eagle(args.target, args.tokens, args.answers, args.answer_tokens, args.epochs,
                                 args.out, args.intermediate_size, log=log, start=args.source,
                                 feature_layers=args.feature_layers, layout=args.layout)
    print(f"saved {folder}  (use: specdecode generate --target {args.target} --drafter {args.kind})")
    return 0


def add_exchange(sub) -> None:
    p = sub.add_parser("export", help="write a head trained here in the format vLLM or SGLang loads")
    p.add_argument("kind", choices=("eagle", "medusa"))
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"the head's target (default: {DEFAULT_TARGET})")
    p.add_argument("--head", "--heads", dest="head", help="the head's folder (default: trained or shipped for the target)")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--format", choices=("speculators", "eagle"), default="speculators",
                   help="eagle only: speculators (vLLM) or the EAGLE repository's layout (SGLang)")
    p.add_argument("--k", type=int, help="eagle only: speculative tokens the config proposes (default: the depth "
                   "fitted here, at least 1)")
    p.add_argument("--verifier", help="the verifier the config names (default: the publisher's id of a registry "
                   "target's weights, else the target's folder)")
    p.set_defaults(func=run_exchange_cmd)
    i = sub.add_parser("import", help="make an EAGLE-3 head from vLLM's speculators or the EAGLE layout a drafter here")
    i.add_argument("kind", choices=("eagle",))
    i.add_argument("source", help="the head's folder (config.json and its weights)")
    i.add_argument("--target", default=DEFAULT_TARGET, help=f"the target it drafts for (default: {DEFAULT_TARGET})")
    i.add_argument("--out", help="artifact folder (default: beside the target's cached weights, where "
                   "--drafter eagle finds it)")
    i.add_argument("--any-verifier", action="store_true",
                   help="import a head whose config names another verifier with the target's shapes")
    i.set_defaults(func=run_exchange_cmd)


def run_exchange_cmd(args) -> int:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.command == "import":
        from specdecode.commands.exchange import import_eagle

        folder = import_eagle(args.source, args.target, args.out, args.any_verifier, log=log)
        print(f"saved {folder}  (use: specdecode generate --target {args.target} --drafter eagle"
              + (f" --head {folder})" if args.out else ")"))
        return 0
    if args.kind == "medusa" and (args.k is not None or args.format != "speculators"):
        raise SpecDecodeError("--k and --format go with export eagle")
    if args.k is not None and args.k < 1:
        raise SpecDecodeError("--k must be at least 1")
    from specdecode.commands.exchange import export_eagle, export_medusa

    if args.kind == "eagle":
        folder = export_eagle(args.target, args.head, args.out, args.format, args.k, args.verifier, log=log)
    else:
        folder = export_medusa(args.target, args.head, args.out, args.verifier, log=log)
    print(folder)
    return 0
