"""Custom lm-eval tasks over local files, as a user writes them: a task YAML beside its JSONL (relative
`data_files`), one multiple-choice task and one generate-until task over the date examples."""
from __future__ import annotations

import json
import random
from pathlib import Path

import yaml


def chat_prompt(record: dict) -> str:
    """The conversation up to the answer, rendered as the tiny model's ChatML template renders it in training."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in record["messages"][:-1])
    return turns + "<|im_start|>assistant\n"


def write_date_tasks(directory: Path, records: list[dict], seed: int = 0) -> dict[str, Path]:
    """`dates_choice` (the right US date among four, acc) and `dates_written` (greedy answer, exact_match)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    answers = [r["messages"][-1]["content"] for r in records]
    docs = []
    for record, answer in zip(records, answers):
        wrong = rng.sample([a for a in answers if a != answer], 3)
        choices = [answer, *wrong]
        rng.shuffle(choices)
        docs.append({"prompt": chat_prompt(record), "choices": choices, "label": choices.index(answer),
                     "answer": answer})
    (directory / "dates.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "dates.jsonl"}}, "test_split": "test",
              "doc_to_text": "{{prompt}}", "target_delimiter": ""}
    tasks = {
        "dates_choice": {**common, "task": "dates_choice", "output_type": "multiple_choice",
                         "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
                         "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
        "dates_written": {**common, "task": "dates_written", "output_type": "generate_until",
                          "doc_to_target": "{{answer}}",
                          "generation_kwargs": {"until": ["<|im_end|>"], "max_gen_toks": 12, "do_sample": False},
                          "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                                           "higher_is_better": True}]},
    }
    paths = {}
    for name, task in tasks.items():
        paths[name] = directory / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(task, sort_keys=False))
    return paths
