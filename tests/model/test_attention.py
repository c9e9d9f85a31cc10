"""`varlen` attention (phase1a/model/attention.py): one op a layer over a packed row, exact against each example
run alone, and a micro-batch that reads nothing back from the device."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import phase1a.model.attention as attention
from phase1a.config.schema import MethodConfig
from phase1a.core.labels import IGNORE_INDEX
from phase1a.model.build import build_model
from phase1a.model.loading import load_model
from phase1a.train.packing import RowShape, TokenRows, pack, summed_loss

OP = torch.ops.phase1a.varlen_attention.default
BACKWARD = torch.ops.phase1a.varlen_attention_backward.default
# What makes a GPU wait for the host or the host for the GPU: a value read back, a data-dependent shape.
SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
           torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default,
           torch.ops.aten.item.default}
ZERO_FILLS = {torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default,
              torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar}


def _per_example(query, key, value, lengths, scale, window=0):
    """Each example alone through SDPA's public call: the reference."""
    groups, outputs, start = query.size(1) // key.size(1), [], 0
    for n in lengths:
        q, k, v = (t[start:start + n].transpose(0, 1)[None] for t in (query, key, value))
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        mask = None
        if window and window < n:
            distance = torch.arange(n)[:, None] - torch.arange(n)[None]
            mask = (distance >= 0) & (distance < window)
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and n > 1,
                                                      scale=scale)[0].transpose(0, 1))
        start += n
    return torch.cat(outputs)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_equals_each_example_alone_with_gqa_windows_and_empty_segments(dtype, window):
    torch.manual_seed(0)
    lengths = [5, 1, 7, 0, 4, 0]  # zero-length segments: a static row's unused slots
    total, dim = sum(lengths), 8
    query, key, value = (torch.randn(total, heads, dim, dtype=dtype, requires_grad=True) for heads in (4, 2, 2))
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    out, lse = torch.ops.phase1a.varlen_attention(query, key, value, cu_seqlens, 7, dim ** -0.5, window)
    assert lse.shape == (4, total) and lse.dtype == torch.float32
    upstream = torch.randn_like(out)
    ours = torch.autograd.grad((out * upstream).sum(), (query, key, value))
    reference = _per_example(query, key, value, [n for n in lengths if n], dim ** -0.5, window)
    theirs = torch.autograd.grad((reference * upstream).sum(), (query, key, value))
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, reference, **tolerance)
    for mine, expected in zip(ours, theirs):
        torch.testing.assert_close(mine, expected, **tolerance)


def test_the_math_fallback_equals_sdpas_cpu_kernel():
    """Where neither FlashAttention nor the CPU kernel runs (float32 on a GPU), the same numbers by matmuls."""
    torch.manual_seed(0)
    query, key, value, upstream = (torch.randn(1, 4, 9, 8) for _ in range(4))
    for mask in (None, attention._window_mask(9, 4, query)):
        out, lse = attention._cpu_forward(query, key, value, mask, 0.3)
        math_out, math_lse = attention._math_forward(query, key, value, mask, 0.3)
        torch.testing.assert_close(math_out, out)
        torch.testing.assert_close(math_lse, lse)
        saved = attention.Saved(query, key, value, out, lse)
        expected = attention._cpu_backward(upstream, saved, mask, 0.3)
        for mine, theirs in zip(attention._math_backward(upstream, saved, mask, 0.3), expected):
            torch.testing.assert_close(mine, theirs)


def test_the_ops_pass_torch_librarys_checks():
    """Schema, fake implementation (what torch.compile traces) and autograd registration agree with the kernel."""
    query, key, value = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu_seqlens = torch.tensor([0, 5, 12, 12], dtype=torch.int32)
    torch.library.opcheck(OP, (query.requires_grad_(), key.requires_grad_(), value.requires_grad_(), cu_seqlens,
                               7, 0.3, 0))
    out, lse = OP(query, key, value, cu_seqlens, 7, 0.3, 0)
    torch.library.opcheck(BACKWARD, (torch.randn_like(out), query.detach(), key.detach(), value.detach(),
                                     out.detach(), lse.detach(), cu_seqlens, 7, 0.3, 0))


def test_a_row_that_does_not_add_up_is_refused():
    query = torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match="rise from 0 to the row's 6 tokens"):
        OP(query, query, query, torch.tensor([0, 4, 5], dtype=torch.int32), 4, 0.3, 0)


class _Counter(TorchDispatchMode):
    """Every op the dispatcher runs, by name, and the zero-filled tensors of at least `large` elements."""

    def __init__(self, large: int = 1 << 62):
        super().__init__()
        self.ops, self.large_fills = [], 0
        self.large = large

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func)
        if func in ZERO_FILLS and isinstance(out, torch.Tensor) and out.numel() >= self.large:
            self.large_fills += 1
        return out


