"""Liger-Kernel's Triton kernels (RMSNorm, SwiGLU) in one model instance's eager layers (`method.liger`).

Liger's apply functions also replace classes and functions in transformers' modeling modules, for the whole
process: every model built after it (one with `method.liger: off`, a reference model, the next stage's in the same
process) would get Liger's kernels too, and measured on an H200 (2026-11-27), a test's compiled layers picked up the
RoPE another test's model had patched in. Here the kernels are bound to the instance's modules and the modules'
globals are put back. Liger's RoPE is left out: it exists only as such a global, and its dispatcher is excluded from
torch.compile (`torch.compiler.disable`: a graph break, an error in a `fullgraph` layer).

Compiled layers run without Liger (`enable(model, False)`): inductor fuses the norm and the activation itself, and
Liger's kernels inside a compiled graph are a risk with no gain. Calibration switches one model between eager and
compiled candidates, so the kernels go and come back with the compilation.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from types import ModuleType

import torch

# Instance attributes Liger binds on a module it patches, kept here to put back when eager layers return.
_BOUND = "_phase1a_liger"


def installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def apply(model: torch.nn.Module) -> bool:
    """Liger's RMSNorm and SwiGLU kernels bound to `model`'s modules (no RoPE, no loss: chunked_loss calls Liger's
    loss itself); transformers' modules as they were. False: Liger has nothing for this model's family."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    before = {name: dict(vars(module)) for name, module in _transformers_modules()}
    instance_before = {id(m): set(vars(m)) for m in model.modules()}
    try:
        _apply_liger_kernel_to_instance(model=model, rope=False, fused_linear_cross_entropy=False,
                                        cross_entropy=False)
    finally:
        _restore_globals(before)
    bound = 0
    for module in model.modules():
        added = {name: vars(module)[name] for name in set(vars(module)) - instance_before.get(id(module), set())
                 if callable(vars(module)[name])}
        if added:
            setattr(module, _BOUND, added)
            bound += 1
    return bound > 0


def enable(model: torch.nn.Module, on: bool) -> None:
    """Liger's bound kernels in use (on) or the modules' own forwards (off), for modules `apply` patched."""
    for module in model.modules():
        added = vars(module).get(_BOUND)
        for name, method in (added or {}).items():
            if on:
                vars(module)[name] = method
            else:
                vars(module).pop(name, None)


@contextmanager
def kernels_off(model: torch.nn.Module):
    """The modules' own forwards for the block, the kernels as they were after: what a model loaded for scoring
    runs (the validate stage loads it without Liger). On an H200 a greedy step of SmolLM2-135M's shape, bound by
    kernel launches, took 70 ms with the kernels and 48 ms without (benchmarks/decode_step.py, 2026-11-30)."""
    was_on = applied(model)
    enable(model, False)
    try:
        yield model
    finally:
        enable(model, was_on)


def applied(model: torch.nn.Module) -> bool:
    """Whether a module of `model` runs a Liger kernel now."""
    return any(name in vars(m) for m in model.modules() for name in (vars(m).get(_BOUND) or ()))


def _transformers_modules() -> list[tuple[str, ModuleType]]:
    return [(name, module) for name, module in list(sys.modules.items())
            if module is not None and (name.startswith("transformers.models.") or name.startswith("transformers.loss"))]


def _restore_globals(before: dict[str, dict]) -> None:
    for name, saved in before.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        for key, value in list(vars(module).items()):
            if key not in saved and not isinstance(value, ModuleType):  # a submodule imported meanwhile stays
                delattr(module, key)
            elif key in saved and saved[key] is not value:
                setattr(module, key, saved[key])
