"""Hidden states of a frozen base model over a training set, computed once and kept on disk for every recipe.

A frozen backbone gives the same hidden states every epoch, and to every recipe trained on the same data: Medusa
heads read the last one, an exit classifier its exit layer (and the last one as its teacher). On a CPU the pass
that computes them costs as much as a training run (a 135M model prefills ~500 tokens/s on 2 cores), so it runs
once per (model, examples, layer) and is stored as ``hidden-<model fingerprint>-<examples digest>-<layer>``
safetensors files, written atomically. Point several recipes at one directory (``hidden_cache_dir``) and they
share the pass; a layer below the last one runs only the layers it needs.

Layers use transformers' ``output_hidden_states`` indexing: ``0`` the embeddings, ``i`` the output of decoder layer
``i - 1``, ``-1`` the last hidden state (after the final norm: what the LM head reads).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.io import atomic_write_bytes
from selfspec.runtime.layers import decoder_layers, num_decoder_layers
from selfspec.training.data import collate


class _Stop(Exception):
    pass


def examples_digest(examples: Sequence[dict]) -> str:
    """A digest of the examples' token ids (order included): the identity of a training set."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps(e["input_ids"]).encode())
    return h.hexdigest()[:16]


@torch.no_grad()
def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """``{layer: [b, s, hidden]}`` for a batch; stops after the deepest layer asked for unless ``-1`` is asked."""
    total = num_decoder_layers(model)
    wanted = sorted({total if layer == -1 else layer for layer in layers})
    if wanted and wanted[-1] >= total:
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        states = out.hidden_states
        return {layer: (out.last_hidden_state if layer in (-1, total) else states[layer]) for layer in layers}
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    stack = decoder_layers(model)

    def capture(index: int, last: bool) -> Callable:
        def hook(module, args, output):
            captured[index] = (output[0] if isinstance(output, tuple) else output).detach()
            if last:
                raise _Stop
        return hook

    if 0 in wanted:  # what the first layer reads: embeddings after any position embedding or scaling
        def first_input(module, args, kwargs):
            captured[0] = (args[0] if args else kwargs["hidden_states"]).detach()
            if wanted[-1] == 0:
                raise _Stop
        hooks.append(stack[0].register_forward_pre_hook(first_input, with_kwargs=True))
    for layer in wanted:
        if layer > 0:
            hooks.append(stack[layer - 1].register_forward_hook(capture(layer, layer == wanted[-1])))
    try:
        model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    return {layer: captured[layer] for layer in layers}


def cached_hidden_states(model, examples: Sequence[dict], layers: Sequence[int], directory: str | Path, *,
                         pad_id: int = 0, batch_size: int = 8, accelerator: Any = None,
                         progress: Callable[[Any], Any] | None = None,
                         also: Sequence[int] = ()) -> dict[int, list[torch.Tensor]]:
    """``{layer: [one [len, hidden] tensor per example]}``, computed (by the main process) for the layers not yet
    stored under ``directory``, then read back by every process.

    ``progress``: wraps the batch iterator (e.g. ``tqdm``) while computing.
    ``also``: more layers to store in the same pass when one has to run (not returned): recipes that will train
    on other layers of the same data (an exit-layer sweep) then skip the pass.
    """
    from safetensors.torch import load_file, save

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fingerprint = base_model_identity(model).get("fingerprint", "model")
    digest = examples_digest(examples)
    paths = {layer: directory / f"hidden-{fingerprint}-{digest}-{'last' if layer == -1 else f'L{layer}'}.safetensors"
             for layer in dict.fromkeys([*layers, *also])}
    missing = [layer for layer in layers if not paths[layer].is_file()]
    if missing:
        missing += [layer for layer in paths if layer not in missing and not paths[layer].is_file()]
    main = accelerator is None or accelerator.is_main_process
    if missing and main:
        states: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in missing}
        # Batches of similar lengths: padding to the longest of a random batch would double the work.
        by_length = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))
        starts = range(0, len(examples), batch_size)
        for start in (progress(starts) if progress is not None else starts):
            chunk = by_length[start:start + batch_size]
            batch = collate([examples[i] for i in chunk], pad_id)
            out = hidden_states(model, batch["input_ids"], batch["attention_mask"], missing)
            for layer in missing:
                for row, i in enumerate(chunk):
                    states[layer][str(i)] = out[layer][row, :len(examples[i]["input_ids"])].float().contiguous()
        for layer in missing:
            atomic_write_bytes(paths[layer], save(states.pop(layer)))
    if accelerator is not None:
        accelerator.wait_for_everyone()
    result = {}
    for layer in layers:
        stored = load_file(str(paths[layer]))
        if len(stored) != len(examples):
            raise ValueError(f"{paths[layer]} holds {len(stored)} examples, expected {len(examples)}: delete it")
        result[layer] = [stored[str(i)] for i in range(len(examples))]
    return result
