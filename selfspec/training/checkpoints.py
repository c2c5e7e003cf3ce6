"""Atomic, resumable checkpoints: ``checkpoints/step-N`` under a run's output directory, each holding the
accelerate state (model, optimizer, scheduler, RNG of every process) and ``trainer_state.json`` (step, config).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

from selfspec.runtime.io import atomic_directory, atomic_write_text, is_complete

CHECKPOINT_PREFIX = "step-"
TRAINER_STATE = "trainer_state.json"


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint (``selfspec.runtime.io.is_complete``); half-written temporaries never count."""

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


def saved_trainer_state(path: Path) -> dict:
    """The trainer state saved with a checkpoint (``step``, the recipe's ``config``...), without loading it."""
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def load_checkpoint(accelerator, path: Path) -> dict:
    """Restore model, optimizer, scheduler and RNG states; returns the saved trainer state (``step``, ...)."""
    accelerator.load_state(str(path))
    return json.loads((path / TRAINER_STATE).read_text())
