"""The README written beside saved Medusa heads: what they are for, how they were made, and how good they are."""

from __future__ import annotations

import json

from decoding import by_machine
from medusa.config import MedusaConfig


def _accuracy_table(head_accuracy: list[list[float]]) -> list[str]:
    lines = ["| head | predicts | top-1 | top-5 (cumulative) |", "|---|---|---|---|"]
    for k, row in enumerate(head_accuracy):
        lines.append(f"| {k} | t+{k + 2} | {row[0]:.3f} | {sum(row[:5]):.3f} |" if row else f"| {k} | t+{k + 2} | | |")
    return lines


def _compact(value) -> str:
    """One-line JSON with floats rounded, for metric lists such as per-head accuracies."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_compact(v) for v in value) + "]"
    return json.dumps(value)


def render_readme(config: MedusaConfig) -> str:
    """Markdown model card for ``config``: base model, shape, the exact command, recipe, metrics, head accuracies."""
    base = config.base_model or {}
    training = dict(config.training or {})
    command = training.pop("command", None)
    metrics = training.pop("metrics", None)
    name = base.get("name") or base.get("name_or_path") or "an unnamed base model"
    lines = [
        f"# Medusa heads for {name}",
        "",
        f"{config.num_heads} heads x {config.num_layers} ResBlock(s), "
        f"{'sharing the base model LM head (not stored here)' if config.share_lm_head else 'each with its own LM head'}; "
        f"hidden size {config.hidden_size}, vocabulary {config.vocab_size}. "
        "Head k drafts the token k + 2 positions after its input hidden state"
        + (" and reads the embedding of the path's token at depth k and head k - 1's state (sequential, "
           "Hydra-style: each depth is drafted for its parent)." if config.sequential else ".")
        + (f" The heads start from a prefix-attention block (one causal attention layer over the base's last hidden "
           f"states, each position reading its next token; {config.prefix_num_heads} heads of "
           f"{config.prefix_head_dim}, MLP {config.prefix_mlp_size or 'none'})." if config.prefix_attention else ""),
        "",
        "```python",
        "import medusa, decoding",
        "drafter = medusa.load(model, HEADS_DIR)  # refuses heads made for another base model",
        "out = decoding.generate(model, drafter, input_ids, max_new_tokens=256)",
        "```",
        "",
    ]
    if config.backbone_adapter:
        lines += ["These heads were trained with Medusa-2: the backbone carries the LoRA adapter in "
                  f"`{config.backbone_adapter.get('path')}/`. They decode the adapted model, which "
                  "`selfspec.runtime.models.load_model(HEADS_DIR)` loads (base + merged adapter); "
                  "`medusa.load(base, HEADS_DIR, merge_adapter=True)` merges it into a loaded base in place.", ""]
    if command:
        lines += ["## Made with", "", "```sh", str(command), "```", ""]
    if base:
        # weight_sample only serves the dtype-tolerant identity check; it is noise to a reader.
        shown = {key: value for key, value in base.items() if key != "weight_sample"}
        lines += ["## Base model", ""] + [f"- {key}: `{value}`" for key, value in shown.items()] + [""]
    if training:
        lines += ["## Recipe", ""]
        flat = {key: value for key, value in training.items() if not isinstance(value, dict)}
        lines += [f"- {key}: `{json.dumps(value)}`" for key, value in sorted(flat.items())]
        for key, value in sorted(training.items()):
            if isinstance(value, dict):
                lines += ["", f"{key}:", "", "```json", json.dumps(value, indent=2), "```"]
        lines.append("")
    if metrics:
        lines += ["## Metrics", ""] + [f"- {key}: `{_compact(value)}`" for key, value in metrics.items()] + [""]
    if config.head_accuracy:
        lines += ["## Head accuracy (held-out)", ""] + _accuracy_table(config.head_accuracy) + [""]
    if config.dynamic_tree or config.tree is not None:
        lines += [f"Default drafting: {_drafting(config.tree, config.dynamic_tree)}.", ""]
    lines += by_machine.card_lines(config.drafting_by_machine,
                                   lambda policy: _drafting(policy.get("tree"), policy.get("dynamic_tree")))
    return "\n".join(lines)


def _drafting(tree: list | None, dynamic: dict | None) -> str:
    if dynamic:
        return (f"a dynamic tree of {dynamic['size']} nodes per step (the most probable paths, "
                f"{dynamic.get('width', 4)} expanded per depth, top-{dynamic.get('top_k', 4)} children each)")
    if tree:
        return f"a static tree of {len(tree)} nodes, depth {max(len(p) for p in tree)}"
    return "no tree (plain decoding)" if tree == [] else "the default tree"
