"""Run inside a virtual environment with `speculators` (not this project's): the draft
tokens an exported EAGLE-3 head proposes, computed by speculators' own model.

    python speculators_drafts.py HEAD_DIR INPUTS.safetensors OUT.safetensors STEPS

INPUTS holds `hidden` (T, 3H: the target's three layers at each position), `input_ids`
(T: the token that follows each position), `positions` (T) and `embed` (the target's
embedding, which an export leaves out). OUT gets `drafts` (STEPS, T): target token ids,
step s as speculators' training-time test computes it (steps after the first read the
head's own states and the true next tokens).
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(head_dir: str, inputs: str, out: str, steps: int) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(head_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # plain attention on a CPU
    model = Eagle3DraftModel.from_pretrained(head_dir, config=config, dtype=torch.float32).eval()
    data = load_file(inputs)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(data["embed"])
        drafts = model(hidden_states=data["hidden"][None].float(), input_ids=data["input_ids"][None],
                       document_ids=torch.zeros_like(data["input_ids"])[None],
                       position_ids=data["positions"][None], ttt_steps=steps)
    ids = torch.stack([d[0] for d in drafts])  # draft-vocabulary ids
    if model.d2t is not None:
        ids = ids + model.d2t[ids]
    save_file({"drafts": ids.contiguous()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
