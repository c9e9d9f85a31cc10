"""The chunked cross-entropy (phase1a/model/chunked_loss.py) against the whole-logits loss it replaces: the same loss,
correct count and gradients, alone and inside a model loaded by `load_model` (LoRA and a full fine-tune)."""
import numpy as np
import pytest
import torch

import phase1a.model.attention  # noqa: F401  (registers varlen)
from helpers import whole_logits_loss
from phase1a.core.labels import IGNORE_INDEX
from phase1a.model.chunked_loss import LogitTransform, linear_cross_entropy
from phase1a.model.loading import load_model
from phase1a.train.packing import TokenRows, pack, summed_loss

TOLERANCE = 1e-5


def _reference(hidden, weight, bias, targets, transform: LogitTransform):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() * transform.scale
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(50, 16, generator=generator, dtype=torch.float64).float()
    weight = torch.randn(97, 16, generator=generator).float() * 0.5
    bias = torch.randn(97, generator=generator).float() * 0.1
    targets = torch.randint(0, 97, (50,), generator=generator)
    targets[1::4] = (hidden @ weight.T + bias).argmax(-1)[1::4]  # some predicted right
    targets[::3] = IGNORE_INDEX
    return hidden, weight, bias, targets


def _gradients(loss_fn, hidden, weight, bias, targets, transform):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss, correct = loss_fn(*leaves, targets, transform)
    (loss * 0.37).backward()  # a scale, as training divides by the step's tokens
    return loss.detach(), int(correct), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.25), LogitTransform(softcap=3.0),
                                       LogitTransform(scale=2.0, softcap=5.0)],
                         ids=["plain", "scaled", "softcapped", "both"])
def test_chunks_give_the_whole_logits_loss_count_and_gradients(transform):
    """Chunks of 7 rows (the last one short) against one cross-entropy over all 50 rows' logits."""
    inputs = _inputs()
    chunked = _gradients(lambda *a: linear_cross_entropy(*a, chunk=7), *inputs, transform)
    whole = _gradients(_reference, *inputs, transform)
    assert chunked[0].item() == pytest.approx(whole[0].item(), rel=TOLERANCE)
    assert chunked[1] == whole[1] > 0
    for ours, theirs in zip(chunked[2], whole[2]):
        torch.testing.assert_close(ours, theirs, rtol=TOLERANCE, atol=TOLERANCE)


def test_without_gradients_nothing_is_kept_for_backward():
    hidden, weight, bias, targets = _inputs(1)
    weight.requires_grad_(True)
    with torch.no_grad():
        loss, correct = linear_cross_entropy(hidden, weight, bias, targets, chunk=8)
    assert loss.grad_fn is None
    reference, right = _reference(hidden, weight.detach(), bias, targets, LogitTransform())
    assert loss.item() == pytest.approx(reference.item(), rel=TOLERANCE) and int(correct) == int(right)


@pytest.fixture(scope="module")
def rows() -> TokenRows:
    rng = np.random.default_rng(0)
    lengths = [40, 170, 90, 300]
    ids = [rng.integers(5, 300, n) for n in lengths]
    labels = [np.where(np.arange(n) < n // 3, IGNORE_INDEX, x) for n, x in zip(lengths, ids)]
    return TokenRows(np.concatenate(ids), np.concatenate(labels), np.concatenate([[0], np.cumsum(lengths)]))


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_loaded_model_trains_on_the_same_loss_and_gradients(tiny_model_dir, rows, kind, monkeypatch):
    """A packed row of 600 tokens in chunks of 128: the loss and every trainable gradient as from whole logits."""
    import phase1a.model.chunked_loss

    monkeypatch.setattr(phase1a.model.chunked_loss, "chunk_rows", lambda vocab: 128)
    torch.manual_seed(0)
    model = load_model(tiny_model_dir, torch.float32, attention="varlen")
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    batch = pack(rows, np.arange(len(rows)))
    trainable = [p for p in model.parameters() if p.requires_grad]

    def gradients(loss_fn):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        return loss.item(), [p.grad.clone() for p in trainable]

    (chunked, ours), (whole, theirs) = gradients(lambda m, b: summed_loss(m, b)[0]), gradients(whole_logits_loss)
    assert chunked == pytest.approx(whole, rel=TOLERANCE)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-6)


def test_a_model_not_loaded_by_load_model_is_refused(tiny_model_dir, rows):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(TypeError, match="load_model"):
        summed_loss(model, pack(rows, np.arange(2)))


def test_the_loss_forward_keeps_the_models_parameters_so_generate_keeps_one_positions_logits(tiny_model_dir):
    """transformers' generate asks for the last position's logits only where the forward has `logits_to_keep`; the
    loss forward took (*args, **kwargs), so a generation batch's prefill computed the vocabulary's logits at every
    prompt position (the chat job's generation took 5-12 % longer). Its greedy tokens are the same either way."""
    import inspect

    model = load_model(tiny_model_dir, torch.float32).eval()
    parameters = inspect.signature(model.forward).parameters
    assert {"input_ids", "logits_to_keep", "loss_targets"} <= set(parameters) and model._supports_logits_to_keep()
    prompt = torch.tensor([[5, 9, 17, 33, 2, 8]])
    with torch.no_grad():
        kept = model.generate(prompt, max_new_tokens=6, do_sample=False)
        whole = model.generate(prompt, max_new_tokens=6, do_sample=False, logits_to_keep=0)
    assert torch.equal(kept, whole)
