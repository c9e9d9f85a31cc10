"""Dataset formats, record policies, duplicates, split sizes, length analysis and the tokenize lock."""
import gzip
import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

from flows.report_md import publish_length_report
from helpers import date_records, make_tokenizer, read_arrow, write_jsonl
from phase1a.core.errors import DataError
from phase1a.data.render import IGNORE_INDEX, Renderer, render_segments
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset


def run(path: Path, tokenizer, **options):
    return tokenize_dataset(path, tokenizer, 256, TokenizeOptions(**options), path.parent / "cache" / "fp")


def rows(result) -> list[dict]:
    return read_arrow(result.train_path).to_pylist() + read_arrow(result.validation_path).to_pylist()


def trained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX])


def test_ids_equal_the_whole_conversation_tokenized_at_once(tmp_path, tokenizer):
    """Independent reference: the template applied to the whole conversation, tokenized in one call."""
    records = date_records(12)
    result = run(write_jsonl(tmp_path / "d.jsonl", records), tokenizer, validation_count=2)
    expected = {tuple(tokenizer(tokenizer.apply_chat_template(r["messages"], tokenize=False),
                                add_special_tokens=False)["input_ids"]) for r in records}
    assert {tuple(r["input_ids"]) for r in rows(result)} == expected
    replies = {r["messages"][-1]["content"] + "<|im_end|>\n" for r in records}
    assert {trained_text(tokenizer, r) for r in rows(result)} == replies


@pytest.mark.parametrize("compress", [False, True])
def test_json_array_and_gzip(tmp_path, tokenizer, compress):
    records = [{"prompt": f"Write 2001-02-{d:02d} in US format.", "completion": f"02/{d:02d}/2001"}
               for d in range(1, 9)]
    payload = json.dumps(records).encode()
    path = tmp_path / ("d.json.gz" if compress else "d.json")
    path.write_bytes(gzip.compress(payload) if compress else payload)
    result = run(path, tokenizer)
    assert result.train_examples + result.validation_examples == 8
    assert {trained_text(tokenizer, r) for r in rows(result)} == {f"02/{d:02d}/2001<|im_end|>\n" for d in range(1, 9)}


def test_gzip_jsonl_with_field_map_and_plain_text(tmp_path, tokenizer):
    lines = [json.dumps({"question": f"q{i}", "answer": f"a{i}"}) for i in range(4)]
    lines += [json.dumps({"text": f"free text {i}"}) for i in range(4)]
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    result = run(path, tokenizer, field_map={"question": "prompt", "answer": "completion"})
    texts = {trained_text(tokenizer, r) for r in rows(result)}
    assert {f"a{i}<|im_end|>\n" for i in range(4)} <= texts
    assert {f"free text {i}<|im_end|>" for i in range(4)} <= texts  # plain text: all of it, then EOS


def test_train_on_inputs_labels_every_token(tmp_path, tokenizer):
    result = run(write_jsonl(tmp_path / "d.jsonl", date_records(6)), tokenizer, train_on_inputs=True)
    assert all(r["labels"] == r["input_ids"] for r in rows(result))


def test_bad_records_skipped_are_counted_and_shown(tmp_path, tokenizer):
    lines = [json.dumps(r) for r in date_records(6)] + ["{oops", '{"instruction": 1, "output": "x"}', "{oops2"]
    result = run(write_jsonl(tmp_path / "d.jsonl", lines), tokenizer, bad_records="skip")
    assert result.skipped == {"malformed_json": 2, "bad_field:instruction": 1}
    assert len(result.skipped_examples) == 3 and "d.jsonl:7: malformed JSON" in result.skipped_examples[0]
    assert result.train_examples + result.validation_examples == 6
    with pytest.raises(DataError, match=r"no usable records \(3 bad records skipped"):
        (tmp_path / "only-bad").mkdir()
        run(write_jsonl(tmp_path / "only-bad" / "d.jsonl", lines[6:]), tokenizer, bad_records="skip")


def test_overlong_policies(tmp_path, tokenizer):
    records = date_records(10)
    records[3]["messages"][-1]["content"] = "01/01/2001 " * 40
    path = write_jsonl(tmp_path / "d.jsonl", records)
    dropped = tokenize_dataset(path, tokenizer, 256, TokenizeOptions(overlong="drop", max_seq_length=64),
                               tmp_path / "c1" / "fp")
    assert dropped.dropped_overlong == 1 and dropped.train_examples + dropped.validation_examples == 9
    with pytest.raises(DataError, match=r"d.jsonl:4: \d+ tokens exceed max_seq_length 64 \(1 examples do"):
        tokenize_dataset(path, tokenizer, 256, TokenizeOptions(overlong="fail", max_seq_length=64),
                         tmp_path / "c2" / "fp")
    truncated = tokenize_dataset(path, tokenizer, 256, TokenizeOptions(length_percentile=50), tmp_path / "c3" / "fp")
    assert truncated.max_seq_length == 64 and truncated.truncated_examples == 1 and truncated.lengths.max == 64


