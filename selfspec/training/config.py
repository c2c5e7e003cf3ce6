"""Recipe configuration: YAML -> dataclass configs with ``key=value`` overrides, the sections every recipe shares
(data, optimizer, logging, LoRA), the command line, and what the optimizer config decides (the learning-rate
schedule and the batches of each optimizer step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from pathlib import Path

import torch
import yaml

from selfspec.training.data import FORMATS


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
        key = f"{where}.{name}" if where else name
        if _is_dataclass_type(tp):
            value = _build(tp, value or {}, key)
        else:
            value = _checked(value, tp, key)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid config{' section ' + where if where else ''}: {e}") from None


_UNIONS = (typing.Union, types.UnionType)  # Optional[X] and X | None


def _describe(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNIONS:
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0])}" if args else "a list"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _checked(value, tp, key: str):
    """``value`` as field type ``tp`` (an integer where a number is expected becomes a float).

    Raises:
        ValueError: naming the key, the expected type and the value given.
    """
    def convert(v, t):
        origin, args = typing.get_origin(t), typing.get_args(t)
        if t is typing.Any or t is object:
            return v
        if origin in _UNIONS:
            for option in args:
                if option is type(None):
                    if v is None:
                        return None
                    continue
                try:
                    return convert(v, option)
                except TypeError:
                    pass
            raise TypeError
        if origin is list:
            if not isinstance(v, list):
                raise TypeError
            return [convert(x, args[0]) for x in v] if args else v
        if origin is dict:
            if not isinstance(v, dict):
                raise TypeError
            return v
        if t is bool:
            if not isinstance(v, bool):
                raise TypeError
            return v
        if t is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError
            return v
        if t is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError
            return float(v)
        if t is str:
            if not isinstance(v, str):
                raise TypeError
            return v
        return v  # other annotations: the dataclass checks them

    try:
        return convert(value, tp)
    except TypeError:
        hint = (" (YAML reads an unquoted yes/no/on/off/true/false as a boolean: quote the word you meant, e.g. "
                f"{key}=\"'no'\")" if isinstance(value, bool) and _takes_str(tp) else "")
        raise ValueError(f"config key {key}: expected {_describe(tp)}, got {value!r}{hint} (fix it in the YAML file "
                         f"or override it: {key}=VALUE)") from None


def _takes_str(tp) -> bool:
    """Whether field type ``tp`` accepts a string (``str``, or a union with ``str``)."""
    return tp is str or (typing.get_origin(tp) in _UNIONS and str in typing.get_args(tp))


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


#: keys a resumed run may change without --allow-changed: budgets, lengths, logging and where things are written
RESUMABLE_CHANGES = ("resume", "num_threads", "heads_dir", "hidden_cache_dir", "hidden_cache_layers",
                     "hidden_cache_dtype", "optim.max_minutes", "optim.max_steps", "optim.mixed_precision",
                     "optim.base_linear_backend",
                     "optim.epochs", "logging.report_to", "logging.project", "logging.log_every",
                     "logging.save_every", "logging.keep_last", "logging.eval_every")


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resume_config(saved: dict, current: dict, allowed: tuple[str, ...] | list[str] = ()) -> None:
    """Refuse to resume a checkpoint under a recipe that changed, other than in ``RESUMABLE_CHANGES`` or ``allowed``.

    Raises:
        ValueError: naming each changed key with its saved and current value, and the flag that accepts them.
    """
    old, new = _flat(saved), _flat(current)
    changed = [k for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES and k not in allowed]
    if changed:
        listed = "; ".join(f"{k}: {old.get(k)!r} in the checkpoint, {new.get(k)!r} now" for k in changed)
        raise ValueError(f"--resume: the recipe changed since the checkpoint ({listed}). Resume with the saved "
                         f"values, start a new output_dir, or accept the change with --allow-changed "
                         f"{','.join(changed)}")


def parse_recipe_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """``--config PATH [--resume [--allow-changed KEYS]] [key=value ...]``: the command line shared by every recipe."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="recipe YAML (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--allow-changed", default="", metavar="KEYS",
                        help="with --resume: comma-separated config keys (section.key) that may differ from the "
                             "checkpoint's recipe")
    parser.add_argument("overrides", nargs="*", help="config overrides: key=value or section.key=value")
    return parser.parse_intermixed_args(argv)  # flags and key=value overrides in any order


