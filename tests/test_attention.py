import torch
import torch.nn.functional as F

from phase1a.model.attention import sdpa_packed_forward


def _packed(lengths: list[int], heads: int = 2, dim: int = 8):
    torch.manual_seed(0)
    total = sum(lengths)
    query, key, value = (torch.randn(1, heads, total, dim) for _ in range(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return query, key, value, positions


def test_each_example_attends_causally_to_itself_only():
    query, key, value, positions = _packed([5, 1, 7])
    output, _ = sdpa_packed_forward(torch.nn.Module(), query, key, value, None, position_ids=positions)
    expected, start = [], 0
    for n in (5, 1, 7):
        span = slice(start, start + n)
        expected.append(F.scaled_dot_product_attention(query[:, :, span], key[:, :, span], value[:, :, span],
                                                       is_causal=n > 1))
        start += n
    torch.testing.assert_close(output, torch.cat(expected, dim=2).transpose(1, 2))


def test_a_batch_of_unpadded_rows_with_one_row_of_positions_keeps_every_row():
    """Generation's prefill of equal-length prompts: no padding mask, and transformers passes the positions as one
    row for the whole batch."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(3, 2, 6, 8) for _ in range(3))
    output, _ = sdpa_packed_forward(torch.nn.Module(), query, key, value, None, position_ids=torch.arange(6)[None])
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(output, expected)


def test_the_calls_stay_off_cudnn_attention_and_leave_the_settings_as_they_were(monkeypatch):
    """cuDNN attention builds a graph for every new sequence length, and every example length is one."""
    seen = []
    plain = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return plain(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    query, key, value, positions = _packed([3, 4])
    sdpa_packed_forward(torch.nn.Module(), query, key, value, None, position_ids=positions)
    assert seen == [False, False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
