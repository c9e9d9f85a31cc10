"""Cross-entropy from the last hidden states, a chunk of tokens at a time: the [tokens x vocabulary] logits of a
row never exist whole.

Each chunk's logits are computed, reduced to its loss (and its correct arg-max predictions) and dropped. When
gradients are needed, the forward also computes the chunk's gradient with respect to the hidden states (and the
output projection, when it trains) and keeps that instead, so backward only scales it: the peak holds one chunk's
logits. Liger's fused linear cross-entropy, Apple's Cut Cross-Entropy and torchtune's CEWithChunkedOutputLoss are
the references; Liger's kernel is used instead to train on CUDA where it is installed and `method.liger` allows
(docs/stages.md#the-loss).

A model loaded by `phase1a.model.loading.load_model` computes it when its forward is given `loss_targets` (the labels
already shifted to the next token); without them it is the model's own forward (generation, HF Trainer).
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from phase1a.core.labels import IGNORE_INDEX
from phase1a.model.cost_model import chunk_rows


@dataclass
class TokenLoss(ModelOutput):
    """Summed cross-entropy over the supervised tokens and how many of them the arg-max predicts (None where
    the fused kernel computed the loss without it)."""

    loss: torch.Tensor | None = None
    correct: torch.Tensor | None = None


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its logits after the output projection: Cohere multiplies by `logit_scale`, Granite
    divides by `logits_scaling`, Gemma 2 and 3 soft-cap with `final_logit_softcapping`."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> "LogitTransform":
        multiplier, divisor = getattr(config, "logit_scale", None), getattr(config, "logits_scaling", None)
        scale = float(multiplier or 1.0) / float(divisor or 1.0)
        return cls(scale=scale, softcap=getattr(config, "final_logit_softcapping", None))

    def apply(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The transformed fp32 logits and d(transformed)/d(logits), None where that is the constant `scale`."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is None:
            return logits, None
        capped = torch.tanh(logits / self.softcap)
        return capped * self.softcap, (1 - capped * capped) * self.scale


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                         transform: LogitTransform = LogitTransform(), chunk: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of `hidden @ weight.T + bias` ([N, H] against [V, H]) over `targets` ([N], IGNORE_INDEX
    where unsupervised), and the count of correct arg-max predictions."""
    shape = _Chunking(transform, chunk or chunk_rows(weight.size(0)))
    trains = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if trains:
        return _LinearCrossEntropy.apply(hidden, weight, bias, targets, shape)
    loss, correct, _ = _chunks(hidden, weight, bias, targets, shape, grads=(False, False, False))
    return loss, correct


@dataclass(frozen=True)
class _Chunking:
    transform: LogitTransform
    rows: int  # tokens a chunk


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, shape: _Chunking):
        wanted = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        loss, correct, grads = _chunks(hidden, weight, bias, targets, shape, wanted)
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        scaled = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return *scaled, None, None


def _chunks(hidden, weight, bias, targets, shape: _Chunking, grads: tuple[bool, bool, bool]):
    """The loop: summed loss, correct count, and (per `grads`) the gradients of the summed loss with respect to
    hidden, weight and bias. Weight and bias gradients accumulate in their own dtype across chunks, as Liger's do."""
    want_hidden, want_weight, want_bias = grads
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = torch.zeros_like(weight) if want_weight else None
    grad_bias = torch.zeros_like(bias) if want_bias else None
    chunk = shape.rows
    for start in range(0, hidden.size(0), chunk):
        rows = hidden[start : start + chunk]
        chunk_loss, chunk_correct, gradient = _chunk(rows, weight, bias, targets[start : start + chunk],
                                                     shape.transform, any(grads))
        loss += chunk_loss
        correct += chunk_correct
        if gradient is None:
            continue
        if want_hidden:
            grad_hidden[start : start + chunk] = gradient @ weight
        if want_weight:
            grad_weight.addmm_(gradient.t(), rows)
        if want_bias:
            grad_bias += gradient.sum(0)
        del gradient  # before the next chunk's logits: one chunk's [rows x vocabulary] alive at a time
    return loss, correct, (grad_hidden, grad_weight, grad_bias)


