"""The benchmark at several batch sizes: plain HF ``generate`` on left-padded batches against selfspec's batched
speculative decoding (``decoding.batch.generate_batch``), tokens/s side by side per batch size, and every row
checked against its own batch-1 greedy answer.

Only ``vanilla`` and drafter methods (``lookup``, ``medusa:DIR``, ``eagle:DIR``, combinations) batch: HF's assisted
generation (``hf-pld``, ``hf-early-exit``) takes one sequence at a time, and early exit drafts inside the shared
KV cache.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from decoding.batch import generate_batch
from selfspec.bench.methods import DrafterMethod, GenSettings, parse_method
from selfspec.bench.runner import REFERENCE, Prompt


def _strip(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return tokens[:i + 1]
    return tokens[:limit]


def hf_batch(model: Any, prompts: Sequence[torch.Tensor], settings: GenSettings, pad_id: int) -> list[list[int]]:
    """HF greedy ``generate`` on one left-padded batch; each row's new tokens up to its first EOS."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - p.shape[1]:], mask[r, width - p.shape[1]:] = p[0], 1
    eos = settings.eos_token_id
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=settings.max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad_id)
    eos_set = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return [_strip(row[width:].tolist(), eos_set, settings.max_new_tokens) for row in out]


def run_batched(model: Any, prompts: Sequence[Prompt], specs: Sequence[str], batch_sizes: Sequence[int],
                settings: GenSettings, *, progress: bool = True) -> dict:
    """``{"batch_sizes": {B: {method: entry}}}``; each entry: tokens/s (all rows' new tokens over the summed wall
    time of the batches), speedup over ``vanilla`` at the same batch size, tau (tokens per row-step), and how many
    rows equal their batch-1 greedy answer (HF ``generate``, one prompt at a time).

    Raises:
        ValueError: a method that cannot batch, sampling settings (the check needs greedy), or no prompts.
    """
    if not settings.greedy:
        raise ValueError("the batched benchmark compares greedy outputs: use --temperature 0")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    methods = {}
    for spec in specs:
        method = parse_method(spec)
        if spec != REFERENCE and not isinstance(method, DrafterMethod):
            raise ValueError(f"method {spec!r} cannot decode batches (HF assisted generation takes one sequence); "
                             "batch vanilla and drafters: lookup, medusa:DIR, eagle:DIR, medusa:DIR+lookup")
        methods[spec] = method
    methods.setdefault(REFERENCE, parse_method(REFERENCE))
    methods = {REFERENCE: methods.pop(REFERENCE), **methods}
    eos = settings.eos_token_id
    pad_id = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
    inputs = [p.input_ids for p in prompts]
    reference = [hf_batch(model, [ids], settings, pad_id)[0] for ids in inputs]  # batch 1, untimed
    results: dict[int, dict] = {}
    bar = tqdm(total=len(batch_sizes) * len(methods), desc="bench (batched)", disable=not progress)
    for size in batch_sizes:
        groups = [inputs[i:i + size] for i in range(0, len(inputs), size)]
        entries = {}
        for name, method in methods.items():
            warm = GenSettings(min(8, settings.max_new_tokens), eos)
            if name == REFERENCE:
                hf_batch(model, groups[0], warm, pad_id)
            else:
                generate_batch(model, method.drafter(model), groups[0], max_new_tokens=warm.max_new_tokens,
                               eos_token_id=eos, pad_token_id=pad_id)
            rows, seconds, steps, step_tokens = [], 0.0, 0, 0
            for group in groups:
                start = time.perf_counter()
                if name == REFERENCE:
                    rows += hf_batch(model, group, settings, pad_id)
                else:
                    out = generate_batch(model, method.drafter(model), group, max_new_tokens=settings.max_new_tokens,
                                         eos_token_id=eos, pad_token_id=pad_id)
                    rows += [seq[0, ids.shape[1]:].tolist() for ids, seq in zip(group, out.sequences)]
                    steps += sum(s.steps for s in out.stats)
                    step_tokens += sum(sum(s.tokens_per_step) for s in out.stats)
                seconds += time.perf_counter() - start
            new = sum(len(r) for r in rows)
            entries[name] = {"tokens_per_s": new / seconds, "seconds": seconds, "new_tokens": new,
                             "tau": step_tokens / steps if steps else 1.0,
                             "identical": sum(a == b for a, b in zip(rows, reference)), "total": len(rows)}
            bar.update()
        for entry in entries.values():
            entry["speedup"] = entry["tokens_per_s"] / entries[REFERENCE]["tokens_per_s"]
        results[size] = entries
    bar.close()
    return {"batch_sizes": results}


def batched_table(results: dict) -> str:
    """Markdown: one row per method, per batch size tokens/s (speedup, tau) and identical rows."""
    sizes = list(results["batch_sizes"])
    methods = list(next(iter(results["batch_sizes"].values())))
    head = "| method | " + " | ".join(f"batch {b}: tokens/s (speedup, tau, identical)" for b in sizes) + " |"
    lines = [head, "|---|" + "---:|" * len(sizes)]
    for m in methods:
        cells = []
        for b in sizes:
            e = results["batch_sizes"][b][m]
            cells.append(f"{e['tokens_per_s']:.2f} ({e['speedup']:.2f}x, {e['tau']:.2f}, {e['identical']}/{e['total']})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
