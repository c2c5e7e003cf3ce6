"""Hidden states of a frozen base model over a training set, computed once and kept on disk for every recipe.

A frozen backbone gives the same hidden states every epoch, and to every recipe trained on the same data: Medusa
heads read the last one, an exit classifier its exit layer (and the last one as its teacher). On a CPU the pass
that computes them costs as much as a training run (a 135M model prefills ~500 tokens/s on 2 cores), so it runs
once per (model, example, layer) and is stored keyed by each example's token ids, in safetensors files written
atomically as the pass goes (``cached_hidden_states``). Point several recipes at one directory (``hidden_cache_dir``)
and they share the pass, also on data that only partly overlaps; a layer below the last one runs only the layers it
needs.

Layers use transformers' ``output_hidden_states`` indexing: ``0`` the embeddings, ``i`` the output of decoder layer
``i - 1``, ``-1`` the last hidden state (after the final norm: what the LM head reads).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.io import atomic_write_file
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


def example_key(example: dict) -> str:
    """The identity of one example in a cache: a digest of its token ids (the states depend on nothing else)."""
    return hashlib.sha256(json.dumps(example["input_ids"]).encode()).hexdigest()[:20]


def _layer_tag(layer: int) -> str:
    return "last" if layer == -1 else f"L{layer}"


def _stored_keys(directory: Path, fingerprint: str, layer: int) -> dict[str, Path]:
    """``{example key: file}`` for every example whose states of ``layer`` are stored under ``directory``."""
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for path in sorted(directory.glob(f"states-{fingerprint}-{_layer_tag(layer)}-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), path))
    return out


def _convert_legacy(directory: Path, fingerprint: str, examples: Sequence[dict], keys: list[str]) -> None:
    """Files of the first cache format (``hidden-<fingerprint>-<examples digest>-<layer>``, one per training set,
    keyed by position) for exactly these examples are rewritten keyed by example, so that other data mixes that
    share examples with them reuse their states."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    digest = examples_digest(examples)
    for path in directory.glob(f"hidden-{fingerprint}-{digest}-*.safetensors"):
        tag = path.stem.rsplit("-", 1)[1]
        with safe_open(str(path), framework="pt") as f:
            if len(f.keys()) != len(examples):
                continue
            rekeyed = {keys[int(i)]: f.get_tensor(i) for i in f.keys()}
        # straight to disk: no second copy of a multi-GB file in memory
        atomic_write_file(directory / f"states-{fingerprint}-{tag}-{digest}.safetensors",
                          lambda tmp: save_file(rekeyed, str(tmp)))
        rekeyed.clear()
        path.unlink()


def cached_hidden_states(model, examples: Sequence[dict], layers: Sequence[int], directory: str | Path, *,
                         pad_id: int = 0, batch_size: int = 8, accelerator: Any = None,
                         progress: Callable[[Any], Any] | None = None,
                         also: Sequence[int] = (), chunk_examples: int = 512,
                         chunk_bytes: int = 1 << 30,
                         dtype: torch.dtype | Mapping[int, torch.dtype | None] | None = None,
                         ) -> dict[int, list[torch.Tensor]]:
    """``{layer: [one [len, hidden] tensor per example]}``: the base's states of ``layers``, computed (by the main
    process) only for the examples whose states are not yet stored under ``directory``, then read back by every
    process.

    States are stored per example, keyed by a digest of its token ids (``example_key``), in
    ``states-<model fingerprint>-<layer>-<chunk digest>.safetensors`` files of up to ``chunk_examples`` examples
    (or ``chunk_bytes`` of states in memory), each written atomically as soon as it is complete. So a run on more
    data (another corpus added, a larger ``num_samples``) computes only what is new, and a pass killed part way
    resumes after its last chunk. A file of the first format (one per training set, keyed by position) is converted
    when a run on that same training set, in that order, reads it.

    ``progress``: wraps the batch iterator (e.g. ``tqdm``) while computing.
    ``also``: more layers to store in the same pass when one has to run (not returned): recipes that will train
    on other layers of the same data (an exit-layer sweep) then skip the pass.
    ``dtype``: the states are returned in it, or ``{layer: dtype}`` (read one at a time, so the float32 copies never
    all sit in memory); the files stay float32. None (or a layer not in the mapping): as stored. A state that
    overflows it (float16 above 65504) raises ValueError.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fingerprint = base_model_identity(model).get("fingerprint", "model")
    keys = [example_key(e) for e in examples]
    main = accelerator is None or accelerator.is_main_process
    everything = list(dict.fromkeys([*layers, *also]))
    if main:
        _convert_legacy(directory, fingerprint, examples, keys)
        stored = {layer: _stored_keys(directory, fingerprint, layer) for layer in everything}
        first: dict[str, int] = {}  # an example that occurs twice is computed once
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        todo = [i for k, i in first.items() if any(k not in stored[layer] for layer in layers)]
        if todo:
            missing = [layer for layer in everything if any(keys[i] not in stored[layer] for i in todo)]
            # Batches of similar lengths: padding to the longest of a random batch would double the work.
            todo.sort(key=lambda i: len(examples[i]["input_ids"]))
            states: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in missing}
            held = 0  # bytes of states in memory

            def flush():
                for layer in missing:
                    fresh = {k: t for k, t in states[layer].items() if k not in stored[layer]}
                    if fresh:
                        chunk = hashlib.sha256("".join(sorted(fresh)).encode()).hexdigest()[:16]
                        atomic_write_file(directory / f"states-{fingerprint}-{_layer_tag(layer)}-{chunk}.safetensors",
                                          lambda tmp: save_file(fresh, str(tmp)))
                    states[layer].clear()

            starts = range(0, len(todo), batch_size)
            for start in (progress(starts) if progress is not None else starts):
                chunk = todo[start:start + batch_size]
                batch = collate([examples[i] for i in chunk], pad_id)
                out = hidden_states(model, batch["input_ids"], batch["attention_mask"], missing)
                for layer in missing:
                    for row, i in enumerate(chunk):
                        state = out[layer][row, :len(examples[i]["input_ids"])].float().contiguous()
                        states[layer][keys[i]] = state
                        held += state.numel() * state.element_size()
                if len(states[missing[0]]) >= chunk_examples or held >= chunk_bytes:
                    flush()
                    held = 0
            if states[missing[0]]:
                flush()
    if accelerator is not None:
        accelerator.wait_for_everyone()
    result = {}
    for layer in layers:
        held_as = dtype.get(layer) if isinstance(dtype, Mapping) else dtype
        where = _stored_keys(directory, fingerprint, layer)
        absent = [k for k in keys if k not in where]
        if absent:
            raise ValueError(f"hidden-state cache {directory}: {len(absent)} example(s) missing for layer {layer} "
                             "after the pass that computes them; delete the directory's states-* files and rerun")
        by_file: dict[Path, list[int]] = {}
        for i, k in enumerate(keys):
            by_file.setdefault(where[k], []).append(i)
        tensors: list[torch.Tensor | None] = [None] * len(keys)
        for path, indices in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for i in indices:
                    stored = f.get_tensor(keys[i])
                    state = stored if held_as is None else stored.to(held_as)
                    if held_as is not None and not torch.isfinite(state).all():
                        raise ValueError(f"hidden-state cache {directory}: layer {layer}'s states overflow "
                                         f"{held_as} (largest magnitude {float(stored.abs().max()):g}); hold them "
                                         "in bfloat16 (float32's range) or float32")
                    tensors[i] = state
        result[layer] = tensors
    return result
