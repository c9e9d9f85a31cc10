"""Stage progress (phase1a/core/meter.py): the log lines' numbers on a fake clock, where the lines go, the Prefect
progress artifact, and each wired stage's line (staging, tokenize, validation, promotion; calibration's is in
test_calibration.py, S3's in test_stage_s3.py and test_faults.py)."""
from __future__ import annotations

import logging
import math
import os
import time

import numpy as np
import prefect  # noqa: F401  # for its effect: it sets up logging on import, which must come before caplog
import pytest

from helpers import date_records, make_tokenizer, write_jsonl
from phase1a.core.meter import MeterSettings, artifact_key, stage_meter
from phase1a.core.units import MIB, format_seconds
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def info_lines(caplog):
    """The `phase1a` logger at INFO (as a configured application would have it): the lines, one string each."""
    caplog.set_level(logging.INFO, logger="phase1a")
    return lambda: [record.getMessage() for record in caplog.records if record.name == "phase1a"]


def test_log_lines_give_done_rate_and_time_left_at_most_once_an_interval(info_lines):
    clock = FakeClock()
    settings = MeterSettings("lines", interval_seconds=10.0, clock=clock)
    with stage_meter("tokenize", 1000, "examples", what="2 shards", settings=settings) as meter:
        for _ in range(10):  # 100 examples and 2,000 tokens every 5 s: 20 examples/s, 400 tokens/s
            clock.now += 5
            meter.advance(100, tokens=2000)
    assert info_lines() == [
        "tokenize: 1,000 examples to do; 2 shards",
        "tokenize: 200 of 1,000 examples (20.0 %), 20 examples/s, 400 tokens/s, 40.0 s left",
        "tokenize: 400 of 1,000 examples (40.0 %), 20 examples/s, 400 tokens/s, 30.0 s left",
        "tokenize: 600 of 1,000 examples (60.0 %), 20 examples/s, 400 tokens/s, 20.0 s left",
        "tokenize: 800 of 1,000 examples (80.0 %), 20 examples/s, 400 tokens/s, 10.0 s left",
        "tokenize: 1,000 examples in 50.0 s (20,000 tokens; 20 examples/s, 400 tokens/s)",
    ]


def test_the_time_left_never_reads_past_a_budgets_end(info_lines):
    """Calibration's trials: the first took 20 s of a 30 s budget, seven more would take 140 s at that rate, but
    the budget ends in 10 s and so does the calibration."""
    clock = FakeClock()
    with stage_meter("calibration", 8, "trials", settings=MeterSettings("lines", 10.0, clock)) as meter:
        meter.ends_by = clock.now + 30
        clock.now += 20
        meter.advance(1)
    assert info_lines()[1] == "calibration: 1 of 8 trials (12.5 %), 0.1 trials/s, 10.0 s left"


def test_bytes_in_mib_a_note_and_resumed_bytes_left_out_of_the_rate(info_lines):
    clock = FakeClock()
    with stage_meter("stage", 64 * MIB, "bytes", settings=MeterSettings("lines", 30.0, clock)) as meter:
        meter.carry(16 * MIB)  # an earlier attempt's: done, but not downloaded at this attempt's speed
        clock.now += 40
        meter.advance(16 * MIB)
        meter.note("3 of 4 objects")
        clock.now += 80
        meter.advance(32 * MIB)
    assert info_lines() == [
        "stage: 64.0 MiB to do",
        "stage: 32.0 MiB of 64.0 MiB (50.0 %), 409.6 KiB/s, 80.0 s left",
        "stage: 3 of 4 objects",
        "stage: 64.0 MiB in 2 min 00 s (409.6 KiB/s)",
    ]


def test_an_unknown_total_a_failure_and_nothing_to_do(info_lines):
    clock = FakeClock()
    settings = MeterSettings("lines", 10.0, clock)
    with pytest.raises(RuntimeError), stage_meter("tokenize", None, "examples", settings=settings) as meter:
        clock.now += 10
        meter.advance(50)
        raise RuntimeError("a bad record")
    with stage_meter("stage", 0, "bytes", settings=settings):  # every file already staged: silent
        pass
    assert info_lines() == ["tokenize: started", "tokenize: 50 examples, 5 examples/s",
                            "tokenize: stopped after 50 examples in 10.0 s (5 examples/s)"]


