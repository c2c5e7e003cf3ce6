"""Training data: load conversations through ``datasets`` (hub ids, local json/jsonl/parquet/arrow), detect their
format, apply the chat template with a loss mask on assistant tokens, and make data with the base model itself
(self-generated prompts, self-distilled responses in resumable shards).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from selfspec.runtime.cache import new_cache, select_rows
from selfspec.runtime.io import atomic_write_text
from selfspec.runtime.prompts import read_prompts
from selfspec.training.task_prompts import task_prompts

FORMATS = {
    "sharegpt": "a 'conversations' (from/value or role/content) or 'messages' (role/content) list",
    "alpaca": "'instruction' and 'output' columns (optional 'input')",
    "prompt_response": "'prompt' and 'response' columns",
    "text": "a 'text' column (plain text, loss on every token, no chat template)",
}
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bard": "assistant", "model": "assistant", "system": "system"}
_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}

BUILTIN_PROMPTS = [
    "Explain how a rainbow forms.", "Write a short poem about the sea.", "What are the benefits of regular exercise?",
    "Give me three tips for learning a new language.", "Describe the water cycle in simple terms.",
    "What is the difference between weather and climate?", "Write a haiku about autumn leaves.",
    "How do I make a cup of tea?", "Summarize the plot of Romeo and Juliet.", "What is photosynthesis?",
    "List five fruits that are high in vitamin C.", "Explain what a computer program is to a child.",
    "Write a Python function that reverses a string.", "Why is the sky blue?", "How does a bicycle work?",
    "What should I pack for a weekend camping trip?", "Write a friendly email inviting a colleague to lunch.",
    "What are the planets in our solar system?", "Give me a recipe for a simple pasta dish.",
    "How can I improve my sleep?", "Explain gravity in two sentences.", "What is the capital of France?",
    "Write a short story about a lost dog finding its way home.", "What is machine learning?",
    "How do plants grow from seeds?", "Suggest a name for a coffee shop and explain why.",
    "What causes earthquakes?", "Describe your ideal weekend.", "How do vaccines work?",
    "Write a limerick about a cat.", "What are some ways to save money?", "Explain the rules of chess briefly.",
]


# ---------------------------------------------------------------- loading

def _check_json_lines(path: Path) -> None:
    """Raises: ValueError: naming the file and line of the first line that is not a JSON object."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path}, line {number}: not valid JSON ({e.msg} at column {e.colno}); fix or "
                                 "remove that line") from None
            if not isinstance(record, dict):
                raise ValueError(f"dataset {path}, line {number}: expected a JSON object, got "
                                 f"{type(record).__name__}; each line must be one record")


def load_records(source: str | list[str], split: str = "train"):
    """A ``datasets.Dataset`` from a local file / directory / saved dataset, or a hub id; a list of sources is
    their concatenation, in order (``data.source=[runs/distill-v1,runs/distill-broad]``).

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
        ValueError: the hub id cannot be loaded (no network or no such dataset), the dataset is empty, or listed
            sources whose columns differ.
    """
    import datasets

    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("data source: an empty list; name at least one dataset")
        parts = [load_records(str(s), split) for s in source]
        formats = [detect_format(part.column_names) for part in parts]
        for s, fmt in zip(source[1:], formats[1:]):
            if fmt != formats[0]:
                raise ValueError(f"data sources {source[0]!r} ({formats[0]}) and {s!r} ({fmt}) are in different "
                                 "formats; list only datasets of one format (or convert one)")
        # Columns one source has and another lacks (a 'source' tag, say) are dropped; ids are compared as text.
        common = [c for c in parts[0].column_names if all(c in part.column_names for part in parts[1:])]
        parts = [part.select_columns(common) for part in parts]
        if "id" in common:
            parts = [part if part.features["id"] == datasets.Value("string")
                     else part.cast_column("id", datasets.Value("string")) for part in parts]
        try:
            return datasets.concatenate_datasets(parts)
        except ValueError as e:
            raise ValueError(f"data sources {list(source)}: the same columns hold different types ({e}); list only "
                             "datasets written the same way") from None
    path = Path(source).expanduser()
    if path.is_dir() and (path / "dataset_info.json").is_file():
        records = datasets.load_from_disk(str(path))
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _FILE_BUILDERS)
        # A self-distillation directory (scripts/self_distill.py) keeps its prompts beside the finished shards.
        shards = [p for p in files if p.name.startswith("shard-")]
        files = shards or files
        for file in files:
            if file.suffix == ".jsonl":
                _check_json_lines(file)
        if not files:
            raise FileNotFoundError(f"dataset directory {path} holds no json/jsonl/parquet/arrow file")
        records = datasets.load_dataset(_FILE_BUILDERS[files[0].suffix], data_files=[str(f) for f in files],
                                        split="train")
    elif path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            raise ValueError(f"dataset file {path}: unsupported extension; use one of {sorted(_FILE_BUILDERS)}")
        if path.stat().st_size == 0:
            raise ValueError(f"dataset {source} is empty")
        if path.suffix == ".jsonl":
            _check_json_lines(path)
        records = datasets.load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
    elif source.startswith((".", "/", "~")) or path.suffix in _FILE_BUILDERS:
        raise FileNotFoundError(f"dataset file {source} does not exist")
    else:
        try:
            records = datasets.load_dataset(source, split=split)
        except Exception as e:  # noqa: BLE001 - the hub raises many types; all mean "cannot load this id"
            raise ValueError(f"cannot load dataset {source!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
                             "pass a local json/jsonl/parquet file instead") from None
    if isinstance(records, datasets.DatasetDict):
        records = records[split]
    if len(records) == 0:
        raise ValueError(f"dataset {source} is empty")
    return records