def _rows(count: int, length: int = 6, seed: int = 0) -> TokenRows:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(5, 300, length) for _ in range(count)]
    labels = [np.where(np.arange(length) < 2, IGNORE_INDEX, x) for x in ids]
    return TokenRows(np.concatenate(ids), np.concatenate(labels), np.arange(count + 1) * length)


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir):
    torch.manual_seed(0)
    model = build_model(tiny_model_dir, MethodConfig(kind="lora"), gradient_checkpointing=False)
    model.train()
    return model


def _counted_step(model, row, large: int = 1 << 62) -> tuple[_Counter, _Counter]:
    with _Counter(large) as forward:
        loss, _ = summed_loss(model, row)
    with _Counter(large) as backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return forward, backward


def test_one_attention_call_per_layer_and_ops_that_do_not_grow_with_examples(lora_model):
    """1, 5 and 17 examples in a row of the same length: the layers' attention calls, every other op, and the
    backward's zero-filled row-sized tensors are the same in number (the per-example loop this replaced made 17
    calls a layer, and zero-filled a row-sized gradient per example)."""
    layers = lora_model.config.num_hidden_layers
    counts = []
    for examples in (1, 5, 17):
        rows = _rows(examples, length=102 // examples)
        row = pack(rows, np.arange(examples), RowShape.of(128, 102, examples, static=True, step_tokens=np.array([102])))
        forward, backward = _counted_step(lora_model, row, large=row.length)
        assert forward.ops.count(OP) == layers and backward.ops.count(BACKWARD) == layers
        counts.append((len(forward.ops), len(backward.ops), backward.large_fills))
    assert counts[0] == counts[1] == counts[2]


def test_a_micro_batch_reads_nothing_back_from_the_device(lora_model):
    """The forward and backward of a packed row under fake tensors (no values: any host read of one raises), and
    the same step for real with no op that reads a value or has a data-dependent shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    rows = _rows(7, length=9)
    row = pack(rows, np.arange(7), RowShape.of(128, 9, 7, static=True, step_tokens=np.array([63])))
    forward, backward = _counted_step(lora_model, row)
    assert [op for op in forward.ops + backward.ops if op in SYNCING] == []

    mode = FakeTensorMode()

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)

    state = {name: fake(t) for name, t in [*lora_model.named_parameters(), *lora_model.named_buffers()]}
    trainable = [state[name].requires_grad_() for name, p in lora_model.named_parameters() if p.requires_grad]
    fake_row = row._map(fake)
    with mode:
        inputs = {**fake_row.model_inputs(), "attention_mask": torch.ones_like(fake_row.input_ids, dtype=torch.bool),
                  "loss_targets": fake_row.labels[:, 1:], "use_cache": False}
        with attention.packed_forward():
            loss = functional_call(lora_model, state, args=(), kwargs=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    assert all(p.grad is not None for p in trainable)


def test_generation_and_padded_batches_take_sdpa_with_its_mask(tiny_model_dir):
    """Without the packer's boundaries (a left-padded batch, a KV cache) varlen is transformers' SDPA."""
    varlen = load_model(tiny_model_dir, torch.float32, attention="varlen").eval()
    sdpa = load_model(tiny_model_dir, torch.float32, attention="sdpa").eval()
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(varlen(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   sdpa(input_ids=ids, attention_mask=mask).logits[mask.bool()])
        generated = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
                     for m in (varlen, sdpa)]
    assert torch.equal(*generated)


def test_outputs_take_the_strides_of_transformers_layout():
    """The flattened query is a view of transformers' (batch, heads, length, dim) layout; the op's output and
    gradients keep their inputs' strides, as its fake implementation says (what torch.compile checks)."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, heads, 10, 8).transpose(1, 2).reshape(10, heads, 8).requires_grad_()
                         for heads in (4, 2, 2))
    assert not query.is_contiguous()
    cu_seqlens = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, _ = OP(query, key, value, cu_seqlens, 6, 0.3, 0)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_out, _ = attention._varlen_attention_fake(query, key, value, cu_seqlens, 6, 0.3, 0)
    assert out.stride() == fake_out.stride() == query.stride()
    grads = torch.autograd.grad(out.sum(), (query, key, value))
    assert [g.stride() for g in grads] == [t.stride() for t in (query, key, value)]


@pytest.mark.parametrize("extra, message", [({"dropout": 0.1}, "attention dropout 0.1"),
                                            ({"softcap": 50.0}, "soft-capping")])
def test_what_packed_rows_cannot_do_is_refused_by_name(extra, message):
    query = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match=message):
        attention.varlen_attention_forward(torch.nn.Linear(1, 1), query, query[:, :2], query[:, :2], None,
                                           cu_seq_lens_q=torch.tensor([0, 6], dtype=torch.int32), max_length_q=6,
                                           **extra)
