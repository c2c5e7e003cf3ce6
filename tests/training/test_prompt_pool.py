"""scripts/build_prompt_pool.py: the pool a lent GPU answers, without any prompt an earlier corpus answered."""

from __future__ import annotations

import json

from selfspec.testing import load_script


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_pool_leaves_out_answered_prompts_and_keeps_unanswered_ones(tmp_path, capsys):
    script = load_script("build_prompt_pool")
    asks = [f"Question number {i}: what do you think about topic {i}?" for i in range(6)]
    chat = {str(i): {"messages": [[{"text": asks[i]}], [{"text": "no question here, only a statement of forty+ chars"}]]}
            for i in range(6)}
    (tmp_path / "whl" / "chitchat_dataset").mkdir(parents=True)
    (tmp_path / "whl" / "chitchat_dataset" / "dataset.json").write_text(json.dumps(chat))

    def human(prompt, answer=None):
        turns = [{"from": "human", "value": prompt}] + ([{"from": "gpt", "value": answer}] if answer else [])
        return {"id": prompt[:12], "conversations": turns}

    corpus = tmp_path / "corpus"
    _write_jsonl(corpus / "shard-00000.jsonl", [human(asks[0], "an answer"), human("an answered task", "yes")])
    # the corpus's prompt list holds answered and unanswered prompts alike: only its shards count as answered
    _write_jsonl(corpus / "prompts.jsonl", [human(asks[0]), human("an answered task"), human("a prompt left over")])
    _write_jsonl(tmp_path / "mt_bench.jsonl", [{"question_id": 1, "turns": [asks[1], "and then?"]}])
    out = tmp_path / "pool.jsonl"
    assert script.main(["--wheels", str(tmp_path / "whl"), "--out", str(out), "--exclude", str(corpus),
                        "--exclude", str(tmp_path / "mt_bench.jsonl"), "--include", str(corpus / "prompts.jsonl"),
                        "--task-prompts", "5"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = [r["conversations"][0]["value"] for r in records]
    assert len(prompts) == len(set(prompts)) == len({r["id"] for r in records})
    assert set(asks[2:]) <= set(prompts) and asks[0] not in prompts and asks[1] not in prompts
    assert "a prompt left over" in prompts and "an answered task" not in prompts
    assert sum(r["source"] == "tasks" for r in records) == 5
    assert "answered ones left out" in capsys.readouterr().out