def test_without_logging_set_up_the_lines_reach_stderr_and_off_prints_nothing(capsys):
    """The `phase1a` logger at its default (WARNING) would drop INFO: a bare host still sees its progress."""
    with stage_meter("promote", 2 * MIB, "bytes", settings=MeterSettings("lines", 10.0, FakeClock())) as meter:
        meter.advance(2 * MIB)
    with stage_meter("promote", 2 * MIB, "bytes", settings=MeterSettings("off", 10.0, FakeClock())) as meter:
        meter.advance(2 * MIB)
    assert capsys.readouterr().err.splitlines() == ["promote: 2.0 MiB to do", "promote: 2.0 MiB in 0.0 s"]


def first_line(unit: str) -> str:
    with stage_meter("x", 1, unit, settings=MeterSettings("off")) as meter:
        return meter.start_line()


def test_names_formats_and_the_bar():
    assert artifact_key("validate candidate, loss") == "validate-candidate-loss-progress"
    assert [format_seconds(s) for s in (0.4, 59.6, 125, 7320, None)] == ["0.4 s", "59.6 s", "2 min 05 s",
                                                                          "2 h 02 min", "-"]
    assert [first_line(unit) for unit in ("batches", "examples", "trials", "bytes")] == [
        "x: 1 batch to do", "x: 1 example to do", "x: 1 trial to do", "x: 1 B to do"]  # one, not "1 batches"
    clock = FakeClock()
    with stage_meter("tokenize", 10, "examples", settings=MeterSettings("bar", 10.0, clock)) as meter:
        clock.now += 2
        meter.advance(4, tokens=40)
        assert meter.bar is not None and meter.bar.n == 4 and meter.describe().startswith("tokenize: 4 of 10")


@pytest.mark.prefect_server
def test_inside_a_flow_the_progress_artifact_reaches_100():
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    @flow
    def metered() -> None:
        with stage_meter("meter test", 3, "batches", settings=MeterSettings("lines", 10.0)) as meter:
            for _ in range(3):
                meter.advance(1)

    metered()
    key = artifact_key("meter test")
    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    assert artifact.type == "progress" and float(artifact.data) == 100.0
    assert artifact.description.startswith("meter test: 3 batches in ")


# ---- the stages ---------------------------------------------------------------------------------------------

def test_staging_a_directory_counts_the_bytes_it_copies(tmp_path, info_lines):
    from phase1a.data.staging import stage_dataset

    source = tmp_path / "shards"
    source.mkdir()
    paths = [write_jsonl(source / f"part-{n}.jsonl", date_records(40, seed=n)) for n in range(3)]
    size = sum(path.stat().st_size for path in paths)
    stage_dataset(str(source), tmp_path / "staging")
    assert info_lines()[0] == f"stage: {size / 1024:.1f} KiB to do; copying 3 of 3 files of {source}"
    assert info_lines()[-1].startswith(f"stage: {size / 1024:.1f} KiB in ")
    stage_dataset(str(source), tmp_path / "staging")  # all staged: nothing to copy, no line
    assert len(info_lines()) == 2


def test_a_large_source_hashed_the_first_time_shows_its_progress(tmp_path, info_lines):
    """A big source's content key is a full read of it: past SHOWN_HASH_BYTES the first hash shows progress;
    the next, remembered by (inode, size, mtime), reads nothing and shows nothing; a small file never does."""
    from phase1a.core.fingerprint import SHOWN_HASH_BYTES, FileHashes, sha256_file

    big, small = tmp_path / "big.parquet", write_jsonl(tmp_path / "small.jsonl", date_records(5))
    with open(big, "wb") as handle:
        handle.truncate(SHOWN_HASH_BYTES)  # sparse: reads back as zeros, at memory speed
    for path in (big, small):
        os.utime(path, ns=(time.time_ns() - 10**9, time.time_ns() - 10**9))  # older than a racy hash
    hashes = FileHashes(tmp_path / "hashes.json")
    assert hashes.sha256(small) == sha256_file(small) and info_lines() == []
    assert hashes.sha256(big) == sha256_file(big)
    lines = info_lines()
    assert lines[0] == "hash: 256.0 MiB to do; big.parquet, read once for its content key", lines
    assert lines[-1].startswith("hash: 256.0 MiB in "), lines
    hashes.sha256(big)
    assert info_lines() == lines


