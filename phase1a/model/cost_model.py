"""What a training step costs in memory and FLOPs, from the model's shape alone (no weights are read).
The formulas, and how they were checked against a measured peak: docs/plan-models.md. No torch at import: the plan
and its report read these types and formulas without loading a model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from phase1a.core.units import GIB, MIB

NF4_BYTES = 0.5 + 4 / 64 / 8 + 4 / 64 / 256  # 4-bit weight, 8-bit scale per 64, fp32 scale per 256 scales
OPTIMIZER_STATE_BYTES = {"adamw_fused": 8, "adamw": 8, "adamw_8bit": 2}


def checkpoint_bytes(trainable: int, optimizer: str) -> int:
    """A checkpoint's size: the trainable weights in fp32 and their optimizer state."""
    return trainable * (4 + OPTIMIZER_STATE_BYTES[optimizer])


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelFacts(BaseModel):
    parameters: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    max_positions: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def kv_width(self) -> int:  # the output size of k_proj and v_proj
        return self.kv_heads * self.head_dim

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear projection in a layer: what LoRA can target and a 4-bit base quantises."""
        h, i, kv, q = self.hidden, self.intermediate, self.kv_width, self.heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def projection_parameters(self) -> int:
        return self.layers * sum(a * b for a, b in self.projection_shapes().values())


class MemoryEstimate(BaseModel):
    weights_gib: float
    trainable_gib: float
    activations_gib: float
    logits_gib: float
    mask_gib: float
    total_gib: float
    available_gib: float


class TrainingShape(BaseModel):
    """The choices that change the memory bill but not the model."""

    full: bool = False
    weight_bytes: int = 2  # compute dtype
    base_bits: int = 16  # 4: a quantised base (QLoRA)
    optimizer: str = "adamw_fused"
    shards: int = 1  # FSDP over this many GPUs: each holds 1/shards of weights and trainable state
    dense_mask: bool = False  # attention `sdpa`: packed rows carry a t x t block-diagonal mask


def model_facts(model_dir: Path) -> ModelFacts:
    """Shapes from the config and the parameter count from a meta-device model: no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    heads = config.num_attention_heads
    return ModelFacts(
        parameters=parameters, layers=config.num_hidden_layers, hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size), vocab=config.vocab_size,
        max_positions=getattr(config, "max_position_embeddings", 2048), heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )


def lora_parameters(facts: ModelFacts, r: int, target_modules: list[str]) -> int:
    shapes = facts.projection_shapes()
    return facts.layers * sum(r * (shapes[m][0] + shapes[m][1]) for m in target_modules if m in shapes)


