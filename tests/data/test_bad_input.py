"""Bad input as a user meets it, through the CLI's real entry point (`phase1a plan`, Prefect in-process): each
message names the user's own file (not the staged copy), the line, and the user's field name."""
import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import date_records

pytestmark = [pytest.mark.slow, pytest.mark.prefect_server]  # the CLI runs the flow in a process of its own

ROOT = Path(__file__).resolve().parents[2]


def plan(config_tree: dict, tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config_tree))
    command = [sys.executable, "-m", "flows.cli", "plan", "--config", str(config_path)]
    for override in overrides:
        command += ["--set", override]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def report_of(done: subprocess.CompletedProcess) -> dict:
    line = [line for line in done.stdout.splitlines() if line.startswith("report: ")][-1]
    return json.loads(Path(line.removeprefix("report: ")).read_text())


def ends_with_the_message(failed: subprocess.CompletedProcess, message: str) -> None:
    """An input error ends the run cleanly: no traceback on the terminal, the one-line message last (the setting
    or action that changes the outcome in it), the traceback in the run's error.log."""
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr + failed.stdout, failed.stderr[-3000:]
    last = failed.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"phase1a: {message}"), failed.stderr[-3000:]
    run_dir = Path([line for line in failed.stdout.splitlines() if line.startswith("report: ")][-1][8:]).parent
    assert f"phase1a: the traceback is in {run_dir / 'error.log'}" in failed.stderr
    assert "Traceback (most recent call last)" in (run_dir / "error.log").read_text()


def jsonl_bytes(records: list[dict]) -> list[bytes]:
    return [json.dumps(record).encode() + b"\n" for record in records]


def test_an_invalid_utf8_byte_names_the_users_file_and_line_and_can_be_skipped(config_tree, tmp_path):
    data = tmp_path / "mine" / "chats.jsonl"
    data.parent.mkdir()
    lines = jsonl_bytes(date_records(64))
    lines[40] = lines[40].replace(b"Rewrite", b"Rewr\xffite")  # one byte from a Latin-1 editor
    data.write_bytes(b"".join(lines))
    config_tree["data"]["source"] = str(data)
    byte = lines[40].index(b"\xff") + 1

    failed = plan(config_tree, tmp_path)
    expected = (f"{data}:41: invalid UTF-8 at byte {byte} of the line (0xff); save the file as UTF-8, or skip "
                "such lines with data.bad_records: skip")
    ends_with_the_message(failed, expected)
    assert "staging" not in failed.stderr.split(expected)[0].splitlines()[-1]  # the user's path, not the copy
    assert "UnicodeDecodeError" not in failed.stderr + failed.stdout

    skipped = plan(config_tree, tmp_path, "data.bad_records=skip")
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    tokenized = report_of(skipped)["stages"]["tokenize"]["result"]
    assert tokenized["skipped"] == {"invalid_utf8": 1}
    assert tokenized["skipped_examples"][0].startswith(f"{data}:41: invalid UTF-8 at byte {byte}")
    assert tokenized["train_examples"] + tokenized["validation_examples"] == 63


def test_an_invalid_utf8_byte_in_a_csv_names_its_row_and_line(config_tree, tmp_path):
    """A CSV is read by columns, so the byte stops the file: where it is, by row and by line (a cell may hold
    newlines), and what to do."""
    table = tmp_path / "mine" / "qa.csv"
    table.parent.mkdir()
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["prompt", "completion"])
    for record in date_records(40):
        writer.writerow([record["messages"][1]["content"] + "\n(two lines)", record["messages"][2]["content"]])
    data = text.getvalue().encode()
    at = data.index(b"(two lines)", data.index(b"(two lines)") + 1)  # in the second row's prompt
    table.write_bytes(data[:at] + b"\xff" + data[at:])
    config_tree["data"]["source"] = str(table)
    ends_with_the_message(plan(config_tree, tmp_path), f"{table}:row 1 (line 5): invalid UTF-8 at byte 1 of the line "
                                                       "(0xff); save the file as UTF-8")


def test_a_leading_byte_order_mark_is_accepted(config_tree, tmp_path):
    data = tmp_path / "exported.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + b"".join(jsonl_bytes(date_records(64))))
    config_tree["data"]["source"] = str(data)
    done = plan(config_tree, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    tokenized = report_of(done)["stages"]["tokenize"]["result"]
    assert tokenized["skipped"] == {} and tokenized["train_examples"] + tokenized["validation_examples"] == 64


def test_a_missing_mapped_field_is_named_as_the_user_names_it(config_tree, tmp_path):
    records = [{"question": r["messages"][1]["content"], "answer": r["messages"][2]["content"]}
               for r in date_records(64)]
    del records[9]["answer"]
    data = tmp_path / "qa.jsonl"
    data.write_bytes(b"".join(jsonl_bytes(records)))
    config_tree["data"].update(source=str(data), field_map={"question": "prompt", "answer": "completion"})
    done = plan(config_tree, tmp_path)
    ends_with_the_message(done, f"{data}:10: field 'answer' (mapped to completion) is missing (data.bad_records: "
                                "skip skips and counts bad records)")


def test_a_model_id_not_in_the_hub_cache_ends_in_one_line_with_what_to_do(config_tree, tmp_path):
    """Offline (HF_HUB_OFFLINE=1, as the suite runs) a Hub id with no cached snapshot fails at the model stage,
    saying so and what to change."""
    config_tree["model"]["name_or_path"] = "someone/a-model-never-downloaded"
    failed = plan(config_tree, tmp_path)
    ends_with_the_message(failed, "model.name_or_path: HF_HUB_OFFLINE=1 and no cached snapshot of")
    assert "unset HF_HUB_OFFLINE" in failed.stderr.rstrip().splitlines()[-1]


def test_one_far_longer_example_is_named_and_the_balanced_plan_truncates_it(config_tree, tmp_path):
    records = date_records(1500)
    records[700]["messages"][2]["content"] = " ".join(["12/31/1999"] * 200)  # one answer 40x the others
    data = tmp_path / "dates.jsonl"
    data.write_bytes(b"".join(jsonl_bytes(records)))
    config_tree["data"]["source"] = str(data)
    done = plan(config_tree, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert re.search(rf"1 outlier example\(s\), longer than \d+ tokens .*: {re.escape(str(data))}:701 \(\d+ tokens\)",
                     output), output[-3000:]
    outliers = report_of(done)["stages"]["tokenize"]["result"]["outliers"]
    assert outliers["count"] == 1 and outliers["others_length"] < 256  # the dates size to a fraction of the model's
    assert re.search(rf"note: balanced: max_seq_length {outliers['others_length']} \(sized from the examples other "
                     rf"than the 1 outlier\(s\), .*{re.escape(str(data))}:701\) instead of 256; 1 training "
                     r"example\(s\) truncated", done.stdout), done.stdout[-3000:]
