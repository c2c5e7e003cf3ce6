"""Shared recipe utilities: YAML -> dataclass configs with ``key=value`` overrides, the base model loader used by
recipes (including ``tiny:<arch>`` test models), accelerate setup with trackers, chunked LM-head losses, and atomic,
resumable checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import typing
from pathlib import Path
from typing import Any

import torch
import yaml

CHECKPOINT_PREFIX = "step-"
TRAINER_STATE = "trainer_state.json"


# ---------------------------------------------------------------- configs

def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"config section {where or '<root>'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(f"unknown config key(s) {[prefix + k for k in unknown]}; "
                         f"known keys{' under ' + where if where else ''}: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if _is_dataclass_type(tp):
            value = _build(tp, value or {}, f"{where}.{name}" if where else name)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid config{' section ' + where if where else ''}: {e}") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` overrides to a nested dict (values parsed as YAML: ``3``, ``true``, ``null``, ``[1, 2]``).

    Raises:
        ValueError: an override without ``=``.
    """
    data = json.loads(json.dumps(data))  # deep copy of plain YAML data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value (or section.key=value)")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a config section")
            node = child
        node[leaf] = yaml.safe_load(raw) if raw != "" else ""
    return data


def load_config(cls, path: str | Path | None = None, overrides: list[str] = ()):
    """Build the dataclass ``cls`` from a YAML file plus ``key=value`` overrides.

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ValueError: a key that is not a field (the message names it and lists the known keys), or a bad value.
    """
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    return _build(cls, apply_overrides(data, list(overrides)), "")


def config_to_dict(config) -> dict:
    return dataclasses.asdict(config)


def flat_config(config) -> dict:
    """``{"optim.lr": 0.001, ...}``: a config as flat scalars, the form trackers (wandb, tensorboard) take."""
    def walk(d: dict, prefix: str):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return dict(walk(config_to_dict(config), ""))


def parse_recipe_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """``--config PATH [--resume] [key=value ...]``: the command line shared by every recipe."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="recipe YAML (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("overrides", nargs="*", help="config overrides: key=value or section.key=value")
    return parser.parse_args(argv)


@dataclasses.dataclass
class DataConfig:
    """Where the training conversations come from and how they are tokenized (shared by every recipe)."""

    source: str | None = None  # hub id or local json/jsonl/parquet/arrow file or dir; None: self-distilled data
    format: str = "auto"  # auto | sharegpt | alpaca | prompt_response | text
    split: str = "train"  # split of a hub dataset
    max_length: int = 512  # tokens per example after the chat template (longer ones are truncated)
    assistant_only: bool = True  # loss on assistant tokens only (False: every token)
    num_samples: int | None = None  # use at most this many examples (None: all)
    eval_samples: int = 16  # examples held out for the per-head accuracy
    distill: bool = False  # with a source: re-answer its prompts with the base model (self-distillation)
    prompts: str = "builtin"  # without a source: builtin | self (sampled from the model) | path to a prompts dataset
    num_prompts: int = 64  # prompts to self-generate (prompts=self) or to take at most
    prompt_max_new_tokens: int = 48  # length limit of a self-generated prompt
    prompt_temperature: float = 1.0  # sampling temperature of self-generated prompts
    max_new_tokens: int = 256  # length limit of a self-distilled response
    temperature: float = 0.0  # response sampling temperature (0: greedy, best for greedy decoding)
    generation_batch_size: int = 16  # prompts generated at once (left-padded)

    def __post_init__(self):
        from selfspec.data import FORMATS
        if self.format != "auto" and self.format not in FORMATS:
            raise ValueError(f"data.format {self.format!r} is not one of auto, {', '.join(FORMATS)}")
        if self.max_length < 4 or self.eval_samples < 0 or self.generation_batch_size < 1:
            raise ValueError("data.max_length must be >= 4, eval_samples >= 0 and generation_batch_size >= 1")


@dataclasses.dataclass
class OptimConfig:
    """Optimizer and schedule (AdamW, linear warm-up then cosine decay)."""

    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear warm-up steps
    schedule: str = "cosine"  # cosine | constant (after warm-up)
    batch_size: int = 8  # examples per process per micro-batch (global batch = this x processes x accumulation)
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    epochs: int = 1  # passes over the training split
    max_steps: int | None = None  # stop after this many optimizer steps (None: epochs decide)
    max_grad_norm: float | None = 1.0  # gradient clipping (None: off)

    def __post_init__(self):
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"optim.schedule must be cosine or constant, got {self.schedule!r}")
        if self.batch_size < 1 or self.gradient_accumulation_steps < 1 or self.epochs < 1:
            raise ValueError("optim.batch_size, gradient_accumulation_steps and epochs must be >= 1")


@dataclasses.dataclass
class LoggingConfig:
    """Trackers and checkpoints."""

    report_to: str = "none"  # none | wandb (offline unless WANDB_MODE says otherwise) | tensorboard | all
    project: str = "selfspec"  # tracker project name
    log_every: int = 10  # optimizer steps between logged training losses
    save_every: int | None = None  # optimizer steps between checkpoints (None: only at the end)
    keep_last: int = 2  # checkpoints kept on disk


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Multiplier of the peak learning rate at each step: linear warm-up, then cosine to zero or constant."""
    import math

    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def step_batches(num_examples: int, step: int, steps_per_epoch: int, optim: OptimConfig, accelerator,
                 seed: int = 0) -> list[list[int]]:
    """This process's micro-batches of optimizer step ``step``: a per-epoch seeded permutation cut into global
    batches, of which process ``i`` takes slice ``i``. The same examples are seen in total however many processes
    run, and a resumed run sees exactly the batches the uninterrupted run would have."""
    epoch, within = divmod(step, steps_per_epoch)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed + epoch))
    micro, out = optim.batch_size * accelerator.num_processes, []
    for m in range(optim.gradient_accumulation_steps):
        start = (within * optim.gradient_accumulation_steps + m) * micro + accelerator.process_index * optim.batch_size
        out.append(order[start:start + optim.batch_size].tolist())
    return out


