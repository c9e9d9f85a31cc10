"""Liger's kernels stay in the model they were applied to (phase1a/model/liger.py), and leave compiled layers.

Liger needs Triton, which this CPU environment lacks, so its entry point is stood in for by `_liger_0_8_5`, which
does to a Llama what liger-kernel 0.8.5's `apply_liger_kernel_to_llama` does (read from its source): replace
transformers' module globals, and bind the kernels' forwards on the instance's modules. tests/train/test_gpu_paths.py
runs the real package on a GPU, compiled and eager.
"""
import sys
import types

import pytest
import torch

from phase1a.model import liger
from phase1a.model.build import Compilation, decoder_layers, set_compiled


class _LigerRMSNorm(torch.nn.Module):
    def forward(self, hidden_states):  # another result than Llama's, so the test sees which one ran
        return hidden_states * 0.5


class _LigerSwiGLUMLP(torch.nn.Module):
    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)) * 0.5


def _liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    raise AssertionError("Liger's RoPE must not be applied")


@pytest.fixture
def liger_0_8_5(monkeypatch):
    """`liger_kernel.transformers` with Liger 0.8.5's instance entry point for Llama; the calls' arguments."""
    calls = []

    def _apply_liger_kernel_to_instance(model, rope=True, rms_norm=True, swiglu=True, **kwargs):
        from transformers.models.llama import modeling_llama

        calls.append({"rope": rope, "rms_norm": rms_norm, "swiglu": swiglu, **kwargs})
        if rope:
            modeling_llama.apply_rotary_pos_emb = _liger_rope
        if rms_norm:
            modeling_llama.LlamaRMSNorm = _LigerRMSNorm
        if swiglu:
            modeling_llama.LlamaMLP = _LigerSwiGLUMLP
        base = getattr(model, model.base_model_prefix, model)
        for layer in base.layers:
            layer.mlp.__dict__["forward"] = _LigerSwiGLUMLP.forward.__get__(layer.mlp)
            layer.mlp.__dict__["_get_name"] = (lambda self: "LigerSwiGLUMLP").__get__(layer.mlp)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.__dict__["forward"] = _LigerRMSNorm.forward.__get__(norm)
                norm.casting_mode = "llama"  # data Liger sets beside the forward: not a kernel
        base.norm.__dict__["forward"] = _LigerRMSNorm.forward.__get__(base.norm)

    _install_entry(monkeypatch, _apply_liger_kernel_to_instance)
    return calls


def _install_entry(monkeypatch, apply_to_instance) -> None:
    entry = types.ModuleType("liger_kernel.transformers")
    entry._apply_liger_kernel_to_instance = apply_to_instance
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", entry)


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(12).view(1, 12)).logits


def test_the_kernels_stay_in_their_model_and_transformers_is_left_as_it_was(liger_0_8_5):
    from transformers.models.llama import modeling_llama

    globals_before = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    reference = _logits(_tiny_llama())
    model = _tiny_llama()
    assert liger.apply(model) and liger.applied(model)
    assert liger_0_8_5 == [{"rope": False, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": False,
                            "cross_entropy": False}]  # RoPE is a global only; the loss is chunked_loss's
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm,
            modeling_llama.LlamaMLP) == globals_before
    assert not torch.allclose(_logits(model), reference)  # the kernels run in this model
    later = _tiny_llama()
    assert not liger.applied(later)  # a model built afterwards has none of them
    assert torch.equal(_logits(later), reference)


def test_compiled_layers_run_without_the_kernels_and_eager_ones_get_them_back(liger_0_8_5):
    reference = _logits(_tiny_llama())
    model = _tiny_llama()
    liger.apply(model)
    with_kernels = _logits(model)
    set_compiled(model, Compilation())
    assert not liger.applied(model)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))
    assert model.model.layers[0].input_layernorm.casting_mode == "llama"  # Liger's data stays: only its forwards go
    set_compiled(model, None)
    assert liger.applied(model) and model.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
    assert torch.equal(_logits(model), with_kernels)
    liger.enable(model, False)  # what the compiled layers trace: the model's own forwards
    assert torch.equal(_logits(model), reference)


def test_a_block_runs_the_models_own_forwards_and_leaves_the_kernels_as_they_were(liger_0_8_5):
    reference = _logits(_tiny_llama())
    model = _tiny_llama()
    liger.apply(model)
    with_kernels = _logits(model)
    with liger.kernels_off(model):  # as the validate stage's model, loaded without Liger, computes
        assert not liger.applied(model) and torch.equal(_logits(model), reference)
    assert liger.applied(model) and torch.equal(_logits(model), with_kernels)
    liger.enable(model, False)  # a compiled candidate's eager layers: off before, off after
    with liger.kernels_off(model):
        assert not liger.applied(model)
    assert not liger.applied(model)


def test_a_family_without_kernels_is_told(monkeypatch):
    _install_entry(monkeypatch, lambda model, **kwargs: None)  # Liger logs "no kernels" and returns
    model = _tiny_llama()
    assert not liger.apply(model) and not liger.applied(model)
