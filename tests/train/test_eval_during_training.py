"""Evaluation during training (phase1a/train/evaluation.py): eval.jsonl at the interval, the same training
with it on or off, on examples cut to training's max length, early stopping that keeps the best weights as the final
adapter (a final evaluation that is not the best stops nothing) and survives a resume (at the same steps, back to the
best its checkpoint names), the config's errors, the training key, and the plan's estimate of its cost. The tiny model
on a few steps."""
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import date_records, make_tokenizer, resolved, write_jsonl
from phase1a.config.schema import ConfigError, MethodConfig, Phase1aConfig, validate_config
from phase1a.core.labels import IGNORE_INDEX
from phase1a.core.layout import list_checkpoints
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.plan.planner import make_plan
from phase1a.train.loop import train
from phase1a.train.packing import TokenRows
from phase1a.train.preemption import Preempted
from phase1a.train.settings import EvalSettings, TrainSettings, training_key


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-data")
    return tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(48)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=6), root / "cache" / "fp")


def settings(tiny_model_dir, data, output_dir: Path, evaluation: dict | None = None, **overrides) -> TrainSettings:
    values = dict(
        model_dir=str(tiny_model_dir), train_path=data.train_path, output_dir=str(output_dir),
        # LoRA dropout draws from the RNG while training: an evaluation that moved it would change the run.
        method=MethodConfig(learning_rate=5e-3, batch_size=8, epochs=1, lora={"r": 4, "alpha": 8, "dropout": 0.1}),
        micro_batch_size=4, gradient_checkpointing=False, checkpoint_interval="never", show_progress=False,
        evaluation=EvalSettings(validation_path=data.validation_path, **evaluation) if evaluation else None,
    )
    return TrainSettings(**{**values, **overrides})


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def adapter(result) -> dict[str, torch.Tensor]:
    return load_file(Path(result.adapter_dir) / "adapter_model.safetensors")


def as_adapter(trainable: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's trainable tensors under the names peft saves them with."""
    return {name.replace(".default.", "."): tensor for name, tensor in trainable.items()}


def test_evaluations_at_the_interval_leave_training_unchanged(tiny_model_dir, data, tmp_path):
    plain = train(settings(tiny_model_dir, data, tmp_path / "plain"))
    evaluated = train(settings(tiny_model_dir, data, tmp_path / "evaluated",
                               evaluation={"cadence": "2steps", "examples": 4}))
    assert plain.steps == evaluated.steps == 6 and not (tmp_path / "plain" / "eval.jsonl").exists()
    losses = [[(r["step"], r["loss"], r["grad_norm"]) for r in lines(tmp_path / run / "metrics.jsonl")]
              for run in ("plain", "evaluated")]
    assert losses[0] == losses[1]  # exactly: same RNG, same steps
    a, b = adapter(plain), adapter(evaluated)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)

    points = lines(tmp_path / "evaluated" / "eval.jsonl")
    assert [p["step"] for p in points] == [2, 4, 6]  # the interval (not at the last step), then the final weights
    assert set(points[0]) == {"step", "eval_loss", "eval_token_accuracy", "examples", "tokens", "seconds", "best"}
    assert all(0 < p["eval_loss"] < 10 and 0 <= p["eval_token_accuracy"] <= 1 for p in points)
    assert all(p["examples"] == 4 and p["tokens"] == points[0]["tokens"] > 0 for p in points)  # a fixed sample
    assert points[-1]["eval_loss"] < points[0]["eval_loss"] and points[0]["best"]
    assert evaluated.evaluations == 3 and evaluated.eval_seconds > 0 and not evaluated.stopped_early
    assert evaluated.best_eval_loss == pytest.approx(min(p["eval_loss"] for p in points), abs=1e-6)
    assert evaluated.best_step == 6 and not (tmp_path / "evaluated" / "best").exists()  # no early stopping: no copy


