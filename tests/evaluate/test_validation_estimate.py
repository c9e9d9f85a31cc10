"""The validate stage's estimate: greedy steps per generation batch, and the costs measured on a model."""
import numpy as np
import pytest

from helpers import date_records, make_tokenizer, write_jsonl
from phase1a.config.schema import ValidationConfig
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset
from phase1a.evaluate.generation import GenerationExample, decode_batches, generation_examples
from phase1a.evaluate.metrics import TimingAllowance, time_validation, validation_timing_seconds, validation_work
from phase1a.evaluate.result import DecodeBatch, ValidationSpeed
from phase1a.train.packing import TokenRows


def example(prompt: int, reference: int) -> GenerationExample:
    return GenerationExample(prompt=np.zeros(prompt, dtype=np.int64), reference=np.zeros(reference, dtype=np.int64))


def test_a_batch_runs_until_its_longest_answer_and_the_stop_token():
    examples = [example(5, 3), example(7, 10), example(5, 4), example(6, 2), example(5, 30)]

    def steps(max_new: int, size: int, to_max: bool = False) -> list[int]:
        return [batch.steps for batch in decode_batches(examples, max_new, size, to_max)]

    assert steps(64, 2) == [11, 5, 31]
    assert steps(8, 2) == [8, 5, 8]  # capped by max_new_tokens
    assert steps(64, 5) == [31]
    assert steps(20, 2, to_max=True) == [20, 20, 20]  # a model that rarely stops where the references do


def test_a_batchs_steps_attend_to_its_widest_prompt_and_what_they_have_generated():
    """Rows are left-padded to the batch's longest prompt; step j (from 1) attends to it, j - 1 tokens generated
    before and its own: 11 steps over a 7-token width attend to 7 x 11 + (1 + ... + 11) positions."""
    examples = [example(5, 3), example(7, 10), example(5, 4), example(6, 2), example(5, 30)]
    batches = decode_batches(examples, 64, 2)
    assert [(b.width, b.steps) for b in batches] == [(7, 11), (6, 5), (5, 31)]
    assert batches[0].context_tokens == 7 * 11 + 66 and DecodeBatch(width=0, steps=1).context_tokens == 1


def test_a_steps_cost_is_the_line_through_its_two_timings():
    """Steps timed at a 60-position context (0.075 s) and with the cache widened to 188 (0.087 s): 94 us more a
    position, 0.069 s apart from it. Noise that makes the wide steps no dearer leaves the steps priced flat."""
    from phase1a.evaluate.generation import DecodeTiming

    timing = DecodeTiming(prefill_seconds=1.0, seconds_per_step=0.075, steps=8, context=60.0,
                          wide_seconds_per_step=0.087, wide_context=188.0)
    assert timing.per_context_token() == pytest.approx(0.012 / 128)
    assert timing.at_no_context() == pytest.approx(0.075 - 60 * 0.012 / 128)
    flat = DecodeTiming(1.0, 0.075, 8, 60.0, wide_seconds_per_step=0.074, wide_context=188.0)
    assert (flat.per_context_token(), flat.at_no_context()) == (0.0, 0.075)
    steep = DecodeTiming(1.0, 0.075, 8, 60.0, wide_seconds_per_step=0.5, wide_context=188.0)  # nothing apart: noise
    assert (steep.per_context_token(), steep.at_no_context()) == (0.0, 0.075)
    assert (DecodeTiming(1.0, 0.075, 8, 60.0).per_context_token(), DecodeTiming(1.0, 0.075, 8).at_no_context()) == (
        0.0, 0.075)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> TokenRows:
    root = tmp_path_factory.mktemp("validation")
    data = tokenize_dataset(write_jsonl(root / "d.jsonl", date_records(60)), make_tokenizer(), 256,
                            TokenizeOptions(validation_count=20), root / "cache" / "fp")
    return TokenRows.load(data.validation_path)