@dataclasses.dataclass
class DataConfig:
    """Where the training conversations come from and how they are tokenized (shared by every recipe)."""

    source: str | list[str] | None = None  # hub id or local json/jsonl/parquet/arrow file or dir, or a list of them
    # (concatenated); None: self-distilled data
    format: str = "auto"  # auto | sharegpt | alpaca | prompt_response | text
    split: str = "train"  # split of a hub dataset
    max_length: int = 512  # tokens per example after the chat template (longer ones are truncated)
    assistant_only: bool = True  # loss on assistant tokens only (False: every token)
    num_samples: int | None = None  # use at most this many examples (None: all)
    eval_samples: int = 16  # examples held out for the per-head accuracy
    # Held-out examples from another dataset instead (its first eval_samples, 0: all; all of source trains):
    # e.g. the model's own answers to the prompts you tune on, to measure what a drafter learns for them.
    eval_source: str | list[str] | None = None
    distill: bool = False  # with a source: re-answer its prompts with the base model (self-distillation)
    prompts: str = "builtin"  # without a source: builtin | self (sampled from the model) | path to a prompts dataset
    num_prompts: int = 64  # prompts to self-generate (prompts=self) or to take at most
    prompt_max_new_tokens: int = 48  # length limit of a self-generated prompt
    prompt_temperature: float = 1.0  # sampling temperature of self-generated prompts
    max_new_tokens: int = 256  # length limit of a self-distilled response
    temperature: float = 0.0  # response sampling temperature (0: greedy, best for greedy decoding)
    generation_batch_size: int = 16  # prompts generated at once (left-padded)

    def __post_init__(self):
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
    # Time budget: after this many minutes of training the run checkpoints, evaluates, saves what it has and
    # stops; ``--resume`` with the same config continues where it stopped (None: no budget).
    max_minutes: float | None = None
    # Autocast for the trained module's forward and loss (weights, optimizer state and the teacher stay fp32):
    # no | bf16 | fp16, or None for accelerate's choice (`accelerate launch --mixed_precision`, default no). bf16 is
    # ~1.9x faster for the EAGLE drafter on a CPU with AVX512-BF16 or AMX (lscpu: avx512_bf16, amx_bf16) and slower
    # on one without; on GPUs it is the usual choice.
    # (YAML reads an unquoted ``no`` as false: ``optim.mixed_precision=no`` means "no", as in accelerate's configs.)
    mixed_precision: str | bool | None = None
    # Batch examples of similar length (HF Trainer's group_by_length): each epoch's shuffled order is cut into
    # groups of 50 optimizer steps, sorted by length inside a group, and the group's batches shuffled again. Less
    # padding per batch (the EAGLE recipe's step costs its longest row x batch size); the same examples per epoch.
    group_by_length: bool = False
    # Kernels of the frozen base's no-grad forwards (the features and the teacher every recipe reads): auto (the
    # faster of stock and onednn on this machine, measured once: selfspec.runtime.kernels.batch_backend) | stock
    # (PyTorch's default GEMM) | onednn. They agree to float32 rounding; on a Zen 5 EPYC oneDNN ran the feature pass
    # 1.7x faster than stock. Forwards with gradients (LoRA) always run stock.
    base_linear_backend: str = "auto"

    def __post_init__(self):
        if self.mixed_precision is False:
            self.mixed_precision = "no"
        if self.mixed_precision not in (None, "no", "bf16", "fp16"):
            raise ValueError(f"optim.mixed_precision must be no, bf16, fp16 or null (accelerate's choice), got "
                             f"{self.mixed_precision!r}")
        if self.max_minutes is not None and (isinstance(self.max_minutes, bool)
                                             or not isinstance(self.max_minutes, (int, float))
                                             or not self.max_minutes > 0):
            raise ValueError(f"optim.max_minutes must be a number of minutes > 0 (or null: no budget), "
                             f"got {self.max_minutes!r}")
        if self.base_linear_backend not in ("auto", "stock", "onednn"):
            raise ValueError(f"optim.base_linear_backend must be auto, stock or onednn, got "
                             f"{self.base_linear_backend!r}")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"optim.schedule must be cosine or constant, got {self.schedule!r}")
        if self.batch_size < 1 or self.gradient_accumulation_steps < 1 or self.epochs < 1:
            raise ValueError("optim.batch_size, gradient_accumulation_steps and epochs must be >= 1")
        if not (math.isfinite(self.lr) and self.lr >= 0):  # 0 trains nothing (a loss measurement), but is valid
            raise ValueError(f"optim.lr must be a finite learning rate >= 0, got {self.lr!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.warmup_steps < 0 or (self.max_steps is not None and self.max_steps < 1):
            raise ValueError("optim.warmup_steps must be >= 0 and optim.max_steps >= 1 (or null)")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"optim.max_grad_norm must be > 0 (or null: no clipping), got {self.max_grad_norm!r}")


