"""`specdecode serve`: the OpenAI-compatible server (server/), put together from its flags
(defined in cli.py, so that `--help` loads no model code).

    specdecode serve --target smollm2-135m-instruct --port 8000
    specdecode serve --draft qwen2.5-coder-0.5b-instruct --dtype gguf --max-batch 8

The drafter is prompt lookup unless a draft model is named (`--draft`); `--drafter none`
serves plain decoding only. Each request may still ask for `"speculative": false` or a
fixed k. The goodput controller's costs are measured once per machine (seconds to a
minute) and cached under $SPECDECODE_HOME, as the single-sequence probe's are.
"""

from __future__ import annotations

import logging

import uvicorn

from specdecode.api import load_model
from specdecode.drafters import DraftModel, PromptLookup
from specdecode.plan import make_draft_model, make_drafter
from specdecode.policy import goodput
from specdecode.policy.probe import measured_costs
from specdecode.server.app import Service, create_app
from specdecode.server.metrics import ServerMetrics
from specdecode.server.scheduler import Scheduler

MAX_PASS_ROWS = 128  # the widest pass the controller's cost curve measures; past it, its last slope
CATCH_UP_ROWS = 64  # a draft model's catch-up is priced per token as a pass over this many rows


def build_service(args, drafter_name: str):
    """The scheduler, controller and web service for the flags (loads the models)."""
    target = load_model(args.target, args.dtype)
    model = target.model
    rows = getattr(model, "row_invariant_rows", None)  # a sequence's pass past it would round differently
    k_max = args.k_max if rows is None else min(args.k_max, rows - 1)
    new_drafter, draft_token_s, catch_up_token_s = None, 0.0, 0.0
    pass_costs = goodput.measured(model, min(MAX_PASS_ROWS, args.max_batch * (k_max + 1)))
    if drafter_name == "prompt-lookup":
        new_drafter = PromptLookup
    elif drafter_name in ("medusa", "eagle"):  # one sequence at a time: one drafter serves them all
        shared = make_drafter(target, drafter_name, None, args.dtype, args.heads)
        new_drafter = lambda: shared
    elif drafter_name == "draft-model":
        draft = make_draft_model(target, load_model(args.draft, args.dtype, as_draft=True)).model
        new_drafter = lambda: DraftModel(draft, model.vocab_size, max_len=1024)  # grows when a context needs it
        draft_ratio = measured_costs(model, draft).draft_ratio
        draft_token_s = draft_ratio * pass_costs(1)
        # a catch-up is a pass over many tokens: priced at the target's per-row cost of a wide pass
        catch_up_token_s = draft_ratio * pass_costs(CATCH_UP_ROWS) / CATCH_UP_ROWS
    name = args.served_model_name or args.target
    metrics = ServerMetrics(name)
    tree = drafter_name in ("medusa", "eagle")
    controller = (goodput.GoodputController(pass_costs, k_max, draft_token_s, catch_up_token_s)
                  if new_drafter and not tree else None)
    scheduler = Scheduler(model, controller, metrics, args.max_batch, args.max_queue)
    context = min(args.max_context, model.max_position_embeddings)
    return Service(scheduler, target.tokenizer, name, frozenset(target.info.eos_token_ids), context, new_drafter,
                   k_max, args.default_max_tokens, args.api_key, args.max_body_bytes, tree)


def run(args, drafter_name: str) -> int:
    """Serve until SIGTERM or ^C; the flags were checked (cli_serve.check_serve)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    service = build_service(args, drafter_name)
    speculation = ("off" if service.new_drafter is None else f"{drafter_name} trees, one sequence at a time"
                   if service.tree else f"{drafter_name}, k chosen per step up to {service.k_max}")
    print(f"serving {service.model_name} at http://{args.host}:{args.port}/v1 (speculation: {speculation}; "
          f"batch up to {args.max_batch}, context {service.context_len})", flush=True)
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    return 0