@dataclass(frozen=True)
class MemoryModel:
    """The memory bill of training one model under one training shape, on a device with `available` bytes."""

    facts: ModelFacts
    shape: TrainingShape
    trainable: int  # trainable parameters
    available: int  # bytes the run may use

    def estimate(self, tokens: int, checkpointing: bool, packed: bool = True) -> MemoryEstimate:
        """The bill for `tokens` in one row; `packed`: the row holds several examples (a mask, under sdpa)."""
        facts, shape = self.facts, self.shape
        b, h, t = shape.weight_bytes, facts.hidden, tokens
        if shape.full:
            weights = facts.parameters * 4
        elif shape.base_bits == 4:
            weights = facts.projection_parameters * NF4_BYTES + (facts.parameters - facts.projection_parameters) * b
        else:
            weights = facts.parameters * b
        per_trainable = 4 + OPTIMIZER_STATE_BYTES[shape.optimizer] + (0 if shape.full else 4)
        per_trainable += 4 if shape.optimizer == "adamw" else 0  # the for-each step's temporary
        trainable_bytes = self.trainable * per_trainable
        if shape.shards > 1:  # each GPU keeps its shard, plus the layer it computes and the next one, gathered whole
            weights = weights / shape.shards + 2 * weights / facts.layers
            trainable_bytes = trainable_bytes / shape.shards
        one_layer = t * b * (9 * h + 4 * facts.intermediate)
        chunk = min(t, chunk_rows(facts.vocab)) * facts.vocab * 8
        kept = t * h * b + (facts.vocab * h * b if shape.full else 0)  # the loss's gradients, kept for backward
        logits = chunk + kept
        if checkpointing:
            activations = t * b * (facts.layers + 4) * h + max(0, one_layer - chunk)  # the recompute, past the chunk
        else:
            activations = facts.layers * one_layer + t * b * 4 * h
        mask = t * t * (1 + 4 * (1 if checkpointing else facts.layers)) if packed and shape.dense_mask else 0
        total = weights + trainable_bytes + activations + logits + mask
        return MemoryEstimate(
            weights_gib=weights / GIB, trainable_gib=trainable_bytes / GIB, activations_gib=activations / GIB,
            logits_gib=logits / GIB, mask_gib=mask / GIB, total_gib=total / GIB, available_gib=self.available / GIB,
        )

    def micro_batch(self, micro_batch_size: int, max_seq_length: int, checkpointing: bool) -> MemoryEstimate:
        """The bill for `micro_batch_size` examples of up to `max_seq_length` tokens packed into one row."""
        return self.estimate(micro_batch_size * max_seq_length, checkpointing, packed=micro_batch_size > 1)

    def fitting(self, batch_size: int, max_seq_length: int, checkpointing: bool) -> list[tuple[int, MemoryEstimate]]:
        """Every micro-batch size that divides the global batch and fits, largest first."""
        fits = []
        for micro in (d for d in range(batch_size, 0, -1) if batch_size % d == 0):
            estimate = self.micro_batch(micro, max_seq_length, checkpointing)
            if estimate.total_gib <= estimate.available_gib:
                fits.append((micro, estimate))
        return fits

    def choose(self, batch_size: int, max_seq_length: int) -> tuple[int, bool, MemoryEstimate]:
        """The largest micro-batch (a divisor of the global batch) that fits, preferring no checkpointing, which
        saves the 2N recompute; checkpointing only when even a micro-batch of one would not fit otherwise."""
        for checkpointing in (False, True):
            if fits := self.fitting(batch_size, max_seq_length, checkpointing):
                return fits[0][0], checkpointing, fits[0][1]
        estimate = self.estimate(max_seq_length, True, packed=False)
        raise MemoryError(
            f"the model does not fit: one sequence of {max_seq_length} tokens needs {estimate.total_gib:.1f} GiB "
            f"with gradient checkpointing, {estimate.available_gib:.1f} GiB are available"
        )


def flops_per_token(facts: ModelFacts, full: bool, checkpointing: bool, mean_length: float) -> float:
    n = facts.parameters
    return (6 if full else 4) * n + (2 * n if checkpointing else 0) + 6 * facts.layers * mean_length * facts.hidden


def mfu(tokens_per_second: float, model_flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation as a fraction of the peak."""
    return significant(tokens_per_second * model_flops_per_token / peak_flops)


def significant(value: float, digits: int = 3) -> float:
    """`value` to `digits` significant figures: a small model on a big GPU runs far below 1 % MFU, which a fixed
    number of decimals rounds to 0."""
    return float(f"{value:.{digits}g}")


# A chunk's float32 logits: 256 MiB. The chunk count of a row is then fixed by its length and the vocabulary (a
# static loop for static rows), with few large matmuls: SmolLM2's 49k vocabulary gets 1,280-row chunks, Llama 3's
# 128k 512; Liger's heuristic gave SmolLM2 32-row chunks, 63 Python iterations a 2,000-token step.
CHUNK_BYTES = 256 * MIB
CHUNK_ALIGN = 128


def chunk_rows(vocab: int) -> int:
    """Tokens a chunk for this vocabulary: its float32 logits within `CHUNK_BYTES`, a multiple of `CHUNK_ALIGN`."""
    return max(CHUNK_ALIGN, CHUNK_BYTES // (4 * vocab) // CHUNK_ALIGN * CHUNK_ALIGN)