def prepare_examples(data: DataConfig, model, tokenizer, work_dir: str | Path, accelerator, seed: int = 0):
    """``(train, eval)`` tokenized examples for a recipe. Self-distilled data (and self-generated prompts) are made
    once by the main process under ``work_dir`` and reused when the run resumes.

    Raises:
        ValueError / FileNotFoundError: bad data (see ``selfspec.data``), before any training starts.
    """
    from selfspec import data as D
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
    n_eval = min(data.eval_samples, len(examples) // 2)
    if len(examples) - n_eval < 1:
        raise ValueError(f"only {len(examples)} usable example(s): too few to train on")
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]


# ---------------------------------------------------------------- models

def load_base_model(name: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``. ``tiny:<arch>`` builds a tiny random model (``selfspec.testing``) with a byte-level
    tokenizer that has a chat template, for smoke tests; anything else goes through ``selfspec.models.load_model``."""
    if name.startswith("tiny:"):
        from selfspec.testing import tiny_model
        tokenizer = byte_tokenizer()
        model = tiny_model(name.split(":", 1)[1], vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                           dtype=dtype)
        with torch.no_grad():  # a random model would often end a turn at once; never emit special tokens instead
            model.get_output_embeddings().weight[tokenizer.all_special_ids] = 0
        return model, tokenizer
    from selfspec.models import load_model
    return load_model(name, dtype=dtype)


_BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A 260-token byte-level tokenizer (4 specials + 256 bytes) with a ChatML template: no download needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials + sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>",
                                        bos_token="<|endoftext|>", additional_special_tokens=specials[2:])
    tokenizer.chat_template = _BYTE_CHAT_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------- accelerate

def make_accelerator(output_dir: str | Path, report_to: str, gradient_accumulation_steps: int = 1, seed: int = 0):
    """An ``Accelerator`` logging to ``report_to`` (``none``, ``wandb``, ``tensorboard``, ...), wandb offline unless
    ``WANDB_MODE`` says otherwise, with every process seeded identically."""
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
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(Path(output_dir) / "logs")),
    )
    set_seed(seed)
    return accelerator


def global_mean_denominator(accelerator, count: torch.Tensor) -> torch.Tensor:
    """The per-process divisor that makes DDP's gradient average equal the mean over all processes' items:
    ``total_items / num_processes`` (so a 2-process run matches one process with the same global batch)."""
    total = accelerator.reduce(count.detach().float().clone(), reduction="sum")
    return total.clamp(min=1.0) / accelerator.num_processes


# ---------------------------------------------------------------- losses

class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of ``features @ weight.T + bias`` whose backward is computed during the forward, one
    chunk at a time: ``d loss / d logits = softmax - onehot`` needs no stored logits, so memory is one
    ``[chunk, vocab]`` block and the LM head runs once forward and once for the gradients (no recomputation)."""

    @staticmethod
    def forward(ctx, features, weight, bias, targets, chunk_size):
        total = torch.zeros((), dtype=torch.float32, device=features.device)
        grad_features = torch.zeros_like(features) if features.requires_grad else None
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        for start in range(0, features.shape[0], chunk_size):
            f, t = features[start:start + chunk_size], targets[start:start + chunk_size]
            logits = torch.nn.functional.linear(f, weight, bias).float()  # [chunk, vocab]
            total += torch.nn.functional.cross_entropy(logits, t, reduction="sum")
            d_logits = logits.softmax(-1)
            d_logits[torch.arange(len(t)), t] -= 1.0
            d_logits = d_logits.to(f.dtype)
            if grad_features is not None:
                grad_features[start:start + chunk_size] = d_logits @ weight
            if grad_weight is not None:
                grad_weight += d_logits.T @ f
            if grad_bias is not None:
                grad_bias += d_logits.sum(0)
        grads = (grad_features, grad_weight, grad_bias)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
        ctx.has = (grad_features is not None, grad_weight is not None, grad_bias is not None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grads = [g * grad_output if has else None for g, has in zip(ctx.saved_tensors, ctx.has)]
        return grads[0], grads[1], grads[2], None, None


def _chunk_loss(features, weight, bias, targets):
    logits = torch.nn.functional.linear(features, weight, bias).float()  # [chunk, vocab]
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def _chunk_kl(features, reference, weight, bias):
    log_q = torch.log_softmax(torch.nn.functional.linear(features, weight, bias).float(), dim=-1)  # [chunk, vocab]
    log_p = torch.log_softmax(torch.nn.functional.linear(reference, weight, bias).float(), dim=-1)
    return torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="sum")


def _chunked(fn, tensors, params, chunk_size: int) -> torch.Tensor:
    """Sum of ``fn`` over row chunks of ``tensors``; with autograd on, each chunk's logits are recomputed in
    backward (activation checkpointing), so memory holds one ``[chunk_size, vocab]`` block at a time."""
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*tensors, *params))
    for start in range(0, tensors[0].shape[0], chunk_size):
        parts = [t[start:start + chunk_size] for t in tensors]
        if needs_grad:
            total = total + torch.utils.checkpoint.checkpoint(fn, *parts, *params, use_reentrant=False)
        else:
            total = total + fn(*parts, *params)
    return total


