"""Data edge cases a user meets (issue 26): one far longer record among a few dozen, an empty answer in any record
format, exact duplicates and the held-out split, a file beside the shards that is not data. The rules are tested
on their own first, then each case through the CLI's real entry point (`phase1a plan`, as tests/data/test_bad_input.py
runs it)."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bad_input import ends_with_the_message, plan, report_of

from helpers import date_records, write_jsonl
from phase1a.core.errors import DataError
from phase1a.data.lengths import find_outliers, right_size
from phase1a.data.tokenized import split_table
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset

ROOT = Path(__file__).resolve().parents[2]
MODEL_MAX = 8192  # a model's positions, for the rule's own tests (the tiny test model has 256)
LONG_TOKENS = 20_000  # the planted record of the issue


def alpaca_like_lengths(count: int, seed: int) -> np.ndarray:
    """Token lengths shaped as benchmarks/tokenize_throughput.py's Alpaca-like records: lognormal word counts
    (question mu 2.8 sigma 0.7 up to 400 words, answer mu 3.9 sigma 0.9 up to 1,500), a token and a bit a word,
    plus the template's tokens. A long tail, as chat data has, and no outlier."""
    rng = np.random.default_rng(seed)
    question = np.clip(np.exp(rng.normal(2.8, 0.7, count)).astype(int), 1, 400)
    answer = np.clip(np.exp(rng.normal(3.9, 0.9, count)).astype(int), 1, 1500)
    return (np.ceil(1.2 * (question + answer)) + 12).astype(np.int64)


def size_for(lengths: np.ndarray) -> int:
    return right_size(lengths, 100.0, MODEL_MAX, None)


def where(index: int) -> str:
    return f"qa.jsonl:{index + 1}"


# ---- the outlier rule --------------------------------------------------------------------------------------

@pytest.mark.parametrize("count", [60, 500_000])
def test_one_far_longer_record_is_an_outlier_on_60_examples_as_on_500k(count):
    lengths = alpaca_like_lengths(count, seed=1)
    planted = count // 2
    lengths[planted] = LONG_TOKENS
    outliers = find_outliers(lengths, where, size_for)
    assert outliers is not None and outliers.count == 1
    assert outliers.longest == [(where(planted), LONG_TOKENS)]
    others = np.delete(lengths, planted)
    assert outliers.others_length == size_for(others) < size_for(lengths)  # the others size the run, not it
    assert others.max() <= outliers.threshold < LONG_TOKENS


@pytest.mark.parametrize("count, seed", [(60, 0), (60, 1), (60, 2), (1000, 0), (1000, 1), (500_000, 0)])
def test_long_tailed_lengths_have_no_outlier(count, seed):
    assert find_outliers(alpaca_like_lengths(count, seed), where, size_for) is None


def test_a_second_mode_of_long_documents_is_not_an_outlier():
    """5 % long documents among short chats: a mode of the data, which the run sizes for."""
    rng = np.random.default_rng(0)
    chats = np.exp(rng.normal(np.log(60), 0.2, 950)).astype(np.int64)
    documents = np.exp(rng.normal(np.log(2000), 0.3, 50)).astype(np.int64)
    assert find_outliers(np.concatenate([chats, documents]), where, size_for) is None


def test_the_demo_data_has_no_outlier(tmp_path, tokenizer):
    demo = tmp_path / "demo_dates.jsonl"  # what `make demo-data` writes, with its own defaults
    subprocess.run([sys.executable, str(ROOT / "data" / "make_demo_dataset.py"), "--out", str(demo)], check=True,
                   capture_output=True)
    result = tokenize_dataset(demo, tokenizer, 256, TokenizeOptions(), tmp_path / "cache" / "fp")
    assert result.lengths.count == len(demo.read_text().splitlines()) and result.outliers is None


# ---- the held-out split ------------------------------------------------------------------------------------

def token_rows(path: str) -> set[tuple[int, ...]]:
    return {tuple(ids) for ids in split_table(path).column("input_ids").to_pylist()}


@pytest.mark.parametrize("options", [{"validation_fraction": 0.2}, {"validation_count": 7},
                                     {"validation_fraction": 0.001}])  # the last: the tiny-dataset fallback
def test_exact_duplicates_stay_on_one_side_of_the_split(tmp_path, tokenizer, options):
    distinct = date_records(12)
    assert len({json.dumps(record) for record in distinct}) == 12
    records = distinct * 5
    random.Random(0).shuffle(records)
    path = write_jsonl(tmp_path / "repeated.jsonl", records)
    result = tokenize_dataset(path, tokenizer, 256, TokenizeOptions(**options), tmp_path / "cache" / "fp")
    train, held_out = token_rows(result.train_path), token_rows(result.validation_path)
    assert train and held_out and not train & held_out and result.validation_overlap == 0
    assert result.validation_examples % 5 == 0  # whole groups of 5 copies held out
    if "validation_count" in options:
        assert result.validation_examples <= options["validation_count"]


def test_identical_examples_have_nothing_to_hold_out(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "same.jsonl", date_records(1) * 60)
    with pytest.raises(DataError, match=f"^{path}: all 60 examples are the same: nothing distinct to hold out"):
        tokenize_dataset(path, tokenizer, 256, TokenizeOptions(), tmp_path / "cache" / "fp")


# ---- through the CLI ---------------------------------------------------------------------------------------

def qa_records(count: int, seed: int = 0) -> list[dict]:
    return [{"prompt": record["messages"][1]["content"], "completion": record["messages"][2]["content"]}
            for record in date_records(count, seed)]