def test_validation_examples_are_cut_to_the_training_max_length(tiny_model_dir, data, tmp_path):
    """A plan that shortened max_seq_length to 52 (the examples have 56 or 58 tokens, their answers from token 47
    or 48 on) with rows of one example: each validation example is evaluated cut to 52 tokens, as training cuts
    its own, so no row is bigger than training's token budget (52)."""
    cap, full = 52, TokenRows.load(data.validation_path)
    assert len(full) == 6 and full.lengths().min() > cap
    eval_rows = []

    def watch(model) -> None:
        def record(module, args, kwargs):
            if not module.training:
                eval_rows.append(kwargs["input_ids"].numel())

        model.register_forward_pre_hook(record, with_kwargs=True)

    result = train(settings(tiny_model_dir, data, tmp_path / "run", evaluation={"examples": 6},
                            max_seq_length=cap, micro_batch_size=1), on_model=watch)
    (point,) = lines(tmp_path / "run" / "eval.jsonl")  # the final weights' evaluation only

    def supervised(end: int | None) -> int:  # each example's labels after its first token, up to `end`
        return sum(int((full.labels[start + 1 : start + (end or full.lengths()[i])] != IGNORE_INDEX).sum())
                   for i, start in enumerate(full.offsets[:-1]))

    assert point["examples"] == 6 and point["tokens"] == supervised(cap) < supervised(None)
    assert eval_rows == [cap] * 6  # one example a row, each cut to the budget
    assert result.evaluations == 1 and 0 < result.best_eval_loss < 10


@pytest.fixture(scope="module")
def stopped(tiny_model_dir, data, tmp_path_factory):
    """Early stopping that no evaluation after the first can satisfy (min_delta 100): at each checkpoint, every
    2 steps, patience 2, so the run stops at step 6 of 11 with step 2's weights as the best."""
    output = tmp_path_factory.mktemp("stopped") / "run"
    run_settings = settings(tiny_model_dir, data, output, method=MethodConfig(
        learning_rate=5e-3, batch_size=8, epochs=2, lora={"r": 4, "alpha": 8}),
        evaluation={"cadence": "checkpoint", "examples": 6, "patience": 2, "min_delta": 100.0},
        checkpoint_interval="2steps", keep_last=9)
    return run_settings, train(run_settings)


def test_early_stopping_stops_after_the_patience_with_the_best_weights_final(stopped):
    run_settings, result = stopped
    output = Path(result.output_dir)
    assert result.steps == 11 and result.stopped_early and result.stopped_at_step == 6 and result.best_step == 2
    assert len(lines(output / "metrics.jsonl")) == 6
    assert [(p["step"], p["best"]) for p in lines(output / "eval.jsonl")] == [(2, True), (4, False), (6, False)]
    assert json.loads((output / "best" / "evaluation.json").read_text())["step"] == 2
    assert [e["event"] for e in lines(output / "events.jsonl")] == ["early_stopping"]
    assert [p.name for p in list_checkpoints(output / "checkpoints")] == ["step-00000002", "step-00000004"]
    final = adapter(result)
    at_best = as_adapter(load_file(output / "checkpoints" / "step-00000002" / "trainable.safetensors"))
    later = as_adapter(load_file(output / "checkpoints" / "step-00000004" / "trainable.safetensors"))
    assert final.keys() == at_best.keys()
    assert all(torch.equal(final[name], at_best[name]) for name in final)
    assert not all(torch.equal(final[name], later[name]) for name in final)


def test_a_resume_keeps_the_best_so_far_and_the_patience_spent(stopped, tmp_path):
    """A crash after step 5: the run resumes from step 4's checkpoint, whose state says the best was step 2 and
    one evaluation has gone by since. A resume that forgot it would take step 6 as a new best and run on."""
    run_settings, result = stopped
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    shutil.rmtree(copy / "final")
    resumed = train(run_settings.model_copy(update={"output_dir": str(copy)}))
    assert resumed.resumed_from_step == 4 and resumed.stopped_at_step == 6 and resumed.best_step == 2
    assert [p["step"] for p in lines(copy / "eval.jsonl")] == [2, 4, 6]  # step 6 redone, not repeated
    expected, actual = adapter(result), adapter(resumed)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_the_final_evaluation_can_be_the_best_but_stops_nothing(tiny_model_dir, data, tmp_path):
    """Patience 1, and a min_delta that no evaluation after the first can beat: the one at step 4's checkpoint is
    the best, the final weights' at step 6 is not. The run trained every step, so it did not stop early (nor
    says so), and its final adapter is still the best weights."""
    output = tmp_path / "run"
    result = train(settings(tiny_model_dir, data, output, checkpoint_interval="4steps", keep_last=9,
                            evaluation={"examples": 6, "patience": 1, "min_delta": 100.0}))
    assert result.steps == 6 and len(lines(output / "metrics.jsonl")) == 6
    assert [(p["step"], p["best"]) for p in lines(output / "eval.jsonl")] == [(4, True), (6, False)]
    assert not result.stopped_early and result.stopped_at_step is None and result.best_step == 4
    assert lines(output / "events.jsonl") == []  # no early_stopping event
    assert json.loads((output / "best" / "evaluation.json").read_text())["step"] == 4
    final = adapter(result)
    at_best = as_adapter(load_file(output / "checkpoints" / "step-00000004" / "trainable.safetensors"))
    assert final.keys() == at_best.keys() and all(torch.equal(final[name], at_best[name]) for name in final)


