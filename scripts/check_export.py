"""Load a ``selfspec export`` directory with the serving side's own code and check that it drafts the logits
selfspec's drafter drafts on the same base-model features (the first draft step over a test sentence):

- ``--format speculators`` -> vLLM ``speculators``' ``Eagle3DraftModel``;
- ``--format eagle3`` (``sglang``) -> SpecForge's ``LlamaForCausalLMEagle3``, the reference model whose checkpoints
  SGLang serves.

Both packages pin other transformers/datasets versions than this project, so install them beside, not into, the
environment (torch and transformers come from this environment)::

    pip install --target /tmp/site --no-deps speculators==0.9.0 specforge==0.2.0 loguru pydantic-settings \\
        python-dotenv typing-inspection openai jiter distro sniffio anyio hs_connectors
    selfspec export --format speculators --heads heads/smollm2-135m-instruct-eagle3 --out /tmp/spec-out \\
        --dtype float32     # (eagle3 exports default to bfloat16, whose rounding alone exceeds the 1e-3 check)
    PYTHONPATH=/tmp/site python scripts/check_export.py /tmp/spec-out --heads heads/smollm2-135m-instruct-eagle3

Prints the tensors the package did not find in the export (expected: only the embedding table, which the engine
takes from the served model, and speculators' training-only ``verifier_*`` tensors) and the largest logit
difference; exits 1 when they differ.
"""

from __future__ import annotations

import argparse
import sys

import torch

#: tensors an export leaves out on purpose: the verifier's embedding (and speculators' training-only copies)
NOT_EXPORTED = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}


def speculators_logits(out: str, aux: list[torch.Tensor], following: torch.Tensor, embedding: torch.Tensor):
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(out)
    config.speculators_config.verifier.name_or_path = None  # the verifier is loaded here, not downloaded
    theirs = Eagle3DraftModel(config).eval()
    missing, unexpected = theirs.load_state_dict(load_file(f"{out}/model.safetensors"), strict=False)
    print(f"speculators {config.speculators_model_type}: draft vocabulary {config.draft_vocab_size}, aux layers "
          f"{config.eagle_aux_hidden_state_layer_ids}; not in the export: {missing}; unexpected: {unexpected}")
    theirs.embed_tokens.weight.copy_(embedding)
    captured = {}
    theirs.lm_head.register_forward_hook(lambda m, i, o: captured.setdefault("logits", o))
    s = following.shape[1]
    theirs(hidden_states=torch.cat(aux, dim=-1), input_ids=following, document_ids=torch.zeros(1, s, dtype=torch.long),
           ttt_steps=1)
    return captured["logits"], missing, unexpected


def specforge_logits(out: str, aux: list[torch.Tensor], following: torch.Tensor, embedding: torch.Tensor):
    from safetensors.torch import load_file
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(out)
    theirs = LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()
    state = load_file(f"{out}/model.safetensors")
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    ids = config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    print(f"specforge {type(theirs).__name__}: draft vocabulary {config.draft_vocab_size}, aux layer ids {ids} "
          f"(outputs of those layers); not in the export: {missing}; unexpected: {unexpected}")
    theirs.embed_tokens.weight.copy_(embedding)
    normed = theirs(hidden_states=torch.cat(aux, dim=-1), inputs_embeds=theirs.embed_input_ids(following),
                    ttt_length=1)  # the draft layer's output after the final norm
    return theirs.lm_head(normed), missing, unexpected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the exported directory")
    parser.add_argument("--heads", required=True, help="the selfspec drafter that was exported")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args(argv)

    from eagle.export import directory_format
    from eagle.model import from_pretrained
    from selfspec.runtime.models import load_model
    from selfspec.training.hidden import hidden_states

    kind = directory_format(args.out)
    if kind == "selfspec":
        print(f"FAIL: {args.out} is neither a speculators nor an eagle3 export")
        return 1
    model, tokenizer = load_model(args.model)
    model.eval()
    ours = from_pretrained(args.heads, model).eval()
    with torch.no_grad():
        ids = tokenizer("Speculative decoding drafts several tokens and verifies them in one forward pass.",
                        return_tensors="pt").input_ids
        states = hidden_states(model, ids, torch.ones_like(ids), list(ours.config.aux_layers))
        aux = [states[layer] for layer in ours.config.aux_layers]
        s = ids.shape[1]
        following = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)  # the token after each position
        causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
        mine = ours.logits(ours.step(ours.fuse(aux), following, torch.arange(s)[None], causal, None))
        check = speculators_logits if kind == "speculators" else specforge_logits
        theirs, missing, unexpected = check(args.out, aux, following, model.get_input_embeddings().weight)
    if unexpected or set(missing) - NOT_EXPORTED:
        print(f"FAIL: the export does not match the {kind} model's tensors")
        return 1
    diff = (theirs - mine).abs().max().item()
    same_top1 = bool(torch.equal(theirs.argmax(-1), mine.argmax(-1)))
    print(f"first draft step over {s} positions: max |logit difference| {diff:.2e}, same top-1 everywhere: {same_top1}")
    return 0 if diff < 1e-3 and same_top1 else 1


if __name__ == "__main__":
    sys.exit(main())
