"""What a recipe runs on: an ``Accelerator`` with trackers, the tokenized train/eval examples, and the bookkeeping
DDP needs for exact global means. (The base model comes from ``selfspec.runtime.models.load_model``, as everywhere.)
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from selfspec.training import data as D
from selfspec.training.config import DataConfig


def make_accelerator(output_dir: str | Path, report_to: str, gradient_accumulation_steps: int = 1, seed: int = 0,
                     mixed_precision: str | None = None):
    """An ``Accelerator`` logging to ``report_to`` (``none``, ``wandb``, ``tensorboard``, ...), wandb offline unless
    ``WANDB_MODE`` says otherwise, with every process seeded identically. ``mixed_precision``: ``no``, ``bf16``,
    ``fp16``, or None for what ``accelerate launch`` was told (default ``no``)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    if report_to == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(output_dir))
    accelerator = Accelerator(
        # Without a GPU, say so: then a multi-process launch (torchrun, or `accelerate launch --multi_gpu
        # --num_processes N`) runs DDP on CPU over gloo instead of N independent single-process runs.
        cpu=not torch.cuda.is_available(),
        log_with=None if report_to in ("none", "", None) else report_to,
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        # Recipes step the scheduler once per optimizer step and count their schedule in optimizer steps; by default
        # accelerate would step it num_processes times per call, so DDP runs would race through warm-up and decay.
        step_scheduler_with_optimizer=False,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(Path(output_dir) / "logs")),
    )
    set_seed(seed)
    if (accelerator.mixed_precision == "bf16" and accelerator.device.type == "cpu"
            and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        warnings.warn("optim.mixed_precision=bf16 on a CPU without native bfloat16 (no AVX512-BF16 or AMX): it is "
                      "emulated and slower than fp32 here; set optim.mixed_precision=no", stacklevel=2)
    return accelerator


def global_mean_denominator(accelerator, count: torch.Tensor) -> torch.Tensor:
    """The per-process divisor that makes DDP's gradient average equal the mean over all processes' items:
    ``total_items / num_processes`` (so a 2-process run matches one process with the same global batch)."""
    total = accelerator.reduce(count.detach().float().clone(), reduction="sum")
    return total.clamp(min=1.0) / accelerator.num_processes


def prepare_examples(data: DataConfig, model, tokenizer, work_dir: str | Path, accelerator, seed: int = 0):
    """``(train, eval)`` tokenized examples for a recipe. Self-distilled data (and self-generated prompts) are made
    once by the main process under ``work_dir`` and reused when the run resumes.

    Raises:
        ValueError / FileNotFoundError: bad data (see ``selfspec.training.data``), before any training starts.
    """
    from tqdm.auto import tqdm

    work_dir = Path(work_dir)
    source = data.source
    if source is None or data.distill:
        out = work_dir / "distilled"
        if accelerator.is_main_process:
            if data.source is not None:
                prompts = D.prompts_from_source(data.source, data.num_prompts)
            else:
                with tqdm(total=data.num_prompts, desc="prompts", unit="prompt") as bar:
                    prompts = D.resolve_prompts(data.prompts, model, tokenizer, out, num_prompts=data.num_prompts,
                                                max_new_tokens=data.prompt_max_new_tokens, seed=seed,
                                                temperature=data.prompt_temperature,
                                                batch_size=data.generation_batch_size, progress=bar.update)
            with tqdm(total=len(prompts), desc="self-distilling", unit="prompt") as bar:
                D.distill(model, tokenizer, prompts, out, max_new_tokens=data.max_new_tokens, seed=seed,
                          batch_size=data.generation_batch_size, temperature=data.temperature, progress=bar.update)
        accelerator.wait_for_everyone()
        source = str(out)
    records = D.load_records(source, data.split)
    examples = D.tokenize_records(records, tokenizer, fmt="sharegpt" if source != data.source else data.format,
                                  max_length=data.max_length, assistant_only=data.assistant_only,
                                  num_samples=data.num_samples)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    if data.eval_source is not None:
        held_out = D.tokenize_records(D.load_records(data.eval_source, data.split), tokenizer, fmt=data.format,
                                      max_length=data.max_length, assistant_only=data.assistant_only,
                                      num_samples=data.eval_samples or None)
        seen = {tuple(e["input_ids"]) for e in held_out}  # what is held out never trains
        return [examples[i] for i in order if tuple(examples[i]["input_ids"]) not in seen], held_out
    n_eval = min(data.eval_samples, len(examples) // 2)
    if len(examples) - n_eval < 1:
        raise ValueError(f"only {len(examples)} usable example(s): too few to train on")
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]


def count_parameters(module: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