class Crash(Exception):
    """A process killed mid-step, in-process."""


def interrupt_in_step(step: int, how):
    """An `on_model` hook: `how()` during the training forward of `step` (rows of 8 examples: one forward a step)."""
    def on_model(model) -> None:
        forwards = 0

        def check(module, args, kwargs):
            nonlocal forwards
            forwards += module.training
            if module.training and forwards == step:
                how()

        model.register_forward_pre_hook(check, with_kwargs=True)

    return on_model


def crash() -> None:
    raise Crash


def cadence_run(tiny_model_dir, data, output: Path, **stopping) -> TrainSettings:
    """Evaluations every 3 steps (3, 6, 9, and the final weights at 11), checkpoints every 4 (4, 8): not aligned.
    LoRA dropout on: a resumed run matches an uninterrupted one only if its RNG stream does."""
    return settings(tiny_model_dir, data, output, method=MethodConfig(
        learning_rate=5e-3, batch_size=8, epochs=2, lora={"r": 4, "alpha": 8, "dropout": 0.1}),
        micro_batch_size=8, checkpoint_interval="4steps", keep_last=9,
        evaluation={"cadence": "3steps", "examples": 6, "patience": 2, **stopping})


def eval_steps(output: Path) -> list[tuple[int, bool]]:
    return [(p["step"], p["best"]) for p in lines(output / "eval.jsonl")]


def best_files(output: Path) -> list[str]:
    return sorted(path.name for path in (output / "best").iterdir())


def assert_same_adapter(result, expected) -> None:
    actual, wanted = adapter(result), adapter(expected)
    assert actual.keys() == wanted.keys() and all(torch.equal(actual[name], wanted[name]) for name in wanted)


@pytest.fixture(scope="module")
def cadence(tiny_model_dir, data, tmp_path_factory):
    """The uninterrupted run (every evaluation improves, so `best/` changes after each checkpoint), and one that
    crashed in step 7: after the evaluation at step 6, whose best weights came after the checkpoint at step 4."""
    root = tmp_path_factory.mktemp("cadence")
    uninterrupted = train(cadence_run(tiny_model_dir, data, root / "uninterrupted"))
    assert eval_steps(root / "uninterrupted") == [(3, True), (6, True), (9, True), (11, True)]
    crashed = root / "crashed"
    with pytest.raises(Crash):
        train(cadence_run(tiny_model_dir, data, crashed), on_model=interrupt_in_step(7, crash))
    assert eval_steps(crashed) == [(3, True), (6, True)]
    # Step 6's best, and step 3's, which the checkpoint at step 4 names and a resume from it goes back to.
    assert best_files(crashed) == ["evaluation.json", "step-00000003.safetensors", "step-00000006.safetensors"]
    return root, uninterrupted