def test_duplicates_are_counted_and_optionally_dropped(tmp_path, tokenizer):
    records = date_records(8)
    path = write_jsonl(tmp_path / "d.jsonl", records + records[:3])
    counted = tokenize_dataset(path, tokenizer, 256, TokenizeOptions(), tmp_path / "c1" / "fp")
    assert counted.duplicates == 3 and counted.duplicates_dropped == 0 and counted.lengths.count == 11
    dropped = tokenize_dataset(path, tokenizer, 256, TokenizeOptions(drop_duplicates=True), tmp_path / "c2" / "fp")
    assert dropped.duplicates_dropped == 3 and dropped.lengths.count == 8


def test_validation_count_and_waste_table(tmp_path, tokenizer):
    result = run(write_jsonl(tmp_path / "d.jsonl", date_records(40)), tokenizer, validation_count=7)
    assert result.validation_examples == 7 and result.train_examples == 33
    configured, right_sized, packed = result.waste
    assert configured.sequence_length == 256 and right_sized.sequence_length == result.max_seq_length
    assert packed.computed_tokens == result.lengths.total_tokens and packed.waste_fraction == 0
    assert configured.waste_fraction == pytest.approx(1 - result.lengths.total_tokens / (40 * 256))
    assert configured.waste_fraction > right_sized.waste_fraction > 0
    assert np.load(result.lengths_path).size == result.lengths.count
    publish_length_report(result, tmp_path)
    assert (tmp_path / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result.lengths.p50 <= result.lengths.p99 <= result.lengths.p99_9 <= result.lengths.max


def test_template_shapes_fall_back_when_the_template_edits_content(tokenizer):
    trimming = make_tokenizer(chat_template=(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    messages = [{"role": "user", "content": "  padded  "}, {"role": "assistant", "content": " x "}]
    renderer = Renderer(trimming)
    assert renderer.segments(messages) == render_segments(messages, trimming)
    fast = Renderer(tokenizer)
    for record in date_records(5):
        assert fast.segments(record["messages"]) == render_segments(record["messages"], tokenizer)


def _race(path: str, cache: str, out) -> None:
    out.put(tokenize_dataset(Path(path), make_tokenizer(), 256, TokenizeOptions(), Path(cache) / "same").model_dump())


@pytest.mark.slow
def test_two_runs_racing_on_one_fingerprint(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", date_records(300))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_race, args=(str(path), str(tmp_path / "cache"), results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    first, second = results.get(timeout=120), results.get(timeout=120)
    for worker in workers:
        worker.join(timeout=30)
    assert first == second
    assert read_arrow(first["train_path"]).num_rows == first["train_examples"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["same", "same.lock", "shards"]
    assert len(list((tmp_path / "cache" / "shards").iterdir())) == 1  # one shard, encoded once, no scratch left


def test_fingerprint_changes_with_data_tokenizer_template_and_options(tmp_path):
    from helpers import make_tiny_model_dir
    from phase1a.data.tokenizing import tokenize_fingerprint
    from phase1a.model.loading import tokenizer_fingerprint

    chatml = make_tiny_model_dir(tmp_path / "a")
    other_template = make_tiny_model_dir(tmp_path / "b", chat_template="{{ messages[0]['content'] }}")
    base = tokenize_fingerprint("data", tokenizer_fingerprint(chatml), 256, TokenizeOptions())
    assert base == tokenize_fingerprint("data", tokenizer_fingerprint(chatml), 256, TokenizeOptions())
    assert base != tokenize_fingerprint("other data", tokenizer_fingerprint(chatml), 256, TokenizeOptions())
    assert base != tokenize_fingerprint("data", tokenizer_fingerprint(other_template), 256, TokenizeOptions())
    trained_inputs = TokenizeOptions(train_on_inputs=True)
    assert base != tokenize_fingerprint("data", tokenizer_fingerprint(chatml), 256, trained_inputs)
    assert base != tokenize_fingerprint("data", tokenizer_fingerprint(chatml), 512, TokenizeOptions())