def report_md(done: subprocess.CompletedProcess) -> str:
    line = [line for line in done.stdout.splitlines() if line.startswith("report: ")][-1]
    return Path(line.removeprefix("report: ")).with_name("report.md").read_text()


@pytest.mark.slow
@pytest.mark.prefect_server
def test_one_long_record_among_60_is_named_and_the_others_size_the_run(config_tree, tmp_path, tokenizer):
    """A directory of two shards, one 20,000-token answer on line 12 of the second, and a NOTES.txt beside them."""
    records = qa_records(60)
    words = " ".join(["12/31/1999"] * LONG_TOKENS)
    ids = tokenizer.encode(words, add_special_tokens=False)
    records.insert(41, {"prompt": "Write every date you know.", "completion": tokenizer.decode(ids[:LONG_TOKENS])})
    shards = tmp_path / "qa"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", records[:30])
    write_jsonl(shards / "part-1.jsonl", records[30:])
    (shards / "NOTES.txt").write_text("Exported from the support desk; part-1 is the second week.\n")
    config_tree["data"]["source"] = str(shards)

    done = plan(config_tree, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = report_of(done)
    tokenized = report["stages"]["tokenize"]["result"]
    outlier = f"{shards}/part-1.jsonl:12"
    assert tokenized["outliers"]["count"] == 1 and tokenized["outliers"]["longest"][0][0] == outlier
    output = done.stdout + done.stderr
    assert "1 outlier example(s)" in output and f"{outlier} (" in output, output[-3000:]
    # Every example is kept (the long one cut to the model's 256 positions); the plan sizes from the others.
    lengths = np.sort(np.load(tokenized["lengths_path"]))
    others = right_size(lengths[:-1], 100.0, tokenized["model_max_length"], None)
    planned = json.loads((Path(report["run_dir"]) / "plan.json").read_text())
    assert planned["max_seq_length"] == others < tokenized["max_seq_length"]
    assert any(outlier in note and note.startswith(f"balanced: max_seq_length {others}") for note in planned["notes"])

    staged = report["stages"]["stage"]["result"]
    assert staged["files_ignored"] == 1 and staged["ignored_files"] == [f"{shards}/NOTES.txt"]
    markdown = report_md(done)
    assert f"| ignored files | 1: `{shards}/NOTES.txt` |" in markdown
    assert "| outliers | 1 longer than" in markdown and f"`{outlier}`" in markdown


@pytest.mark.slow
@pytest.mark.prefect_server
def test_an_empty_answer_is_skipped_and_counted_by_default_in_every_format(config_tree, tmp_path):
    """A chat with an empty assistant turn and a prompt/completion record with a blank completion, side by side:
    one rule, one reason; skipped by default and said once, an error with `data.bad_records: fail`."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    chats, qa = date_records(32), qa_records(32, seed=1)
    chats[5]["messages"][2]["content"] = ""
    qa[9]["completion"] = "  "
    write_jsonl(mixed / "chats.jsonl", chats)
    write_jsonl(mixed / "qa.jsonl", qa)
    config_tree["data"]["source"] = str(mixed)

    skipped = plan(config_tree, tmp_path)  # data.bad_records: skip_empty, the default
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    examples = [f"{mixed}/chats.jsonl:6: messages[2].content: empty assistant turn",
                f"{mixed}/qa.jsonl:10: field 'completion': empty assistant turn"]
    said = skipped.stdout + skipped.stderr
    assert said.count("record(s) with nothing to train skipped") == 1, said[-3000:]
    assert f"2 record(s) with nothing to train skipped (empty_answer: 2), e.g. {'; '.join(examples)}" in said
    tokenized = report_of(skipped)["stages"]["tokenize"]["result"]
    assert tokenized["skipped"] == {"empty_answer": 2} and tokenized["skipped_examples"] == examples
    assert tokenized["train_examples"] + tokenized["validation_examples"] == 62
    assert "| skipped | empty_answer: 2 |" in report_md(skipped)

    failed = plan(config_tree, tmp_path, "data.bad_records=fail")
    ends_with_the_message(failed, f"{examples[0]} (a record with nothing to train; data.bad_records: skip_empty skips")


@pytest.mark.slow
@pytest.mark.prefect_server
def test_duplicates_and_the_held_out_split_through_the_cli(config_tree, tmp_path):
    same = write_jsonl(tmp_path / "same.jsonl", date_records(1) * 60)
    config_tree["data"]["source"] = str(same)
    failed = plan(config_tree, tmp_path)
    ends_with_the_message(failed, f"{same}: all 60 examples are the same: nothing distinct to hold out")

    records = date_records(20) * 3
    random.Random(0).shuffle(records)
    config_tree["data"]["source"] = str(write_jsonl(tmp_path / "repeated.jsonl", records))
    done = plan(config_tree, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    tokenized = report_of(done)["stages"]["tokenize"]["result"]
    assert not token_rows(tokenized["train_path"]) & token_rows(tokenized["validation_path"])
    assert tokenized["validation_overlap"] == 0 and tokenized["duplicates"] == len(records) - len(
        {json.dumps(record) for record in records})

    # A separate held-out set that shares examples with the training data: counted, and shown in the report.
    train = date_records(40)
    held_out = train[:4] + date_records(8, seed=7)
    shared = sum(json.dumps(record) in {json.dumps(r) for r in train} for record in held_out)
    config_tree["data"].update(source=str(write_jsonl(tmp_path / "train.jsonl", train)),
                               validation_source=str(write_jsonl(tmp_path / "held_out.jsonl", held_out)))
    done = plan(config_tree, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report_of(done)["stages"]["tokenize"]["result"]["validation_overlap"] == shared >= 4
    assert f"| train/validation overlap | {shared} held-out example(s) also in train |" in report_md(done)
