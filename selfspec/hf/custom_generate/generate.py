"""transformers ``custom_generate`` entry point of selfspec (see ``selfspec.hf``): tree speculative decoding in place
of ``model.generate``'s loop, with the drafter named by ``draft`` (and its ``heads`` directory)."""

from __future__ import annotations

import torch


def generate(model, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
             streamer=None, draft: str = "none", heads: str | None = None, draft_options: dict | None = None,
             **kwargs):
    """Decode ``inputs`` (``[1, prompt]`` ids) with ``decoding.generate`` and the drafter ``draft``.

    Honours ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id`` (keywords or
    ``generation_config``), ``streamer``, ``stopping_criteria``, ``stop_strings`` (with ``tokenizer``), and the
    logits processors ``model.generate`` would build from the same settings (``repetition_penalty``,
    ``no_repeat_ngram_size``, ``bad_words_ids``, ``min_new_tokens``, ``sequence_bias``...) plus any passed as
    ``logits_processor``: transformers' own builder makes the list, and selfspec applies it to every tree node with
    that node's own prefix, so the output equals ``model.generate``'s.

    A batch (several rows, or padding marked by ``attention_mask``, left or right) decodes through
    ``decoding.batch.generate_batch`` and comes back as ``model.generate`` returns it: the prompts as given, then the
    new tokens right-padded with ``pad_token_id``.

    Raises:
        ValueError: a batch with a streamer, stopping criteria or logits processors (those need one unpadded prompt).
    """
    import copy

    from transformers import LogitsProcessorList

    from decoding import generate as speculative_generate
    from decoding.registry import make_drafter

    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None or input_ids.dim() != 2:
        raise ValueError("selfspec's custom_generate takes input_ids of shape [batch, length]")
    mask = kwargs.pop("attention_mask", None)
    batched = input_ids.shape[0] > 1 or (mask is not None and not bool(torch.as_tensor(mask).bool().all()))
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
    pad_id = kwargs.pop("pad_token_id", None)
    # The processors model.generate would build from these settings, without the sampling warpers (decoding applies
    # temperature / top-k / top-p itself, after the processors, in transformers' order).
    processor_config = copy.deepcopy(config)
    processor_config.update(**{k: kwargs.pop(k) for k in list(kwargs) if hasattr(processor_config, k)})
    processor_config.do_sample = False
    processor_config.eos_token_id = eos
    model._prepare_special_tokens(processor_config, True, device=input_ids.device)  # EOS tensors the processors read
    processors = model._get_logits_processor(
        generation_config=processor_config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
        logits_processor=LogitsProcessorList(logits_processor or []), device=input_ids.device, model_kwargs={})
    drafter = make_drafter(draft, model, heads, **(draft_options or {}))
    if batched:
        if criteria or streamer is not None or processors:
            raise ValueError("selfspec's custom_generate decodes a padded batch without streamers, stopping criteria "
                             "or logits processors: pass one unpadded prompt for those")
        return _generate_padded_batch(model, drafter, input_ids, mask, int(max_new_tokens), temperature,
                                      top_k or None, top_p if top_p is not None and top_p < 1.0 else None, eos,
                                      pad_id if pad_id is not None else getattr(config, "pad_token_id", None))
    out = speculative_generate(model, drafter, input_ids, max_new_tokens=int(max_new_tokens),
                               temperature=temperature, top_k=top_k or None,
                               top_p=top_p if top_p is not None and top_p < 1.0 else None,
                               eos_token_id=eos, streamer=streamer, stopping_criteria=criteria or None,
                               logits_processor=processors or None)
    return out.sequences


def _generate_padded_batch(model, drafter, input_ids, mask, max_new_tokens, temperature, top_k, top_p, eos, pad_id):
    """A padded batch (HF convention: ``attention_mask`` marks the real tokens, usually left-padded) through
    ``decoding.batch.generate_batch``; returns the prompts as given followed by each row's new tokens, right-padded
    with ``pad_id`` to the longest answer, as ``model.generate`` does."""
    from decoding.batch import generate_batch

    mask = torch.ones_like(input_ids) if mask is None else torch.as_tensor(mask).to(input_ids.device)
    pad_id = pad_id if pad_id is not None else (eos[0] if isinstance(eos, (list, tuple)) else eos)
    if pad_id is None:
        raise ValueError("a padded batch needs a pad_token_id (pass pad_token_id=...)")
    prompts = [row[m.bool()] for row, m in zip(input_ids, mask)]
    out = generate_batch(model, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                         top_p=top_p, eos_token_id=eos, pad_token_id=int(pad_id))
    new = [seq[0, len(p):] for p, seq in zip(prompts, out.sequences)]
    width = max(len(n) for n in new)
    tail = torch.full((len(new), width), int(pad_id), dtype=input_ids.dtype, device=input_ids.device)
    for r, n in enumerate(new):
        tail[r, :len(n)] = n
    return torch.cat([input_ids, tail], dim=1)
