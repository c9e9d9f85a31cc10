import json

import numpy as np
import pytest

from helpers import date_records, make_tokenizer, read_arrow, write_jsonl
from phase1a.core.errors import DataError
from phase1a.data.lengths import right_size
from phase1a.data.records import to_conversation
from phase1a.data.render import IGNORE_INDEX, render_segments
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.train.packing import TokenRows


def run(tmp_path, tokenizer, records, **options):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_jsonl(tmp_path / "data.jsonl", records)
    return tokenize_dataset(path, tokenizer, 256, TokenizeOptions(**options), tmp_path / "cache" / "fp")


def supervised_text(tokenizer, input_ids, labels):
    return tokenizer.decode([t for t, label in zip(input_ids, labels) if label != IGNORE_INDEX])


def test_chat_masks_only_the_assistant_reply(tmp_path, tokenizer):
    result = run(tmp_path, tokenizer, date_records(20), validation_fraction=0.2)
    table = read_arrow(result.train_path)
    assert result.template == "chat_template"
    assert result.train_examples + result.validation_examples == 20
    for ids, labels, length in zip(*(table.column(c).to_pylist() for c in ("input_ids", "labels", "length"))):
        assert len(ids) == len(labels) == length
        # Independent reference: the reply text plus the end-of-turn tokens the template puts after it.
        text = supervised_text(tokenizer, ids, labels)
        assert text.endswith("<|im_end|>\n") and "/" in text and "Write" not in text


def test_alpaca_with_and_without_input(tmp_path, tokenizer):
    records = [{"instruction": "Write 2001-02-03 in US format.", "input": "", "output": "02/03/2001"},
               {"instruction": "Rewrite", "input": "2001-02-04", "output": "02/04/2001"}]
    assert to_conversation(records[1], "x", TokenizeOptions()).messages[0]["content"] == "Rewrite\n\n2001-02-04"
    result = run(tmp_path, tokenizer, records, validation_fraction=0.5)
    table = read_arrow(result.train_path).to_pylist() + read_arrow(result.validation_path).to_pylist()
    replies = sorted(supervised_text(tokenizer, r["input_ids"], r["labels"]) for r in table)
    assert replies == ["02/03/2001<|im_end|>\n", "02/04/2001<|im_end|>\n"]


def test_fallback_template_ends_replies_with_eos(tokenizer):
    plain = make_tokenizer(chat_template=None)
    segments = render_segments([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], plain)
    assert [text for text, trained in segments if trained] == ["yo<|im_end|>"]
    assert "".join(t for t, _ in segments) == "<s>### User:\nhi\n\n### Assistant:\nyo<|im_end|>\n\n"


def test_multi_turn_trains_every_assistant_turn(tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    trained = [text for text, flag in render_segments(messages, tokenizer) if flag]
    assert trained == ["b<|im_end|>\n", "d<|im_end|>\n"]


def test_split_is_deterministic_and_order_free(tmp_path, tokenizer):
    records = date_records(50)
    a = run(tmp_path / "a", tokenizer, records)
    b = run(tmp_path / "b", tokenizer, list(reversed(records)))
    rows = lambda path: sorted(map(tuple, read_arrow(path).column("input_ids").to_pylist()))  # noqa: E731
    assert rows(a.validation_path) == rows(b.validation_path)
    assert 1 <= a.validation_examples < 50


def test_length_analysis_and_right_sizing(tmp_path, tokenizer):
    result = run(tmp_path, tokenizer, date_records(30))
    lengths = np.concatenate([TokenRows.load(p).lengths() for p in (result.train_path, result.validation_path)])
    assert result.lengths.max == lengths.max() and result.lengths.total_tokens == lengths.sum()
    assert result.max_seq_length == right_size(lengths, 100, 256, None) and result.max_seq_length % 64 == 0
    assert right_size(np.array([1481]), 100, 8192, None) == 1536
    assert right_size(np.array([1481]), 100, 1024, None) == 1024
    assert right_size(np.array([100]), 100, 8192, 64) == 64
    assert right_size(np.arange(1, 1001), 90, 8192, None) == 960  # p90 of 1..1000 is 900.1 -> 901 -> 960


def test_overlong_examples_are_truncated_and_counted(tmp_path, tokenizer):
    records = date_records(10)
    records[0]["messages"][1]["content"] = "Write " + "the date " * 200
    result = run(tmp_path, tokenizer, records, max_seq_length=128)
    assert result.max_seq_length == 128
    assert result.dropped_without_labels == 1  # its reply was cut off entirely: nothing to learn, counted
    assert result.truncated_examples == 1
    assert result.lengths.max <= 128


def test_reuses_a_complete_output(tmp_path, tokenizer):
    first = run(tmp_path, tokenizer, date_records(10))
    (tmp_path / "data.jsonl").write_text("")  # would fail if it were read again
    again = tokenize_dataset(tmp_path / "data.jsonl", tokenizer, 256, TokenizeOptions(), tmp_path / "cache" / "fp")
    assert again == first


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], r"data.jsonl: no usable records"),
        (["", "  "], r"data.jsonl: no usable records"),
        ([json.dumps(date_records(1)[0]), '{"messages": [}'], r"data.jsonl:2: malformed JSON"),
        (['{"question": "q", "answer": "a"}'], r"data.jsonl:1: no 'messages', .* field \(fields: answer, question\)"),
        (['{"instruction": "q"}'], r"data.jsonl:1: field 'output' is missing"),
        (['{"messages": [{"role": "user", "content": "q"}]}'],
         r"data.jsonl:1: messages\[0\]: the last message must be the assistant's"),
        (['{"messages": [{"role": "narrator", "content": "q"}]}'], r"data.jsonl:1: messages\[0\].role: unknown role"),
        (['[1, 2]'], r"data.jsonl:\[0\]: expected a JSON object"),
        (['[{"prompt": "p", "completion": 3}]'], r"data.jsonl:\[0\]: field 'completion' must be a string \(int\)"),
    ],
)
def test_bad_input_names_file_line_and_field(tmp_path, tokenizer, lines, message):
    with pytest.raises(DataError, match=message):
        run(tmp_path, tokenizer, lines)
