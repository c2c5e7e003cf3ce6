"""transformers ``custom_generate`` entry point of selfspec (see ``selfspec.hf``): tree speculative decoding in place
of ``model.generate``'s loop, with the drafter named by ``draft`` (and its ``heads`` directory)."""

from __future__ import annotations

import torch


def generate(model, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
             streamer=None, draft: str = "none", heads: str | None = None, draft_options: dict | None = None,
             **kwargs):
    """Decode ``inputs`` (``[1, prompt]`` ids) with ``decoding.generate`` and the drafter ``draft``.

    Honours ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id`` (keywords or
    ``generation_config``), ``streamer``, ``stopping_criteria`` and ``stop_strings`` (with ``tokenizer``).

    Raises:
        ValueError: a batch of several prompts, left padding, or logits processors (not supported by this entry point
            yet: use plain ``model.generate`` for those).
    """
    from decoding import generate as speculative_generate
    from decoding.registry import make_drafter

    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("selfspec's custom_generate decodes one prompt: pass input_ids of shape [1, length]")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("selfspec's custom_generate takes an unpadded prompt (attention_mask all ones)")
    if logits_processor:
        raise ValueError("selfspec's custom_generate does not apply logits processors yet (they change the target "
                         "distribution per tree node); use model.generate without custom_generate for those")
    from transformers import StoppingCriteriaList, StopStringCriteria

    criteria = StoppingCriteriaList(stopping_criteria or [])
    stop_strings = kwargs.pop("stop_strings", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: pass tokenizer=... as with model.generate")
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    config = generation_config if generation_config is not None else model.generation_config

    def setting(name, default=None):
        value = kwargs.pop(name, None)
        return value if value is not None else getattr(config, name, default)

    max_new_tokens = setting("max_new_tokens") or 20
    sample = bool(setting("do_sample", False))
    temperature = float(setting("temperature", 1.0) or 1.0) if sample else 0.0
    top_k = setting("top_k") if sample else None
    top_p = setting("top_p") if sample else None
    eos = setting("eos_token_id")
    kwargs.pop("pad_token_id", None)
    drafter = make_drafter(draft, model, heads, **(draft_options or {}))
    out = speculative_generate(model, drafter, input_ids, max_new_tokens=int(max_new_tokens),
                               temperature=temperature, top_k=top_k or None,
                               top_p=top_p if top_p is not None and top_p < 1.0 else None,
                               eos_token_id=eos, streamer=streamer, stopping_criteria=criteria or None)
    return out.sequences