def test_the_estimate_adds_the_forward_pass_the_prefill_and_the_greedy_steps(rows):
    settings = ValidationConfig(max_examples=20, generation_batch_size=8, max_new_tokens=64, new_tokens_margin=0)
    indices = np.arange(20)
    examples = generation_examples(rows, indices)
    speed = ValidationSpeed(forward_seconds_per_token=0.001, decode_seconds_per_step=0.01)
    max_new = min(64, max(len(e.reference) for e in examples))
    tuned, untuned = decode_batches(examples, max_new, 8), decode_batches(examples, max_new, 8, to_max=True)
    expected = (rows.lengths()[indices].sum() * 0.001 + sum(len(e.prompt) for e in examples) * 0.001
                + sum(b.steps for b in tuned) * 0.01)
    assert validation_work(rows, indices, settings, models=2).seconds(speed) == pytest.approx(2 * expected)
    # A measured prefill speed prices the prompts; the teacher-forced pass keeps its own.
    timed = speed.model_copy(update={"prefill_seconds_per_token": 0.003})
    prompts = sum(len(e.prompt) for e in examples)
    with_prefill = 2 * (expected + prompts * 0.002)
    assert validation_work(rows, indices, settings, models=2).seconds(timed) == pytest.approx(with_prefill)
    # A step priced by what it attends to: each batch's steps over its width and the tokens generated so far.
    by_context = speed.model_copy(update={"decode_seconds_per_context_token": 1e-4})
    attended = sum(b.context_tokens for b in tuned)
    assert validation_work(rows, indices, settings, models=2).seconds(by_context) == pytest.approx(
        2 * (expected + attended * 1e-4))
    # The base model, untuned, does not stop where the references do: its batches run to max_new_tokens.
    base = validation_work(rows, indices, settings, models=1, untuned=1)
    assert base.decode_steps == sum(b.steps for b in tuned) + len(untuned) * max_new
    assert base.seconds(by_context) == pytest.approx(
        2 * expected - sum(b.steps for b in tuned) * 0.01 + len(untuned) * max_new * 0.01
        + (attended + sum(b.context_tokens for b in untuned)) * 1e-4)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    import torch

    from phase1a.model.loading import load_model

    return load_model(tiny_model_dir, torch.float32)


SETTINGS = ValidationConfig(generation_batch_size=8, batch_size=8)


def test_time_validation_measures_both_costs_on_a_model(rows, model):
    import torch

    with torch.no_grad():
        speed = time_validation(model, rows, np.arange(20), SETTINGS, TimingAllowance(seconds=600, forward_guess=1e-4))
    assert speed.forward_seconds_per_token > 0 and speed.decode_seconds_per_step > 0
    assert speed.source == "measured" and speed.prefill_seconds_per_token > 0


@pytest.mark.alone  # a speed measured against seconds: with other tests beside it, it is cut short
def test_time_validation_keeps_to_its_allowance(rows, model):
    """Half of what the whole timing would take at a guessed speed: a speed, on fewer rows where the forward pass
    measured too little time left for all (their step scaled by rows on a CPU); nothing left: not timed at all
    (the plan derives validation's speed from training's)."""
    import torch

    guess, indices = 1e-3, np.arange(20)
    allowance = TimingAllowance(seconds=validation_timing_seconds(rows, indices, SETTINGS, guess) / 2,
                                forward_guess=guess)
    with torch.no_grad():
        speed = time_validation(model, rows, indices, SETTINGS, allowance)
        assert time_validation(model, rows, indices, SETTINGS, TimingAllowance(0.0, guess)) is None
    assert speed.forward_seconds_per_token > 0 and speed.decode_seconds_per_step > 0
    if speed.source != "measured":
        timed = int(speed.source.split(" timed on ")[1].split(" of ")[0])
        assert 1 <= timed < 8 and speed.source.endswith("of 8 rows, scaled by rows")


def test_greedy_steps_stop_at_the_deadline(rows, model):
    """A deadline already past: the untimed step and one timed step, no more; none: every step asked for."""
    import time

    import torch

    from phase1a.evaluate.generation import time_decode_step

    prompts = [e.prompt for e in generation_examples(rows, np.arange(4))]
    with torch.no_grad():
        assert time_decode_step(model, prompts, pad_id=0, steps=8, deadline=time.perf_counter()).steps == 1
        assert time_decode_step(model, prompts, pad_id=0, steps=8).steps == 8
        # Widened, past the deadline: not timed again
        assert time_decode_step(model, prompts, pad_id=0, steps=8, deadline=time.perf_counter(),
                                wider=50).wide_seconds_per_step is None


def test_the_steps_are_timed_again_with_the_cache_widened(rows, model):
    """Eight steps at the prompts' width (step j attends to the batch's longest prompt and j tokens: + 2 to + 9
    after the untimed first, + 5.5 on average), then eight with 50 more masked positions in every layer's cache."""
    import torch

    from phase1a.evaluate.generation import time_decode_step

    prompts = [e.prompt for e in generation_examples(rows, np.arange(4))]
    with torch.no_grad():
        timing = time_decode_step(model, prompts, pad_id=0, steps=8, wider=50)
    width = max(len(p) for p in prompts)
    assert timing.steps == 8 and timing.context == width + 5.5
    assert timing.wide_context == timing.context + 9 + 50 and timing.wide_seconds_per_step > 0
    assert timing.per_context_token() >= 0 and timing.at_no_context() >= 0


