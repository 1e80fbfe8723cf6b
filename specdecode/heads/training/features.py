"""Run documents through the frozen target: its hidden states and its own predictions.

For every position t of every document the target's hidden state at the chosen layers
and its label: the target's argmax at t, the token it would emit after position t.
Documents are run one per pass (a fresh cache each), so nothing crosses a document's
end; `doc_ids` says which position belongs to which document.

Features are saved as one safetensors file, so an interrupted training resumes without
running the target again (`train medusa` writes them into its work folder first).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass
class Features:
    tokens: torch.Tensor  # (T,) long, the input tokens
    labels: torch.Tensor  # (T,) long, the target's argmax after each position
    doc_ids: torch.Tensor  # (T,) long
    hidden: dict[int, torch.Tensor]  # layer -> (T, H) bf16
    # (T,) bool: positions inside the target's own answer (from its prompt's last token on),
    # where decoding drafts; tree shapes are chosen by accuracy there. None: none are.
    drafted: torch.Tensor | None = None
    # What each document was made from, by doc id (instructions.py), for a held-out split
    # by source. Derived from the prompts again at each load, so not saved. None: unknown.
    sources: list[str] | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def save(self, path: Path) -> None:
        tensors = {"tokens": self.tokens, "labels": self.labels, "doc_ids": self.doc_ids}
        tensors |= {f"hidden.{layer}": h.contiguous() for layer, h in self.hidden.items()}
        if self.drafted is not None:
            tensors["drafted"] = self.drafted
        partial = path.with_name(path.name + ".partial")
        save_file(tensors, partial)
        partial.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Features":
        t = load_file(path)
        hidden = {int(name.split(".")[1]): v for name, v in t.items() if name.startswith("hidden.")}
        return cls(t["tokens"], t["labels"], t["doc_ids"], hidden, t.get("drafted"))

    def drafted_among(self, indices: torch.Tensor) -> torch.Tensor:
        """The drafted ones among `indices`, or all of them when no position is drafted."""
        if self.drafted is None or not bool(self.drafted[indices].any()):
            return indices
        return indices[self.drafted[indices]]


def collect(model, documents: list[list[int]], layers: tuple[int, ...], progress=None) -> Features:
    """Teacher-forced passes over each document; progress(num_tokens) after each."""
    tokens, labels, doc_ids, hidden = [], [], [], {layer: [] for layer in layers}
    for index, doc in enumerate(documents):
        ids = torch.tensor([doc])
        cache = model.new_cache(1, len(doc))
        out = model(ids, cache, hidden_layers=layers)
        tokens.append(ids[0])
        labels.append(out.logits[0].argmax(dim=-1))
        doc_ids.append(torch.full((len(doc),), index))
        for layer in layers:
            hidden[layer].append(out.hidden_states[layer][0].to(torch.bfloat16))
        if progress:
            progress(len(doc))
    return Features(torch.cat(tokens), torch.cat(labels), torch.cat(doc_ids),
                    {layer: torch.cat(h) for layer, h in hidden.items()})


def concat(parts: list[Features]) -> Features:
    """One training set of several, each part's documents numbered after the last part's."""
    parts = [p for p in parts if len(p)]
    offset, doc_ids = 0, []
    for part in parts:
        doc_ids.append(part.doc_ids - int(part.doc_ids.min()) + offset)
        offset = int(doc_ids[-1].max()) + 1
    layers = parts[0].hidden.keys()
    drafted = None
    if any(p.drafted is not None for p in parts):
        drafted = torch.cat([p.drafted if p.drafted is not None else torch.zeros(len(p), dtype=torch.bool)
                             for p in parts])
    # sources, one per doc id from each part's first: they follow the renumbering
    sources = sum((p.sources for p in parts), []) if all(p.sources is not None for p in parts) else None
    return Features(torch.cat([p.tokens for p in parts]), torch.cat([p.labels for p in parts]), torch.cat(doc_ids),
                    {layer: torch.cat([p.hidden[layer] for p in parts]) for layer in layers}, drafted, sources)
