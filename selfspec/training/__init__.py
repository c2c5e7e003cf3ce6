"""Shared recipe utilities: YAML -> dataclass configs with ``key=value`` overrides (``config``), accelerate setup
with trackers and the tokenized examples (``session``), the datasets pipeline and self-distillation (``data``),
chunked LM-head losses (``losses``), atomic, resumable checkpoints (``checkpoints``) and the ``Recipe`` base class
of the recipes (``medusa.recipe``, ``early_exit.recipe``).

Every public name is importable from here: ``from selfspec import training as T; T.load_config(...)``.
"""

from selfspec.training.checkpoints import (
                                           CHECKPOINT_PREFIX,
                                           TRAINER_STATE,
                                           checkpoint_dir,
                                           latest_checkpoint,
                                           load_checkpoint,
                                           save_checkpoint,
)
from selfspec.training.config import (
                                           DataConfig,
                                           LoggingConfig,
                                           LoraConfig,
                                           OptimConfig,
                                           apply_overrides,
                                           check_init_from,
                                           config_to_dict,
                                           flat_config,
                                           load_config,
                                           lr_lambda,
                                           parse_recipe_args,
                                           step_batches,
)
from selfspec.training.hidden import cached_hidden_states, examples_digest, hidden_states
from selfspec.training.losses import chunked_cross_entropy, chunked_kl, chunked_rank_counts
from selfspec.training.recipe import TIME_BUDGET, Recipe
from selfspec.training.session import count_parameters, global_mean_denominator, make_accelerator, prepare_examples

__all__ = [
    "CHECKPOINT_PREFIX", "TRAINER_STATE", "checkpoint_dir", "latest_checkpoint", "load_checkpoint", "save_checkpoint",
    "DataConfig", "LoggingConfig", "LoraConfig", "OptimConfig", "apply_overrides", "check_init_from", "config_to_dict", "flat_config",
    "load_config", "lr_lambda", "parse_recipe_args", "step_batches",
    "cached_hidden_states", "examples_digest", "hidden_states",
    "chunked_cross_entropy", "chunked_kl", "chunked_rank_counts",
    "Recipe", "TIME_BUDGET",
    "count_parameters", "global_mean_denominator", "make_accelerator", "prepare_examples",
]