def test_a_pass_far_slower_than_guessed_is_cut_at_the_allowance(rows, model):
    """Every layer 0.4 s (a host whose cores are taken) against a guess of microseconds: the warm-up pass alone
    would overrun the 0.6 s allowance. It is cut at the first layer that starts past it, and validation is left
    untimed (derived from the training speed), instead of running every pass it sized by the guess."""
    import time

    import torch

    def slow(module, args):
        time.sleep(0.4)

    layers = [layer for layers in model.modules() if isinstance(layers, torch.nn.ModuleList) for layer in layers]
    handles = [layer.register_forward_pre_hook(slow) for layer in layers]
    try:
        began = time.perf_counter()
        with torch.no_grad():
            speed = time_validation(model, rows, np.arange(20), SETTINGS, TimingAllowance(0.6, forward_guess=1e-6))
        elapsed = time.perf_counter() - began
    finally:
        for handle in handles:
            handle.remove()
    assert len(layers) >= 2 and speed is None
    assert elapsed < 0.6 + 0.4 + 0.3  # the allowance and the layer that was running
    # The hooks are gone: the model runs and is timed as before.
    with torch.no_grad():
        assert time_validation(model, rows, np.arange(20), SETTINGS, TimingAllowance(600, 1e-4)) is not None


def test_float32_adapters_on_a_bf16_base_generate_as_they_train(rows, tiny_model_dir):
    """On a GPU the base is bf16 and the LoRA adapters float32, computing in bf16 under autocast without peft's
    input cast (phase1a/model/build.py; the validate stage loads them the same way, model/loading.py). Greedy
    decoding runs the forward without loss targets: it must compute the same way, not meet a bf16 activation
    with a float32 weight (calibration's validation timing failed so on an H200). Its logits match peft's default
    (float32 adapter compute) within bf16 noise."""
    import torch
    from peft import LoraConfig, get_peft_model

    from phase1a.model import chunked_loss
    from phase1a.model.loading import adapters_compute_in_input_dtype, load_model

    prompts = [e.prompt for e in generation_examples(rows, np.arange(4))]
    logits = []
    for as_trained in (False, True):
        torch.manual_seed(0)
        model = get_peft_model(load_model(tiny_model_dir, torch.bfloat16),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          init_lora_weights=False)).eval()
        if as_trained:
            chunked_loss.install(model.get_base_model(), autocast=torch.bfloat16)
            adapters_compute_in_input_dtype(model)
        with torch.no_grad():
            speed = time_validation(model, rows, np.arange(20), SETTINGS, TimingAllowance(600, 1e-4))
            logits.append(model(input_ids=torch.from_numpy(prompts[0])[None]).logits.float())
        assert speed is not None and speed.decode_seconds_per_step > 0
    assert (logits[1] - logits[0]).norm() <= 2e-2 * logits[0].norm()


def test_a_one_batch_sample_is_timed_twice_and_says_how_far_the_passes_spread(rows, model):
    """The forward pass's timing is what the evaluation estimate's range rests on: one pass says nothing of how much
    the host's speed moves, so a sample of one batch (8 examples here) is timed twice when the allowance holds it."""
    import torch

    with torch.no_grad():
        speed = time_validation(model, rows, np.arange(20), SETTINGS, TimingAllowance(600, 1e-4))
    assert speed.passes == 2 and 0.0 <= speed.spread < 1.0


def test_an_evaluation_during_training_is_timed_in_the_rows_it_runs(rows, model):
    """An evaluation during training packs its sample into rows of the training's token budget
    (phase1a/train/evaluation.py): the timing runs those rows, row after row within a deadline; none that fits,
    no speed."""
    import time

    import torch

    from phase1a.evaluate.metrics import time_training_rows, training_rows_timing_seconds
    from phase1a.train.packing import budget_rows

    indices = np.arange(12)
    passes = []
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, out: passes.append(args[0].shape))
    try:
        with torch.no_grad():
            speed = time_training_rows(model, rows, indices, 96, 1e-4, time.perf_counter() + 600)
            assert len(passes) == len(budget_rows(rows, indices, 96)) > 1  # every row, each one pass
            assert all(shape[0] == 1 and shape[1] <= 96 for shape in passes)
            assert speed is not None and speed > 0
            assert time_training_rows(model, rows, indices, 96, 1e-4, time.perf_counter()) is None
    finally:
        hook.remove()
    assert training_rows_timing_seconds(rows, indices, 1e-3) == pytest.approx(rows.lengths()[indices].sum() * 1e-3)


def test_an_evaluation_during_training_is_priced_at_its_own_speed():
    speed = ValidationSpeed(forward_seconds_per_token=0.002, decode_seconds_per_step=0.1,
                            training_forward_seconds_per_token=0.0025)
    assert speed.during_training().forward_seconds_per_token == 0.0025
    assert speed.during_training().decode_seconds_per_step == 0.1
    untimed = ValidationSpeed(forward_seconds_per_token=0.002, decode_seconds_per_step=0.1)
    assert untimed.during_training() == untimed  # not timed: at the validate stage's speed
