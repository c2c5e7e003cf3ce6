"""Prompts: Spec-Bench / MT-bench JSONL files and chat-template encoding."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_prompts(path: str | Path, limit: int | None = None, *, spread: bool = False) -> list[dict]:
    """Read a Spec-Bench style JSONL file: one object a line with ``turns`` (first turn is used) or ``prompt``;
    the first ``limit`` prompts, or with ``spread`` ``limit`` prompts evenly spaced over the whole file (MT-bench
    lists its categories in blocks of ten: the first six are all writing, six spread ones cover every category).

    Returns a list of ``{"id", "category", "prompt"}``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not JSON or has neither ``turns`` nor ``prompt``; the file holds no prompt.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with 'turns' or 'prompt', got "
                             f"{type(obj).__name__}")
        if obj.get("turns"):
            text = obj["turns"][0]
        elif "prompt" in obj:
            text = obj["prompt"]
        else:
            raise ValueError(f"{path}:{lineno}: expected a 'turns' list (Spec-Bench format) or a 'prompt' string")
        out.append({"id": obj.get("question_id", obj.get("id", lineno)), "category": obj.get("category"), "prompt": text})
        if limit is not None and len(out) >= limit and not spread:
            break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return choose_prompts(out, limit, spread=spread)


def choose_prompts(prompts: list, limit: int | None, *, spread: bool = False) -> list:
    """The first ``limit`` of ``prompts`` (all with None), or with ``spread`` ``limit`` of them evenly spaced."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    if spread:
        return [prompts[i * len(prompts) // limit] for i in range(limit)]
    return list(prompts[:limit])


def encode_prompt(tokenizer, text: str, *, chat: bool = True) -> torch.Tensor:
    """``[1, seq]`` input ids: the user turn with the model's chat template (and generation prompt) when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.tensor([list(ids)], dtype=torch.long)
    return tokenizer(text, return_tensors="pt").input_ids
