"""selfspec.training.data: formats, chat-template loss masks, clear errors on bad data, resumable self-distillation."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from selfspec.runtime.models import load_model
from selfspec.runtime.tiny import byte_tokenizer, tiny_gemma3
from selfspec.training import data as D


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def masked_text(tokenizer, example):
    return tokenizer.decode([t for t, m in zip(example["input_ids"], example["loss_mask"]) if m])


FORMAT_ROWS = {
    "sharegpt": {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello!"}]},
    "sharegpt_roles": {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]},
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]},
    "alpaca": {"instruction": "hi", "input": "", "output": "hello!"},
    "prompt_response": {"prompt": "hi", "response": "hello!"},
}


@pytest.mark.parametrize("name", FORMAT_ROWS)
def test_every_chat_format_masks_exactly_the_reply(tmp_path, tokenizer, name):
    path = write_jsonl(tmp_path / "d.jsonl", [FORMAT_ROWS[name]] * 3)
    examples = D.tokenize_records(D.load_records(str(path)), tokenizer, max_length=256)
    assert len(examples) == 3
    text = tokenizer.decode(examples[0]["input_ids"])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello!<|im_end|>\n"
    # The reply and its end-of-turn marker are trained; the template and the user turn are not.
    assert masked_text(tokenizer, examples[0]) == "hello!<|im_end|>\n"


def test_alpaca_input_joins_the_instruction(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Add", "input": "1 and 2", "output": "3"}])
    (example,) = D.tokenize_records(D.load_records(str(path)), tokenizer, max_length=256)
    assert "Add\n\n1 and 2" in tokenizer.decode(example["input_ids"])


def test_multi_turn_masks_every_assistant_turn_and_nothing_else(tmp_path, tokenizer):
    conv = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "a?"}, {"from": "gpt", "value": "A."},
            {"from": "human", "value": "b?"}, {"from": "gpt", "value": "B."}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": conv}])
    (example,) = D.tokenize_records(D.load_records(str(path)), tokenizer, max_length=512)
    assert masked_text(tokenizer, example) == "A.<|im_end|>\nB.<|im_end|>\n"
    (everything,) = D.tokenize_records(D.load_records(str(path)), tokenizer, max_length=512, assistant_only=False)
    assert all(everything["loss_mask"])


def test_plain_text_trains_every_token_and_truncates(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * 100}])
    (example,) = D.tokenize_records(D.load_records(str(path)), tokenizer, max_length=40)
    assert len(example["input_ids"]) == 40 and all(example["loss_mask"])


def test_parquet_and_explicit_format(tmp_path, tokenizer):
    path = tmp_path / "d.parquet"
    pd.DataFrame([FORMAT_ROWS["prompt_response"]] * 2).to_parquet(path)
    examples = D.tokenize_records(D.load_records(str(path)), tokenizer, fmt="prompt_response", max_length=64)
    assert len(examples) == 2


def test_collate_right_pads():
    batch = D.collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]


# ---------------------------------------------------------------- bad input: clear errors

def test_missing_file_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        D.load_records("./no/such/data.jsonl")


def test_empty_dataset_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        D.load_records(str(tmp_path / "empty.jsonl"))


def test_unknown_format_names_the_columns_and_the_formats(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError) as err:
        D.tokenize_records(D.load_records(str(path)), tokenizer)
    message = str(err.value)
    assert "['answer', 'question']" in message
    assert all(name in message for name in D.FORMATS)


def test_no_assistant_turn_is_a_clear_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}] * 2)
    with pytest.raises(ValueError, match="no assistant turn"):
        D.tokenize_records(D.load_records(str(path)), tokenizer)


def test_unknown_role_is_a_clear_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": [{"from": "narrator", "value": "hi"}]}])
    with pytest.raises(ValueError, match="unknown conversation role 'narrator'"):
        D.tokenize_records(D.load_records(str(path)), tokenizer)


# ---------------------------------------------------------------- data from the model itself

def test_user_turn_prefix(tokenizer):
    assert D.user_turn_prefix(tokenizer) == ("<|im_start|>user\n", "<|im_end|>")


def test_self_generated_prompts_are_sampled_and_kept(tmp_path):
    model, tokenizer = load_model("tiny:llama")
    prompts = D.resolve_prompts("self", model, tokenizer, tmp_path, num_prompts=3, max_new_tokens=8)
    assert len(prompts) == 3 and all(p["prompt"] for p in prompts)
    assert len({p["prompt"] for p in prompts}) == 3  # sampled, not greedy: different prompts
    # A second call (a resumed run) reads the same prompts back instead of sampling new ones.
    assert D.resolve_prompts("self", model, tokenizer, tmp_path, num_prompts=3) == prompts


def test_task_prompts_and_joined_prompt_specs(tmp_path):
    from selfspec.training.task_prompts import task_prompts
    prompts = task_prompts(300, seed=1)
    assert len(set(prompts)) == 300 and prompts == task_prompts(300, seed=1) and prompts != task_prompts(300, seed=2)
    assert not any("{" in p for p in prompts)  # every placeholder filled
    assert any(p.startswith("Write a Python function") for p in prompts)
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        task_prompts(0)
    model, tokenizer = load_model("tiny:llama")
    joined = D.resolve_prompts("builtin:2+tasks:3", model, tokenizer, tmp_path, num_prompts=50)
    assert [p["id"] for p in joined] == ["builtin-0", "builtin-1", "task-0", "task-1", "task-2"]
    assert [p["prompt"] for p in joined[2:]] == task_prompts(3)
    assert len(D.resolve_prompts("tasks", model, tokenizer, tmp_path, num_prompts=4)) == 4
    with pytest.raises(ValueError, match="task prompts need a number"):
        D.resolve_prompts("tasks", model, tokenizer, tmp_path)


def test_question_files_are_prompts(tmp_path):
    # MT-bench / Spec-Bench question files (first turns) are prompt sources too: self_distill answers them.
    questions = tmp_path / "mt.jsonl"
    questions.write_text("".join(json.dumps({"question_id": 81 + i, "category": "writing",
                                             "turns": [f"Question {i}?", "And a second turn."]}) + "\n"
                                 for i in range(3)))
    got = D.resolve_prompts(str(questions), None, None, tmp_path)
    assert got == [{"id": "81", "prompt": "Question 0?"}, {"id": "82", "prompt": "Question 1?"},
                   {"id": "83", "prompt": "Question 2?"}]
    assert len(D.resolve_prompts(str(questions), None, None, tmp_path, num_prompts=2)) == 2
    # Other files keep the dataset reader's own errors (columns seen, formats accepted; the bad line).
    neither = tmp_path / "neither.jsonl"
    neither.write_text(json.dumps({"title": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"unknown dataset format: columns seen \['title'\]"):
        D.resolve_prompts(str(neither), None, None, tmp_path)
    # A dataset record that happens to carry "turns" too is read as the dataset format it fits.
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"id": "c1", "turns": ["ignored"], "conversations": [
        {"from": "human", "value": "From the conversation."}, {"from": "gpt", "value": "ok"}]}) + "\n")
    assert D.resolve_prompts(str(both), None, None, tmp_path) == [{"id": "c1", "prompt": "From the conversation."}]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"turns": ["a"]}) + "\n{not json\n")
    with pytest.raises(ValueError, match="broken.jsonl:2"):
        D.resolve_prompts(str(broken), None, None, tmp_path)


def test_batched_left_padded_generation_equals_one_at_a_time():
    model, tokenizer = load_model("tiny:llama")
    prompts = [tokenizer("ab").input_ids, tokenizer("a much longer prompt").input_ids]
    batched = D.generate_batched(model, tokenizer, prompts, max_new_tokens=6, batch_size=2)
    single = [D.generate_batched(model, tokenizer, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == single


def test_distill_resumes_without_redoing_or_duplicating(tmp_path):
    model, tokenizer = load_model("tiny:llama")
    prompts = [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(5)]
    D.distill(model, tokenizer, prompts, tmp_path, max_new_tokens=4, shard_size=2)
    shards = sorted(tmp_path.glob("shard-*.jsonl"))
    assert len(shards) == 3
    shards[-1].unlink()  # as if killed before the last shard
    answered = []
    D.distill(model, tokenizer, prompts, tmp_path, max_new_tokens=4, shard_size=2, progress=answered.append)
    assert answered == [4, 1]  # 4 skipped as done, 1 generated
    records = D.load_records(str(tmp_path))
    assert sorted(records["id"]) == [f"p{i}" for i in range(5)]
    examples = D.tokenize_records(records, tokenizer, max_length=128)
    assert len(examples) == 5


def test_a_base_model_without_chat_template_distills_and_trains_on_plain_continuations(tmp_path):
    """A base model (no chat template, like the Gemma 3 270M GGUF) answers a prompt as its continuation, encoded as
    the benchmark encodes it (``encode_prompt``: the text with the tokenizer's BOS), and a conversation trains as
    that plain text with exactly the answer masked in; sampling user turns says it needs a template."""
    import copy

    from selfspec.runtime.prompts import encode_prompt

    model, chat_tokenizer = load_model("tiny:llama")
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = None
    prompts = [{"id": "p0", "prompt": "question zero"}, {"id": "p1", "prompt": "a longer question one"}]
    D.distill(model, tokenizer, prompts, tmp_path, max_new_tokens=5, shard_size=2)
    records = D.load_records(str(tmp_path))
    examples = D.tokenize_records(records, tokenizer, max_length=128)
    assert len(examples) == 2
    for record, example in zip(records, examples):
        prompt, answer = (turn["value"] for turn in record["conversations"])
        prompt_ids = encode_prompt(tokenizer, prompt)[0].tolist()
        assert example["input_ids"] == tokenizer(prompt + answer).input_ids
        assert example["input_ids"][:len(prompt_ids)] == prompt_ids and not any(example["loss_mask"][:len(prompt_ids)])
        assert masked_text(tokenizer, example) == answer and all(example["loss_mask"][len(prompt_ids):])
    with pytest.raises(ValueError, match=r"needs a chat model's template.*--prompts PATH"):
        D.resolve_prompts("self", model, tokenizer, tmp_path / "self", num_prompts=2)


def test_distill_time_budget_finishes_the_shard_in_progress_and_a_rerun_completes_it(tmp_path, monkeypatch):
    model, tokenizer = load_model("tiny:llama")
    prompts = [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(5)]
    D.distill(model, tokenizer, prompts, tmp_path / "whole", max_new_tokens=4, shard_size=2)
    clock = iter([0.0, 0.0, 1e9])  # the deadline is set, shard 0 starts in time, shard 1 would start too late
    monkeypatch.setattr(D.time, "monotonic", lambda: next(clock))
    D.distill(model, tokenizer, prompts, tmp_path / "budget", max_new_tokens=4, shard_size=2, max_minutes=1.0)
    assert [p.name for p in sorted((tmp_path / "budget").glob("shard-*"))] == ["shard-00000.jsonl"]
    monkeypatch.undo()
    D.distill(model, tokenizer, prompts, tmp_path / "budget", max_new_tokens=4, shard_size=2)
    whole, resumed = (D.load_records(str(tmp_path / d)) for d in ("whole", "budget"))
    assert sorted(zip(whole["id"], map(str, whole["conversations"]))) == sorted(
        zip(resumed["id"], map(str, resumed["conversations"])))


def test_a_list_of_sources_is_their_concatenation(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", [FORMAT_ROWS["sharegpt"]] * 2)
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "b" / "shard-00000.jsonl", [FORMAT_ROWS["sharegpt"]] * 3)
    assert len(D.load_records([str(a), str(tmp_path / "b")])) == 5
    alpaca = write_jsonl(tmp_path / "c.jsonl", [FORMAT_ROWS["alpaca"]])
    with pytest.raises(ValueError, match="different formats"):
        D.load_records([str(a), str(alpaca)])
    # the same format with an extra column, and ids of another type: joined on what they share
    tagged = write_jsonl(tmp_path / "d.jsonl", [{"id": 7, "source": "x", **FORMAT_ROWS["sharegpt"]}])
    named = write_jsonl(tmp_path / "e.jsonl", [{"id": "seven", **FORMAT_ROWS["sharegpt"]}])
    joined = D.load_records([str(tagged), str(named)])
    assert joined.column_names == ["id", "conversations"] and joined["id"] == ["7", "seven"]
    # prompts from several datasets keep equal ids apart
    assert [p["id"] for p in D.prompts_from_source([str(tagged), str(tagged)])] == ["0:7", "1:7"]
    with pytest.raises(ValueError, match="empty list"):
        D.load_records([])
    with pytest.raises(FileNotFoundError):
        D.load_records([str(a), "./missing.jsonl"])


@pytest.mark.real_model
def test_smollm2_template_masks_the_reply_not_its_default_system_prompt(tmp_path):
    from transformers import AutoTokenizer

    from selfspec.runtime.models import resolve_model
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    path = write_jsonl(tmp_path / "d.jsonl", [FORMAT_ROWS["sharegpt"]])
    (example,) = D.tokenize_records(D.load_records(str(path)), tokenizer, max_length=256)
    assert "You are a helpful AI assistant" in tokenizer.decode(example["input_ids"])  # the template's default
    assert masked_text(tokenizer, example) == "hello!<|im_end|>\n"
    assert D.user_turn_prefix(tokenizer)[0].endswith("<|im_start|>user\n")


def test_eval_source_holds_out_another_dataset_and_trains_on_all_of_source(tmp_path):
    from selfspec.training.config import DataConfig
    from selfspec.training.session import prepare_examples

    model, tokenizer = load_model("tiny:llama")
    train_rows = [{"prompt": f"q{i}", "response": f"answer {i}"} for i in range(6)]
    eval_rows = [{"prompt": f"other {i}", "response": f"reply {i}"} for i in range(5)]
    source, other = write_jsonl(tmp_path / "t.jsonl", train_rows), write_jsonl(tmp_path / "e.jsonl", eval_rows)
    train, held = prepare_examples(DataConfig(source=str(source), eval_samples=3), model, tokenizer, tmp_path, None)
    assert (len(train), len(held)) == (3, 3)
    train, held = prepare_examples(DataConfig(source=str(source), eval_source=str(other), eval_samples=3), model,
                                   tokenizer, tmp_path, None)
    decode = tokenizer.decode
    assert len(train) == 6 and len(held) == 3
    assert all("other" in decode(e["input_ids"]) for e in held) and not any("other" in decode(e["input_ids"]) for e in train)
    # an example in both never trains
    both = write_jsonl(tmp_path / "both.jsonl", train_rows + eval_rows[:1])
    train, held = prepare_examples(DataConfig(source=str(both), eval_source=str(other), eval_samples=3), model,
                                   tokenizer, tmp_path, None)
    assert len(train) == 6 and not any("other" in decode(e["input_ids"]) for e in train)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_greedy_rows_equal_hf_generate_while_stopped_rows_leave_the_batch(arch):
    """Rows that stop leave the batch and its cache (in groups); every row's tokens stay those of HF ``generate``
    on the same left-padded batch, cut at its first stop token. The stop token is one that some rows produce
    early and others late or never, so rows leave at different steps, several times."""
    model = tiny_gemma3() if arch == "gemma3" else load_model(f"tiny:{arch}")[0]  # gemma3: sliding-window layers
    generator = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (2, 9, 5, 17, 1, 12, 7, 4, 30)]
    input_ids, mask = D._left_padded(prompts, pad=0)
    reference = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               pad_token_id=0, eos_token_id=None, temperature=None, top_p=None, top_k=None)
    full = reference[:, input_ids.shape[1]:].tolist()
    # the token most rows produce somewhere in their first 20: a stop that ends rows at different steps
    counts = {}
    for row in full:
        for t in set(row[:20]):
            counts[t] = counts.get(t, 0) + 1
    stop = max(counts, key=counts.get)
    expected = [D._cut(row, [stop]) for row in full]
    lengths = sorted({len(e) for e in expected})
    assert len(lengths) >= 3 and lengths[-1] == 24, lengths  # rows stop at several steps, one never does
    assert D.greedy_rows(model, prompts, max_new_tokens=24, stops=[stop], pad=0) == expected
    assert D.greedy_rows(model, prompts[:1], max_new_tokens=24, stops=[stop], pad=0) == expected[:1]
    # every row stopping at its first token, and the shortest budgets
    firsts = sorted({row[0] for row in full})
    assert D.greedy_rows(model, prompts, max_new_tokens=24, stops=firsts, pad=0) == [[] for _ in prompts]
    assert D.greedy_rows(model, prompts, max_new_tokens=1, stops=[stop], pad=0) == [D._cut(r[:1], [stop]) for r in full]
    assert D.greedy_rows(model, prompts, max_new_tokens=0, stops=[stop], pad=0) == [[] for _ in prompts]


def test_a_model_whose_generation_config_changes_greedy_choices_distills_through_generate():
    """A repetition penalty (Qwen2.5-Instruct ships one) is applied by HF ``generate``, not by ``greedy_rows``:
    such a model's greedy answers come from ``generate``, as before."""
    model, tokenizer = load_model("tiny:llama")
    prompts = [tokenizer("ab").input_ids, tokenizer("a much longer prompt").input_ids]
    plain = D.generate_batched(model, tokenizer, prompts, max_new_tokens=12, batch_size=2)
    assert D.logits_processors_of(model) == []
    model.generation_config.repetition_penalty = 3.0
    assert D.logits_processors_of(model) == ["repetition_penalty"]
    penalised = D.generate_batched(model, tokenizer, prompts, max_new_tokens=12, batch_size=2)
    input_ids, mask = D._left_padded(prompts, tokenizer.pad_token_id)
    reference = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert penalised == [D._cut(row, [tokenizer.eos_token_id]) for row in reference[:, input_ids.shape[1]:].tolist()]
    assert penalised != plain  # the penalty does change the answers: the test would see it ignored


def test_prompts_are_dealt_to_shards_in_length_bands_that_span_every_length():
    # skewed as prompts are (the pool's: mean 75 tokens, a few over 400)
    lengths = [int(x) + 1 for x in 40 * torch.empty(1000).log_normal_(0, 0.8, generator=torch.Generator().manual_seed(0))]
    order = D._length_dealt(lengths, batch_size=16, shard_size=64, shards_per_window=4)
    assert sorted(order) == list(range(1000))
    shards = [order[s:s + 64] for s in range(0, 1000, 64)]
    for start in range(0, 12, 4):  # the full windows: each of their shards spans most of the window's lengths
        window = sorted(lengths[i] for shard in shards[start:start + 4] for i in shard)
        for shard in shards[start:start + 4]:
            assert min(lengths[i] for i in shard) <= window[len(window) // 4]
            assert max(lengths[i] for i in shard) >= window[3 * len(window) // 4]
    padded = sum(len(batch) * max(lengths[i] for i in batch)
                 for shard in shards for batch in _batches(sorted(shard, key=lengths.__getitem__), 16))
    mixed = sum(len(batch) * max(lengths[i] for i in batch)
                for s in range(0, 1000, 64) for batch in _batches(sorted(range(s, min(s + 64, 1000)),
                                                                         key=lengths.__getitem__), 16))
    assert padded < 0.75 * mixed  # (on the pool itself, at batch 128 and shards of 512: 1.9x -> 1.1x its tokens)


def _batches(items, size):
    return [items[b:b + size] for b in range(0, len(items), size)]