def chunked_cross_entropy(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 1024, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Summed cross entropy of ``features @ weight.T (+ bias)`` ([n, hidden] -> [n, vocab]) against ``targets``,
    never holding more than one chunk of logits (gradients are formed chunk by chunk during the forward)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (features, weight, bias)):
        return _LinearCrossEntropy.apply(features, weight, bias, targets, chunk_size)
    return _chunked(lambda f, t, w, b: _chunk_loss(f, w, b, t), (features, targets), (weight, bias), chunk_size)


def chunked_kl(features: torch.Tensor, reference: torch.Tensor, weight: torch.Tensor, chunk_size: int = 1024,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Summed KL(reference distribution || features' distribution) through the same LM head, chunked."""
    return _chunked(lambda f, r, w, b: _chunk_kl(f, r, w, b), (features, reference), (weight, bias), chunk_size)


@torch.no_grad()
def chunked_rank_counts(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, top_k: int = 10,
                        chunk_size: int = 1024, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[top_k]`` counts: how often the target is the rank-``r`` prediction of ``features @ weight.T``."""
    counts = torch.zeros(top_k, dtype=torch.long)
    for start in range(0, features.shape[0], chunk_size):
        logits = torch.nn.functional.linear(features[start:start + chunk_size], weight, bias)
        top = logits.topk(top_k, dim=-1).indices  # [chunk, top_k]
        counts += (top == targets[start:start + chunk_size, None]).sum(0).cpu()
    return counts


# ---------------------------------------------------------------- checkpoints

def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (``selfspec.io.is_complete``); half-written temporaries never count."""
    from selfspec.io import is_complete

    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name) and is_complete(p)]
    return max(done, key=_checkpoint_step, default=None)


def _checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX):])


def save_checkpoint(accelerator, output_dir: str | Path, step: int, trainer_state: dict, keep_last: int = 2) -> Path:
    """``accelerator.save_state`` into a temporary directory made by the main process (``atomic_directory``) and
    shared with every process (each writes its RNG state, or its shard under FSDP/DeepSpeed); the directory
    appears at ``checkpoints/step-N`` only once everyone has finished, so a checkpoint is complete or invisible."""
    from accelerate.utils import broadcast_object_list
    from selfspec.io import atomic_directory, atomic_write_text

    final = checkpoint_dir(output_dir, step)
    main = accelerator.is_main_process
    with atomic_directory(final) if main else contextlib.nullcontext() as temp:
        shared = [str(temp) if main else None]
        if accelerator.num_processes > 1:
            broadcast_object_list(shared)
        accelerator.save_state(shared[0], safe_serialization=True)
        accelerator.wait_for_everyone()
        if main:
            atomic_write_text(Path(shared[0]) / TRAINER_STATE, json.dumps({**trainer_state, "step": step}, indent=2))
    if main and keep_last > 0:
        done = sorted((p for p in final.parent.iterdir() if re.fullmatch(rf"{CHECKPOINT_PREFIX}\d+", p.name)),
                      key=_checkpoint_step)
        for stale in done[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore model, optimizer, scheduler and RNG states; returns the saved trainer state (``step``, ...)."""
    accelerator.load_state(str(path))
    return json.loads((path / TRAINER_STATE).read_text())


def count_parameters(module: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