def test_a_resume_evaluates_at_the_steps_of_the_uninterrupted_run(cadence, tiny_model_dir, data, tmp_path):
    """Resumed from step 4, '3steps' counts from the evaluation at step 3, not from the resume: 6, 9, 11, as the
    uninterrupted run, not 7 and 10. The best at step 6, written after the checkpoint, is earned again."""
    root, uninterrupted = cadence
    shutil.copytree(root / "crashed", tmp_path / "run")
    resumed = train(cadence_run(tiny_model_dir, data, tmp_path / "run"))
    assert resumed.resumed_from_step == 4
    assert eval_steps(tmp_path / "run") == eval_steps(root / "uninterrupted")
    assert resumed.best_step == uninterrupted.best_step == 11 and resumed.best_eval_loss == uninterrupted.best_eval_loss
    assert json.loads((tmp_path / "run" / "best" / "evaluation.json").read_text())["step"] == 11
    assert best_files(tmp_path / "run") == ["evaluation.json", "step-00000011.safetensors"]
    assert_same_adapter(resumed, uninterrupted)


def test_a_checkpoint_without_the_last_evaluation_step_still_resumes(cadence, tiny_model_dir, data, tmp_path):
    """A checkpoint written before it held the last evaluation's step: the cadence counts from the resume."""
    root, uninterrupted = cadence
    shutil.copytree(root / "crashed", tmp_path / "run")
    state_path = tmp_path / "run" / "checkpoints" / "step-00000004" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)
    del state["evaluation"]["evaluated_at"]
    torch.save(state, state_path)
    resumed = train(cadence_run(tiny_model_dir, data, tmp_path / "run"))
    assert resumed.resumed_from_step == 4 and [step for step, _ in eval_steps(tmp_path / "run")] == [3, 7, 10, 11]
    assert resumed.best_step == 11 and not resumed.stopped_early


def test_a_preemption_at_an_evaluation_step_evaluates_it_on_resuming(cadence, tiny_model_dir, data, tmp_path):
    """SIGTERM in step 6: its checkpoint is written before step 6's evaluation, which the resume makes first."""
    root, uninterrupted = cadence
    run = cadence_run(tiny_model_dir, data, tmp_path / "run")
    with pytest.raises(Preempted) as preempted:
        train(run, on_model=interrupt_in_step(6, lambda: os.kill(os.getpid(), signal.SIGTERM)))
    assert preempted.value.step == 6 and eval_steps(tmp_path / "run") == [(3, True)]
    resumed = train(run)
    assert resumed.resumed_from_step == 6
    assert eval_steps(tmp_path / "run") == eval_steps(root / "uninterrupted")
    assert resumed.best_step == uninterrupted.best_step
    assert_same_adapter(resumed, uninterrupted)


def test_a_resume_goes_back_to_the_best_its_checkpoint_names(cadence, tiny_model_dir, data, tmp_path):
    """The crashed run resumed with patience 1 and a min_delta nothing beats: the evaluation at step 6 is not
    earned again (as with a wall-time cadence, or float noise after a back-off), so training stops there with
    step 3 the best, and ends as a run with those settings from the start: step 3's weights, not the step 6
    weights `best/` held before the resume."""
    root, _ = cadence
    shutil.copytree(root / "crashed", tmp_path / "resumed")
    strict = {"patience": 1, "min_delta": 100.0}
    resumed = train(cadence_run(tiny_model_dir, data, tmp_path / "resumed", **strict))
    fresh = train(cadence_run(tiny_model_dir, data, tmp_path / "fresh", **strict))
    for result in (resumed, fresh):
        output = Path(result.output_dir)
        assert result.stopped_at_step == 6 and result.best_step == 3
        assert eval_steps(output) == [(3, True), (6, False)]
        assert json.loads((output / "best" / "evaluation.json").read_text())["step"] == 3
        assert best_files(output) == ["evaluation.json", "step-00000003.safetensors"]
    assert resumed.resumed_from_step == 4 and fresh.resumed_from_step is None
    assert_same_adapter(resumed, fresh)


def test_config_errors_name_the_field(config_tree):
    config = validate_config(config_tree)
    assert config.method.eval_interval == "checkpoint" and config.method.early_stopping_patience is None
    for method, words in [
        ({"eval_interval": "5 parsecs"}, ["method.eval_interval", "'checkpoint'"]),
        ({"eval_interval": "never", "early_stopping_patience": 3},
         ["method.early_stopping_patience 3", "method.eval_interval is"]),
        ({"early_stopping_patience": 0}, ["method.early_stopping_patience", "greater than or equal to 1"]),
    ]:
        with pytest.raises(ConfigError) as error:
            validate_config({**config_tree, "method": {**config_tree["method"], **method}})
        assert all(word in str(error.value) for word in words), str(error.value)
    with pytest.raises(ConfigError, match="checkpoint.interval is never"):
        validate_config({**config_tree, "checkpoint": {"interval": "never"},
                         "method": {"early_stopping_patience": 2}})
    assert validate_config({**config_tree, "method": {"eval_interval": None}}).method.eval_interval == "never"