def _chunk(rows, weight, bias, target, transform: LogitTransform, gradient: bool):
    """One chunk's summed loss, correct count and, if `gradient`, d loss / d logits (softmax - one-hot on
    supervised rows, computed in place over the chunk's logits: no second [rows x vocabulary] tensor is kept)."""
    logits, slope = transform.apply(torch.nn.functional.linear(rows, weight, bias).float())
    supervised = target != IGNORE_INDEX
    picked = target.clamp(min=0)[:, None]
    normaliser = torch.logsumexp(logits, dim=-1)
    loss = ((normaliser - logits.gather(1, picked)[:, 0]) * supervised).sum()
    correct = ((logits.argmax(-1) == target) & supervised).sum()
    if not gradient:
        return loss, correct, None
    probabilities = logits.sub_(normaliser[:, None]).exp_()
    probabilities.scatter_add_(1, picked, -torch.ones_like(picked, dtype=probabilities.dtype))
    probabilities.mul_(supervised[:, None])
    return loss, correct, probabilities.mul_(slope if slope is not None else transform.scale).to(rows.dtype)


def install(causal_lm: torch.nn.Module, liger: bool = False, autocast: torch.dtype | None = None) -> torch.nn.Module:
    """Give a transformers causal LM the `loss_targets` forward (module docstring); returns it. `liger`: Liger's
    kernel computes the loss while training on CUDA (method.liger). `autocast`: that forward runs under autocast
    to this dtype (float32 adapters computing in bf16, phase1a/model/build.py). Installing again only changes
    those choices."""
    original = causal_lm.__dict__.get("_own_forward") or causal_lm.forward
    transform = LogitTransform.of(causal_lm.config)

    def forward(self, *args, loss_targets: torch.Tensor | None = None, **kwargs):
        device = self.get_output_embeddings().weight.device
        # Generation too: a float32 adapter that does not cast its input meets bf16 activations there.
        computing = torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None)
        if loss_targets is None:
            with computing:
                return original(*args, **kwargs)
        kwargs.pop("labels", None)
        with computing:
            hidden = self.get_decoder()(*args, **kwargs).last_hidden_state[:, :-1]
        head = self.get_output_embeddings()
        hidden, targets = hidden.reshape(-1, hidden.size(-1)), loss_targets.reshape(-1)
        if liger and _liger_applies(hidden, transform):
            return TokenLoss(loss=_liger_loss(hidden, head, targets, transform))
        loss, correct = _eager_linear_cross_entropy(hidden, head.weight, head.bias, targets, transform)
        return TokenLoss(loss=loss, correct=correct)

    forward.__signature__ = _with_loss_targets(inspect.signature(forward), original)
    causal_lm._own_forward = original
    causal_lm.forward = types.MethodType(forward, causal_lm)
    return causal_lm


def _with_loss_targets(wrapper: inspect.Signature, original) -> inspect.Signature:
    """The model's own forward parameters, and `loss_targets`: transformers reads the forward's signature (generate
    asks for one position's logits only where `logits_to_keep` is a parameter; without it a generation batch's
    prefill computed the vocabulary's logits at every prompt position: 5-12 % of the chat job's generation)."""
    params = list(inspect.signature(original).parameters.values())
    own = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    rest = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    try:
        return wrapper.replace(parameters=[wrapper.parameters["self"], *own, wrapper.parameters["loss_targets"], *rest])
    except ValueError:  # a forward whose parameters cannot be laid out so: the wrapper's own (*args, **kwargs)
        return wrapper


# Kept out of torch.compile: the chunk loop's length follows each row's length.
_eager_linear_cross_entropy = torch.compiler.disable(linear_cross_entropy)


def _liger_applies(hidden: torch.Tensor, transform: LogitTransform) -> bool:
    """On CUDA while training: Liger's kernel has no logit scale, and evaluation needs the correct-prediction
    count, which the loop gives."""
    return hidden.device.type == "cuda" and transform.scale == 1.0 and torch.is_grad_enabled()


def _liger_loss(hidden, head, targets, transform: LogitTransform) -> torch.Tensor:
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    loss, *_ = LigerFusedLinearCrossEntropyFunction.apply(
        hidden, head.weight, targets, head.bias, None, IGNORE_INDEX, 0.0, 0.0, "sum", transform.softcap)
    return loss
