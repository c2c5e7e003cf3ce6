"""Load a ``selfspec export --format speculators`` directory with vLLM's ``speculators`` package itself and check that
its Eagle3DraftModel computes the same draft logits as selfspec's drafter on the same base-model features.

speculators pins other transformers/datasets versions than this project, so install it beside, not into, the
environment (its import chain needs a few small packages; torch and transformers come from this environment)::

    pip install --target /tmp/specsite --no-deps speculators==0.9.0 loguru pydantic-settings python-dotenv \\
        typing-inspection openai jiter distro sniffio anyio hs_connectors
    selfspec export --format speculators --heads heads/smollm2-135m-instruct-eagle3 --out /tmp/spec-out
    PYTHONPATH=/tmp/specsite python scripts/check_speculators_export.py /tmp/spec-out \\
        --heads heads/smollm2-135m-instruct-eagle3

Prints the keys speculators did not find (expected: only ``embed_tokens`` and the ``verifier_*`` tensors, which
vLLM takes from the served model and which serve training only) and the largest logit difference.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the exported directory")
    parser.add_argument("--heads", required=True, help="the selfspec drafter that was exported")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)

    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from eagle.model import from_pretrained
    from selfspec.runtime.models import load_model
    from selfspec.training.hidden import hidden_states

    config = Eagle3SpeculatorConfig.from_pretrained(args.out)
    config.speculators_config.verifier.name_or_path = None  # the verifier is loaded here, not downloaded
    theirs = Eagle3DraftModel(config).eval()
    missing, unexpected = theirs.load_state_dict(load_file(f"{args.out}/model.safetensors"), strict=False)
    print(f"speculators {config.speculators_model_type}: draft vocabulary {config.draft_vocab_size}, aux layers "
          f"{config.eagle_aux_hidden_state_layer_ids}; not in the export: {missing}; unexpected: {unexpected}")
    if unexpected or set(missing) - {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}:
        print("FAIL: the export does not match speculators' Eagle3DraftModel")
        return 1
    model, tokenizer = load_model(args.model)
    model.eval()
    ours = from_pretrained(args.heads, model).eval()
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        ids = tokenizer("Speculative decoding drafts several tokens and verifies them in one forward pass.",
                        return_tensors="pt").input_ids
        aux = hidden_states(model, ids, torch.ones_like(ids), list(ours.config.aux_layers))
        aux = [aux[layer] for layer in ours.config.aux_layers]
        s = ids.shape[1]
        following = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)  # the token after each position
        causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
        mine = ours.logits(ours.step(ours.fuse(aux), following, torch.arange(s)[None], causal, None))
        captured = {}
        theirs.lm_head.register_forward_hook(lambda m, i, o: captured.setdefault("logits", o))
        theirs(hidden_states=torch.cat(aux, dim=-1), input_ids=following, document_ids=torch.zeros(1, s, dtype=torch.long),
               ttt_steps=1)
    diff = (captured["logits"] - mine).abs().max().item()
    same_top1 = bool(torch.equal(captured["logits"].argmax(-1), mine.argmax(-1)))
    print(f"first draft step over {s} positions: max |logit difference| {diff:.2e}, same top-1 everywhere: {same_top1}")
    return 0 if diff < 1e-3 and same_top1 else 1


if __name__ == "__main__":
    sys.exit(main())