def test_only_early_stopping_enters_the_training_key():
    def key(**evaluation) -> str:
        settings = EvalSettings(validation_path="v.json", **evaluation)
        return training_key("data", "model", MethodConfig(), 256, None, settings.key("30m"))

    plain = training_key("data", "model", MethodConfig(), 256)
    assert key(cadence="checkpoint") == key(cadence="100steps") == plain  # evaluating changes no weight
    # Their config fields neither: evaluation during training, and early stopping (it enters as EvalSettings.key);
    # a replay share enters as the replayed data's fingerprint.
    configured = MethodConfig(eval_interval="100steps", eval_examples=8, early_stopping_patience=3,
                              early_stopping_threshold=0.01, init_from="/adapter", replay_fraction=0.2)
    assert training_key("data", "model", configured, 256) == plain
    stopping = key(cadence="checkpoint", patience=3)
    assert stopping != plain and stopping != key(cadence="checkpoint", patience=4)
    assert stopping == key(cadence="30m", patience=3)  # 'checkpoint' is the checkpoint's interval
    assert stopping != key(cadence="checkpoint", patience=3, min_delta=0.01)


def test_the_plan_estimates_the_evaluations(config_tree, data):
    config_tree["hardware"] = {"target": "h100"}  # not present: no calibration, the assumed speed
    config_tree["method"]["early_stopping_patience"] = 2

    def estimate(patience: int | None = 2, **method):
        tree = {**config_tree, "method": {**config_tree["method"], "early_stopping_patience": patience, **method}}
        config = Phase1aConfig.model_validate(tree)
        return make_plan(config, resolved(config), data).estimate

    at_checkpoints, never = estimate(), estimate(eval_interval="never", patience=None)
    assert at_checkpoints.checkpoints == 1 and at_checkpoints.evaluations_during_training == 2  # step 3 and the end
    assert at_checkpoints.eval_during_training_seconds > 0 and never.evaluations_during_training == 0
    assert at_checkpoints.train_seconds == pytest.approx(
        never.train_seconds + at_checkpoints.eval_during_training_seconds)
    assert at_checkpoints.total_seconds > never.total_seconds
    every_step = estimate(eval_interval="1steps")
    assert every_step.evaluations_during_training == 6  # every step of six: five before the end, and the end
    assert every_step.eval_during_training_seconds == pytest.approx(at_checkpoints.eval_during_training_seconds * 3)


def test_the_settings_come_from_their_own_config_fields_and_stay_within_the_validate_sample():
    """Changing only the fields `DURING_TRAINING_FIELDS` names, all of them training's (method), changes
    EvalSettings and nothing of the validate stage's section; the sample is at most `validation.max_examples`, the
    first examples the validate stage scores."""
    from phase1a.train.settings import DURING_TRAINING_FIELDS

    assert DURING_TRAINING_FIELDS <= set(MethodConfig.model_fields)
    base = Phase1aConfig.model_validate({"data": {"source": "/d.jsonl"}, "validation": {"max_examples": 16}})
    assert EvalSettings.of(base, "v.json", 100).examples == 16  # 64 asked, 16 validated
    changed = base.model_copy(update={"method": base.method.model_copy(update={
        "eval_interval": "5steps", "eval_examples": 8, "early_stopping_patience": 2,
        "early_stopping_threshold": 0.01})})
    settings = EvalSettings.of(changed, "v.json", 100)
    assert (settings.cadence, settings.examples, settings.patience, settings.min_delta) == ("5steps", 8, 2, 0.01)
    assert base.validation == changed.validation
    assert (base.method.model_dump(exclude=DURING_TRAINING_FIELDS)
            == changed.method.model_dump(exclude=DURING_TRAINING_FIELDS))