def test_tokenize_counts_examples_and_tokens_against_an_estimate(tmp_path, info_lines):
    source = tmp_path / "shards"
    source.mkdir()
    for n in range(2):
        write_jsonl(source / f"part-{n}.jsonl", date_records(30, seed=n))
    data = tokenize_dataset(source, make_tokenizer(), 256, TokenizeOptions(tokenize_workers=1), tmp_path / "fp")
    lines = [line for line in info_lines() if line.startswith("tokenize: ")]
    assert lines[0] == "tokenize: 60 examples to do; 2 of 2 shards to encode in 1 process(es)"
    tokens = data.lengths.total_tokens  # nothing truncated at 256: every token the encode produced
    assert data.train_examples + data.validation_examples == 60 and data.truncated_examples == 0
    assert lines[-1].startswith("tokenize: 60 examples in ") and f"({tokens:,} tokens; " in lines[-1]


def test_validation_counts_loss_and_generation_batches_and_generates_the_same(tiny_model_dir, info_lines):
    import torch

    from phase1a.config.schema import ValidationConfig
    from phase1a.evaluate.generation import generate_greedy, generation_examples, stop_token_ids
    from phase1a.evaluate.metrics import _generate, evaluate
    from phase1a.model.loading import load_for_eval
    from phase1a.train.packing import TokenRows
    path = write_jsonl(tiny_model_dir.parent / "validation-meter.jsonl", date_records(24))
    data = tokenize_dataset(path, make_tokenizer(), 256, TokenizeOptions(validation_fraction=0.5),
                            tiny_model_dir.parent / "validation-meter")
    rows, tokenizer = TokenRows.load(data.validation_path), make_tokenizer()
    indices = np.arange(min(len(rows), 10))
    settings = ValidationConfig(batch_size=4, generation_batch_size=3, max_new_tokens=8)
    model = load_for_eval(tiny_model_dir, None, torch.device("cpu"))
    metrics = evaluate(model, tokenizer, rows, indices, settings, label="validate base")
    loss_batches, generation_batches = math.ceil(len(indices) / 4), math.ceil(len(indices) / 3)
    finals = [line for line in info_lines() if line.startswith("validate base") and " in " in line]
    assert finals[0].startswith(f"validate base, loss: {loss_batches} batches in ")
    assert f"({metrics.tokens:,} tokens; " in finals[0]
    assert finals[1].startswith(f"validate base, generation: {generation_batches} batches in ")
    assert f"({metrics.generated_tokens:,} tokens; " in finals[1]

    # Generation a batch at a time (to count it) gives what one call over every prompt gives.
    examples = generation_examples(rows, indices)
    whole = generate_greedy(model, [e.prompt for e in examples], 8, stop_token_ids(tokenizer, model, examples),
                            tokenizer.pad_token_id, 3)
    assert [g.tokens for g in _generate(model, tokenizer, examples, settings, "x")] == [g.tokens for g in whole]


def test_promotion_counts_the_bytes_of_the_version(tmp_path, info_lines):
    from phase1a.promote.promotion import Promotion, promote
    from phase1a.store.promoted import PromotionRecord

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"w" * 3000)
    (adapter / "adapter_config.json").write_text("{}")
    record = PromotionRecord(run="r", adapter_sha256="a", base_model_fingerprint="b", sample_fingerprint="s",
                             metric_settings="m", metrics={})
    promote(Promotion({"adapter": adapter}, "v1", record), str(tmp_path / "promoted"))
    lines = [line for line in info_lines() if line.startswith("promote: ")]
    assert lines[0] == f"promote: 2.9 KiB to do; 2 files as v1 under {tmp_path / 'promoted'}"
    assert lines[-1].startswith("promote: 2.9 KiB in ")
