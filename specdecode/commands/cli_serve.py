"""The command line of `specdecode serve`: its flags, and their checks before any model
loads. The server itself is put together in serve.py, imported when the command runs (as
cli.py does: torch takes seconds to load, and flags are checked before it)."""

from __future__ import annotations

import os

from specdecode.errors import SpecDecodeError
from specdecode.options import DEFAULT_TARGET, DTYPE_HELP, check_request


def add_commands(sub) -> None:
    add_serve(sub)


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server: continuous batching, speculation where it pays")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model (registry name or path)")
    p.add_argument("--draft", help="draft model (registry name or path); implies --drafter draft-model")
    p.add_argument("--drafter", choices=("prompt-lookup", "draft-model", "medusa", "eagle", "none"), default=None,
                   help="prompt-lookup (default without --draft), draft-model, medusa or eagle (trees: one "
                        "sequence at a time), or none (plain decoding only)")
    p.add_argument("--heads", help="the Medusa heads' or EAGLE head's folder (default: trained or shipped ones)")
    p.add_argument("--dtype", default=None, help=DTYPE_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together at most")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; more get 429")
    p.add_argument("--k-max", type=int, default=8, help="the longest draft the controller chooses")
    p.add_argument("--max-context", type=int, default=4096, help="prompt + new tokens per request, at most")
    p.add_argument("--default-max-tokens", type=int, default=256, help="new tokens when a request names none")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require this bearer token (default: $SPECDECODE_API_KEY, else none)")
    p.add_argument("--served-model-name", help="the model id clients name (default: --target)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.set_defaults(func=run_serve)


def check_serve(args) -> str:
    """The drafter to serve; every flag checked before a model loads."""
    check_request(None, None, None, None, None, None, args.dtype)
    for flag in ("max_batch", "max_queue", "k_max", "max_context", "default_max_tokens", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise SpecDecodeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 < args.port < 65536:
        raise SpecDecodeError(f"--port must be in 1-65535, got {args.port}")
    drafter = args.drafter or ("draft-model" if args.draft else "prompt-lookup")
    if args.draft and drafter != "draft-model":
        raise SpecDecodeError(f"--draft names a draft model; it does not go with --drafter {drafter}")
    if drafter == "draft-model" and not args.draft:
        raise SpecDecodeError("--drafter draft-model needs --draft MODEL")
    if args.heads is not None and drafter not in ("medusa", "eagle"):
        raise SpecDecodeError("--heads goes with --drafter medusa or eagle")
    if drafter in ("medusa", "eagle") and args.max_batch != 1:
        raise SpecDecodeError(f"--drafter {drafter} verifies trees one sequence at a time: pass --max-batch 1")
    return drafter


def run_serve(args) -> int:
    drafter_name = check_serve(args)
    from specdecode.commands.serve import run

    return run(args, drafter_name)