@dataclasses.dataclass
class LoggingConfig:
    """Trackers and checkpoints."""

    report_to: str = "none"  # none | wandb (offline unless WANDB_MODE says otherwise) | tensorboard | all
    project: str = "selfspec"  # tracker project name
    log_every: int = 10  # optimizer steps between logged training losses
    save_every: int | None = None  # optimizer steps between checkpoints (None: only at the end)
    keep_last: int = 2  # checkpoints kept on disk
    eval_every: int | None = None  # optimizer steps between held-out evaluations during training (None: at the end only)


@dataclasses.dataclass
class LoraConfig:
    """A LoRA adapter on the backbone (``peft``), for the recipes that fine-tune it."""

    r: int = 8  # LoRA rank
    alpha: int = 16  # LoRA scaling numerator
    dropout: float = 0.0  # LoRA dropout
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["q_proj", "v_proj"])  # adapted layers


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Multiplier of the peak learning rate at each step: linear warm-up, then cosine to zero or constant."""
    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / (optim.warmup_steps + 1)
        if optim.schedule == "constant":
            return 1.0
        progress = (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


LENGTH_GROUP_STEPS = 50  # optimizer steps per length group (HF's LengthGroupedSampler uses megabatches of 50)


def epoch_order(num_examples: int, epoch: int, optim: OptimConfig, num_processes: int, seed: int = 0,
                lengths: list[int] | None = None) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits the examples: a seeded permutation, or with ``optim.group_by_length``
    (and ``lengths``) that permutation cut into groups of ``LENGTH_GROUP_STEPS`` optimizer steps, each sorted by
    length (longest first) and cut into global batches, which are shuffled again within the group."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(num_examples, generator=generator)
    if not optim.group_by_length or lengths is None:
        return order
    if len(lengths) != num_examples:
        raise ValueError(f"{len(lengths)} lengths for {num_examples} examples")
    batch = optim.batch_size * num_processes * optim.gradient_accumulation_steps
    size = batch * LENGTH_GROUP_STEPS
    length = torch.as_tensor(lengths)
    grouped = []
    for start in range(0, num_examples, size):
        group = order[start:start + size]
        group = group[torch.argsort(length[group], descending=True, stable=True)]
        batches = list(group.split(batch))
        grouped += [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return torch.cat(grouped) if grouped else order


def step_batches(num_examples: int, step: int, steps_per_epoch: int, optim: OptimConfig, accelerator,
                 seed: int = 0, lengths: list[int] | None = None) -> list[list[int]]:
    """This process's micro-batches of optimizer step ``step``: a per-epoch seeded order (``epoch_order``) cut into
    global batches, of which process ``i`` takes slice ``i``. The same examples are seen in total however many
    processes run, and a resumed run sees exactly the batches the uninterrupted run would have."""
    epoch, within = divmod(step, steps_per_epoch)
    order = epoch_order(num_examples, epoch, optim, accelerator.num_processes, seed, lengths)
    micro, out = optim.batch_size * accelerator.num_processes, []
    for m in range(optim.gradient_accumulation_steps):
        start = (within * optim.gradient_accumulation_steps + m) * micro + accelerator.process_index * optim.batch_size
        out.append(order[start:start + optim.batch_size].tolist())
    return out


def check_init_from(init_from: str | None, heads_dir: str | None, output_dir: str) -> None:
    """A recipe that starts from saved heads (``init_from``) must save its own elsewhere.

    Raises:
        ValueError: ``init_from`` is the directory the run would save to (``heads_dir``, or ``<output_dir>/heads``).
    """
    if init_from is None:
        return
    target = Path(heads_dir) if heads_dir else Path(output_dir) / "heads"
    if target.resolve() == Path(init_from).resolve():
        raise ValueError(f"init_from {init_from} is also where this run would save (heads_dir): set heads_dir to "
                         "another directory (or null: <output_dir>/heads) so the heads it starts from are kept")