def detect_format(columns) -> str:
    """The name of the format (a key of ``FORMATS``) that ``columns`` fit.

    Raises:
        ValueError: no known format fits (the message names the columns seen and the formats accepted).
    """
    columns = set(columns)
    if columns & {"conversations", "messages"}:
        return "sharegpt"
    if {"instruction", "output"} <= columns:
        return "alpaca"
    if {"prompt", "response"} <= columns:
        return "prompt_response"
    if "text" in columns:
        return "text"
    accepted = "; ".join(f"{name}: {what}" for name, what in FORMATS.items())
    raise ValueError(f"unknown dataset format: columns seen {sorted(columns)}; formats accepted: {accepted}")


def to_messages(record: dict, fmt: str) -> list[dict]:
    """One record as ``[{"role", "content"}, ...]`` (``[]`` for the ``text`` format)."""
    if fmt == "sharegpt":
        turns = record.get("conversations") or record.get("messages") or []
        out = []
        for turn in turns:
            role = turn.get("role", turn.get("from"))
            content = turn.get("content", turn.get("value"))
            if role not in _ROLES:
                raise ValueError(f"unknown conversation role {role!r}; known: {sorted(_ROLES)}")
            out.append({"role": _ROLES[role], "content": content or ""})
        return out
    if fmt == "alpaca":
        user = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"] or ""}]
    if fmt == "prompt_response":
        return [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"] or ""}]
    if fmt == "text":
        return []
    raise ValueError(f"unknown dataset format {fmt!r}; formats accepted: {sorted(FORMATS)}")


# ---------------------------------------------------------------- tokenization

def _template_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    """A conversation's ids with the chat template. A tokenizer without one (a base model, e.g. the Gemma 3 270M
    GGUF) reads a conversation as its plain text, the turns one after another with the tokenizer's own special
    tokens (its BOS): how ``selfspec.runtime.prompts.encode_prompt`` encodes a prompt for such a model, so an answer
    is the prompt's continuation, the text it was generated as."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer("".join(m["content"] for m in messages)).input_ids
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False).input_ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_conversation(tokenizer, messages: list[dict], *, max_length: int, assistant_only: bool = True) -> dict:
    """``{"input_ids", "loss_mask"}`` for one conversation with the chat template applied.

    The mask is exact whatever the template: for every assistant turn ``i`` the templated conversation up to turn
    ``i`` (with the generation prompt) and up to the end of turn ``i`` are tokenized, and the tokens in between
    (the reply and its end-of-turn marker) are the assistant's.
    """
    ids = _template_ids(tokenizer, messages)
    mask = [0 if assistant_only else 1] * len(ids)
    if assistant_only:
        for i, message in enumerate(messages):
            if message["role"] != "assistant" or not message["content"]:
                continue
            start = _common_prefix(_template_ids(tokenizer, messages[:i], add_generation_prompt=True), ids)
            end = _common_prefix(_template_ids(tokenizer, messages[:i + 1]), ids)
            mask[start:end] = [1] * (end - start)
    return {"input_ids": ids[:max_length], "loss_mask": mask[:max_length]}


def tokenize_records(records, tokenizer, *, fmt: str = "auto", max_length: int = 512, assistant_only: bool = True,
                     num_samples: int | None = None) -> list[dict]:
    """Tokenize a dataset into ``[{"input_ids", "loss_mask"}]``, dropping examples with nothing to learn.

    Raises:
        ValueError: an unknown format; no assistant turn in the whole dataset; no example left after truncation.
        (A chat format with a tokenizer that has no chat template reads as plain text: see ``_template_ids``.)
    """
    fmt = detect_format(records.column_names) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}; formats accepted: {sorted(FORMATS)}")
    out, saw_assistant = [], False
    for record in records:
        if num_samples is not None and len(out) >= num_samples:
            break
        if fmt == "text":
            ids = tokenizer(record["text"], add_special_tokens=True).input_ids[:max_length]
            example = {"input_ids": ids, "loss_mask": [1] * len(ids)}
        else:
            messages = to_messages(record, fmt)
            if not any(m["role"] == "assistant" and m["content"] for m in messages):
                continue
            saw_assistant = True
            example = tokenize_conversation(tokenizer, messages, max_length=max_length, assistant_only=assistant_only)
        if sum(example["loss_mask"]) >= 2:
            out.append(example)
    if fmt != "text" and not saw_assistant:
        raise ValueError(f"the dataset ({fmt} format, {len(records)} records) has no assistant turn to train on")
    if not out:
        raise ValueError(f"no example has trainable tokens left after truncation to max_length={max_length}")
    return out


def token_columns(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: each token id's column in the reduced vocabulary ``ids`` (its position there), -1 for an id
    outside it."""
    columns = torch.full((vocab_size,), -1, dtype=torch.long)
    columns[ids.cpu()] = torch.arange(ids.numel())
    return columns


def frequent_tokens(examples: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent trained tokens (``loss_mask`` set) of tokenized ``examples``, most frequent first,
    topped up with unseen ids in id order: the reduced draft vocabulary of a drafter."""
    from collections import Counter

    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    counts = Counter(t for e in examples for t, m in zip(e["input_ids"], e["loss_mask"]) if m)
    ranked = [t for t, _ in counts.most_common(size)]
    seen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.long)


def collate(examples: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of tokenized examples into ``input_ids``, ``attention_mask``, ``loss_mask`` [batch, seq]."""
    width = max(len(e["input_ids"]) for e in examples)
    batch = {"input_ids": torch.full((len(examples), width), pad_token_id, dtype=torch.long),
             "attention_mask": torch.zeros(len(examples), width, dtype=torch.long),
             "loss_mask": torch.zeros(len(examples), width, dtype=torch.long)}
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][row, :n] = torch.as_tensor(e["input_ids"])
        batch["attention_mask"][row, :n] = 1
        batch["loss_mask"][row, :n] = torch.as_tensor(e["loss_mask"])
    return batch


# ---------------------------------------------------------------- generation with the base model

def user_turn_prefix(tokenizer) -> tuple[str, str]:
    """``(prefix, end_of_turn)``: the templated text before a user message's content, and the marker after it."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("sampling user turns (--prompts self) needs a chat model's template, and this tokenizer has "
                         "none (a base model): give its prompts as a file or dataset instead (--prompts PATH)")
    sentinel = "\u2402SELFSPEC\u2402"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False)
    prefix, _, suffix = text.partition(sentinel)
    return prefix, suffix.strip() or (tokenizer.eos_token or "")


@torch.inference_mode()
def generate_batched(model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int = 16,
                     temperature: float = 0.0, top_p: float = 1.0, stop_token_ids: list[int] | None = None,
                     seed: int = 0, progress=None) -> list[list[int]]:
    """Continuations of token-id prompts, batched with left padding (prompts sorted by length to limit padding).
    Greedy when ``temperature`` is 0 (``greedy_rows``: finished rows leave the batch; HF ``generate`` where the
    model's generation config has logits processors), sampled through HF ``generate`` otherwise. Returns the new
    tokens of each prompt, in input order, stop token excluded."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_token_ids or [tokenizer.eos_token_id]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        if temperature == 0 and not logits_processors_of(model):
            new_rows = greedy_rows(model, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens, stops=stops,
                                   pad=pad)
        else:
            input_ids, attention_mask = _left_padded([prompts[i] for i in chunk], pad)
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(
                do_sample=False, temperature=None, top_p=None, top_k=None)
            torch.manual_seed(seed + start)
            # Preallocated cache layers: stock ones copy the whole batch's cache at every step (selfspec.runtime.cache).
            cache = new_cache(model, capacity=input_ids.shape[1] + max_new_tokens)
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                                 max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=pad, cache=cache,
                                 **sampling)
            new_rows = [_cut(row, stops) for row in out[:, input_ids.shape[1]:].tolist()]
        for i, new in zip(chunk, new_rows):
            results[i] = new
        if progress is not None:
            progress(len(chunk))
    return results


#: generation-config fields by which HF ``generate`` changes greedy choices, with the values that leave them alone
_PROCESSOR_DEFAULTS = {"repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
                       "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "min_length": (None, 0),
                       "min_new_tokens": (None, 0), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
                       "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "sequence_bias": (None,),
                       "exponential_decay_length_penalty": (None,), "renormalize_logits": (None, False),
                       "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "guidance_scale": (None, 1.0)}


def logits_processors_of(model) -> list[str]:
    """The fields of ``model.generation_config`` by which HF greedy ``generate`` departs from a plain argmax (a
    repetition penalty, suppressed tokens, a minimum length...); ``greedy_rows`` applies none, so a model with any
    decodes through ``generate``."""
    config = getattr(model, "generation_config", None)
    return [name for name, defaults in _PROCESSOR_DEFAULTS.items()
            if getattr(config, name, None) not in defaults]


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def _cut(tokens: list[int], stops) -> list[int]:
    return tokens[:next((j for j, t in enumerate(tokens) if t in stops), len(tokens))]


@torch.inference_mode()
def greedy_rows(model, prompts: list[list[int]], *, max_new_tokens: int, stops: list[int], pad: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts decoded as one left-padded batch, the stop token excluded, as HF
    ``generate(do_sample=False)`` makes them (same mask, positions and argmax), except that rows which stopped
    leave the batch and its cache: ``generate`` keeps computing every row until the last one stops, which on
    self-distillation data (answers of ~200 tokens cut at 256) is a quarter of the work. Rows leave in groups (an
    eighth of the batch at least, or all at once), as each removal copies the whole cache.

    Plain left-padded decoding for every architecture ``generate`` serves, sliding windows included;
    ``decoding.generate_batch(model, None, ...)`` also decodes plainly, on a right-ragged cache, but refuses models
    with sliding-window layers (its cache cannot be ragged there)."""
    input_ids, attention_mask = _left_padded(prompts, pad)
    device = model.device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    cache = new_cache(model, capacity=input_ids.shape[1] + max_new_tokens)
    stop_ids = torch.tensor(sorted(set(stops)), device=device)
    rows = list(range(len(prompts)))  # the prompt of each batch row
    outputs: list[list[int]] = [[] for _ in prompts]
    finished: set[int] = set()  # batch rows that stopped but have not left yet
    positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)
    step_ids = input_ids
    for _ in range(max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=positions,
                       cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = logits.argmax(-1)
        done = torch.isin(tokens, stop_ids)
        for row, (token, stop) in enumerate(zip(tokens.tolist(), done.tolist())):
            if row in finished:
                continue
            if stop:
                finished.add(row)
            else:
                outputs[rows[row]].append(token)
        if len(finished) == len(rows):
            break
        if finished and len(finished) >= max(1, len(rows) // 8):
            keep = [r for r in range(len(rows)) if r not in finished]
            select_rows(cache, keep)
            index = torch.tensor(keep, device=device)
            tokens, attention_mask, positions = tokens[index], attention_mask[index], positions[index]
            rows, finished = [rows[r] for r in keep], set()
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
        positions = positions[:, -1:] + 1
        step_ids = tokens[:, None]
    return outputs


def self_generated_prompts(model, tokenizer, num_prompts: int, *, max_new_tokens: int = 48, batch_size: int = 16,
                           temperature: float = 1.0, top_p: float = 0.95, seed: int = 0, progress=None) -> list[str]:
    """User turns sampled from the model itself: the chat template's user prefix, sampled until end of turn.
    Empty samples are dropped, so fewer than ``num_prompts`` may come back."""
    prefix, end_of_turn = user_turn_prefix(tokenizer)
    prefix_ids = tokenizer(prefix, add_special_tokens=False).input_ids
    stop = tokenizer.convert_tokens_to_ids(end_of_turn) if end_of_turn in tokenizer.get_vocab() else None
    stops = sorted({t for t in (stop, tokenizer.eos_token_id) if t is not None})
    samples = generate_batched(model, tokenizer, [prefix_ids] * num_prompts, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, temperature=temperature, top_p=top_p, stop_token_ids=stops,
                               seed=seed, progress=progress)
    texts = [tokenizer.decode(s, skip_special_tokens=True).strip() for s in samples]
    return [t for t in texts if t]


def prompts_from_source(source: str | list[str], num_prompts: int | None = None) -> list[dict]:
    """``[{"id", "prompt"}]``: the first user turn of every record of a dataset (any format but ``text``); from a list
    of datasets, ids are prefixed with the dataset's position (``"1:abc"``) so that equal ids stay apart."""
    if isinstance(source, (list, tuple)):
        out = [{"id": f"{k}:{p['id']}", "prompt": p["prompt"]} for k, s in enumerate(source)
               for p in prompts_from_source(str(s))]
        return out[:num_prompts] if num_prompts is not None else out
    records = load_records(source)
    fmt = detect_format(records.column_names)
    out = []
    for index, record in enumerate(records):
        user = next((m["content"] for m in to_messages(record, fmt) if m["role"] == "user"), None)
        if user:
            out.append({"id": str(record.get("id", index)), "prompt": user})
        if num_prompts is not None and len(out) >= num_prompts:
            break
    if not out:
        raise ValueError(f"dataset {source} has no user turn to use as a prompt")
    return out


def prompt_records(sourced: list[tuple[str, str]], *, skip: set[str] | frozenset[str] = frozenset(),
                   id_prefix: str = "") -> list[dict]:
    """``(source, prompt)`` pairs as a prompt file's ShareGPT records (``{"id", "source", "conversations": [the
    human turn]}``, what ``distill`` answers), the first of each prompt kept and any in ``skip`` left out; ids are
    ``{id_prefix}{source}-{position in sourced}``, so they stay put when other sources grow."""
    seen, records = set(skip), []
    for i, (source, prompt) in enumerate(sourced):
        if prompt not in seen:
            seen.add(prompt)
            records.append({"id": f"{id_prefix}{source}-{i}", "source": source,
                            "conversations": [{"from": "human", "value": prompt}]})
    return records


def resolve_prompts(spec: str, model, tokenizer, work_dir: str | Path, *, num_prompts: int | None = None,
                    max_new_tokens: int = 48, temperature: float = 1.0, batch_size: int = 16, seed: int = 0,
                    progress=None) -> list[dict]:
    """``[{"id", "prompt"}]`` from ``spec``: ``builtin`` (``BUILTIN_PROMPTS``), ``self`` (sampled from the model
    once and kept in ``work_dir/prompts/self.jsonl``, so a resumed run answers the same prompts), ``tasks``
    (request templates filled with subjects, ``selfspec.training.task_prompts``), or a dataset. Parts joined by ``+`` are
    concatenated; ``name:N`` takes ``N`` prompts from that part instead of ``num_prompts`` (``self+tasks:768``).

    Raises:
        ValueError: ``self`` or ``tasks`` without a number of prompts, or a dataset without user turns.
    """

    if "+" in spec:
        return [p for part in spec.split("+") for p in resolve_prompts(
            part, model, tokenizer, work_dir, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
            temperature=temperature, batch_size=batch_size, seed=seed, progress=progress)]
    name, colon, count = spec.rpartition(":")
    if colon and count.isdigit() and name in ("builtin", "self", "tasks"):
        spec, num_prompts = name, int(count)
    if spec == "tasks":
        if not num_prompts:
            raise ValueError("task prompts need a number of prompts (num_prompts, or tasks:N)")
        return [{"id": f"task-{i}", "prompt": p} for i, p in enumerate(task_prompts(num_prompts, seed=seed))]
    if spec == "builtin":
        return [{"id": f"builtin-{i}", "prompt": p} for i, p in enumerate(BUILTIN_PROMPTS[:num_prompts])]
    if spec != "self":
        if _is_question_file(spec):  # MT-bench / Spec-Bench questions (``turns``): their first turns
            return [{"id": str(q["id"]), "prompt": q["prompt"]} for q in read_prompts(spec, num_prompts)]
        return prompts_from_source(spec, num_prompts)
    if not num_prompts:
        raise ValueError("self-generated prompts need a number of prompts (num_prompts)")
    path = Path(work_dir) / "prompts" / "self.jsonl"
    if not path.is_file():
        texts = self_generated_prompts(model, tokenizer, num_prompts, batch_size=batch_size, seed=seed,
                                       max_new_tokens=max_new_tokens, temperature=temperature, progress=progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = (json.dumps({"id": f"self-{i}", "prompt": t}) + "\n" for i, t in enumerate(texts))
        atomic_write_text(path, "".join(lines))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _is_question_file(spec: str) -> bool:
    """Whether ``spec`` is a JSONL question file (MT-bench, Spec-Bench): its first record has ``turns`` and fits none
    of the dataset formats (``detect_format``, so a format added there is never mistaken for questions). Anything
    else is left to the dataset reader and its errors."""
    path = Path(spec)
    if not (path.is_file() and path.suffix == ".jsonl"):
        return False
    with path.open() as f:
        first = next((line for line in f if line.strip()), "")
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    if not (isinstance(record, dict) and "turns" in record):
        return False
    try:
        detect_format(record.keys())
    except ValueError:
        return True
    return False


def _length_dealt(lengths: list[int], batch_size: int, shard_size: int, shards_per_window: int = 8) -> list[int]:
    """An order of prompts (by their token ``lengths``) whose shards batch with little padding yet each span every
    length. A batch pads every prompt to its longest: in shards of 512 mixed prompts at batch 128 that was 1.9x the
    prompt tokens. Within each window of ``shards_per_window`` shards the prompts are sorted by length, cut into
    blocks of ``batch_size``, and the blocks dealt to the window's shards in turn: every batch is of one length
    band (1.1x), and a time-boxed run still answers short and long prompts alike, not the shortest first."""
    window = shards_per_window * shard_size
    order: list[int] = []
    for w in range(0, len(lengths), window):
        ranked = sorted(range(w, min(w + window, len(lengths))), key=lengths.__getitem__)
        blocks = [ranked[b:b + batch_size] for b in range(0, len(ranked), batch_size)]
        shards = -(-len(ranked) // shard_size)
        order += [i for turn in range(shards) for block in blocks[turn::shards] for i in block]
    return order


def distill(model, tokenizer, prompts: list[dict], out_dir: str | Path, *, max_new_tokens: int = 256,
            batch_size: int = 16, temperature: float = 0.0, shard_size: int = 64, seed: int = 0,
            progress=None, max_minutes: float | None = None) -> Path:
    """The base model answers ``prompts`` (``[{"id", "prompt"}]``); ShareGPT records are appended to
    ``out_dir/shard-NNNNN.jsonl`` (each written atomically), and ids already in a shard are skipped, so a killed
    run resumes where it stopped. With ``max_minutes``, no shard is started once that much time has passed (the
    shard in progress is finished and written; rerun to go on). Returns ``out_dir`` (loadable with
    ``load_records``)."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = sorted(out_dir.glob("shard-*.jsonl"))
    done = {json.loads(line)["id"] for shard in shards for line in shard.read_text().splitlines() if line.strip()}
    todo = [p for p in prompts if str(p["id"]) not in done]
    if progress is not None and len(todo) < len(prompts):
        progress(len(prompts) - len(todo))
    encoded = [_template_ids(tokenizer, [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
               for p in todo]
    order = _length_dealt(list(map(len, encoded)), batch_size, shard_size)
    todo, encoded = [todo[i] for i in order], [encoded[i] for i in order]
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    for index, start in enumerate(range(0, len(todo), shard_size), start=len(shards)):
        if deadline is not None and time.monotonic() >= deadline:
            break
        part = todo[start:start + shard_size]
        responses = generate_batched(model, tokenizer, encoded[start:start + shard_size], batch_size=batch_size,
                                     max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + start,
                                     progress=progress)
        lines = [json.dumps({"id": str(p["id"]), "conversations": [
            {"from": "human", "value": p["prompt"]},
            {"from": "gpt", "value": tokenizer.decode(r, skip_special_tokens=True)}]}) for p, r in zip(part, responses)]
        atomic_write_text(out_dir / f"shard-{index:05d}.jsonl", "\n".join(lines) + "\n")
    return out_dir
