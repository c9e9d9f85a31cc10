"""The memory and FLOPs model: textbook numbers for an 8B model, and the activation terms against the peak a real
forward/backward allocates on this CPU (torch profiler)."""
import pytest
import torch

from helpers import FACTS_8B, peak_tensor_bytes
from phase1a.config.schema import Phase1aConfig
from phase1a.core.units import GIB
from phase1a.model.cost_model import (
    NF4_BYTES,
    MemoryModel,
    ModelFacts,
    TrainingShape,
    flops_per_token,
    lora_parameters,
    model_facts,
)
from phase1a.train.packing import PackedRow, summed_loss

LORA = TrainingShape(weight_bytes=2)
FULL = TrainingShape(full=True, weight_bytes=2)


def eight_b(shape: TrainingShape = LORA, trainable: int = 20_000_000, available: int = 80 * GIB) -> MemoryModel:
    """Llama-3-8B's bill: LoRA with 20M trainable parameters on an H100 unless told otherwise."""
    return MemoryModel(FACTS_8B, shape, trainable, available)


def full_8b(shape: TrainingShape = FULL, available: int = 80 * GIB) -> MemoryModel:
    return eight_b(shape, FACTS_8B.parameters, available)


def test_model_facts_count_parameters_without_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    facts = model_facts(tiny_model_dir)
    assert facts.parameters == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    shape = (facts.layers, facts.hidden, facts.max_positions, facts.heads, facts.kv_heads, facts.kv_width)
    assert shape == (2, 64, 256, 4, 2, 32)


def test_memory_model_matches_the_textbook_numbers():
    lora = eight_b().estimate(4096, False)
    assert lora.weights_gib == pytest.approx(8.03e9 * 2 / GIB)
    assert lora.trainable_gib == pytest.approx(20e6 * 16 / GIB)  # fp32 adapter, gradient, two Adam moments
    full = full_8b().estimate(4096, False)
    assert full.weights_gib + full.trainable_gib == pytest.approx(8.03e9 * 16 / GIB)  # mixed-precision Adam
    checkpointed = eight_b().estimate(4096, True)
    assert checkpointed.activations_gib < lora.activations_gib / 10


def test_a_4bit_base_and_8bit_optimizer_shrink_what_they_should():
    qlora = eight_b(TrainingShape(weight_bytes=2, base_bits=4)).estimate(4096, False)
    projections = FACTS_8B.projection_parameters
    assert projections == 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)  # Llama-3-8B's layers
    expected = projections * NF4_BYTES + (FACTS_8B.parameters - projections) * 2
    assert qlora.weights_gib == pytest.approx(expected / GIB)
    assert 5.0 < qlora.weights_gib < 6.0  # the QLoRA paper's ~5.7 GB for an 8B base
    eight_bit, fused, unfused = (full_8b(TrainingShape(full=True, optimizer=optimizer), GIB).estimate(1, False)
                                 for optimizer in ("adamw_8bit", "adamw_fused", "adamw"))
    assert fused.trainable_gib - eight_bit.trainable_gib == pytest.approx(8.03e9 * 6 / GIB)
    assert unfused.trainable_gib - fused.trainable_gib == pytest.approx(8.03e9 * 4 / GIB)


def test_fsdp_shards_weights_and_state_but_not_activations():
    whole = full_8b().estimate(4096, True)
    sharded = full_8b(FULL.model_copy(update={"shards": 4})).estimate(4096, True)
    gathered = 2 * whole.weights_gib / 32  # the layer computing and the next one, whole
    assert sharded.weights_gib == pytest.approx(whole.weights_gib / 4 + gathered)
    assert sharded.trainable_gib == pytest.approx(whole.trainable_gib / 4)
    assert (sharded.activations_gib, sharded.logits_gib) == (whole.activations_gib, whole.logits_gib)
    assert whole.total_gib > 80 > sharded.total_gib  # a full 8B fine-tune: one H100 cannot, four sharded can


def test_micro_batch_choice_prefers_no_checkpointing_then_falls_back():
    micro, checkpointing, estimate = eight_b().choose(16, 1024)
    assert 16 % micro == 0 and not checkpointing and estimate.total_gib <= 80
    bigger = eight_b().estimate(2 * micro * 1024, False)
    assert micro == 16 or bigger.total_gib > 80  # the largest divisor that fits
    micro, checkpointing, _ = eight_b(available=24 * GIB).choose(16, 4096)
    assert checkpointing
    with pytest.raises(MemoryError, match="does not fit"):
        full_8b(available=24 * GIB).choose(16, 8192)


def test_lora_parameter_count_matches_peft(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = Phase1aConfig.model_validate({"data": {"source": "x"}, "method": {"lora": {"r": 4}}})
    modules = config.method.lora.target_modules
    lora = LoraConfig(r=4, target_modules=modules)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_parameters(model_facts(tiny_model_dir), 4, modules) == trainable


def test_flops_per_token():
    n = FACTS_8B.parameters
    assert flops_per_token(FACTS_8B, False, False, 0) == 4 * n
    assert flops_per_token(FACTS_8B, True, True, 0) == 8 * n


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_memory_model_against_the_measured_peak(checkpointing, attention):
    """A LoRA step's forward and backward on one packed row of 1024 tokens (fp32, as on CPU): the model's
    activations + logits + mask + gradients must cover the measured peak, and not by more than 20 %. Only
    `sdpa` builds the block-diagonal mask."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import phase1a.model.attention  # noqa: F401  (registers varlen)
    from phase1a.model import chunked_loss
    from phase1a.model.build import set_gradient_checkpointing

    torch.manual_seed(0)
    shape = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                        tie_word_embeddings=True, attn_implementation=attention)
    model = get_peft_model(chunked_loss.install(LlamaForCausalLM(shape)),
                           LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    model.config.use_cache = False
    set_gradient_checkpointing(model, checkpointing)
    tokens = 1024
    ids = torch.randint(0, shape.vocab_size, (1, tokens))
    positions = torch.cat([torch.arange(600), torch.arange(tokens - 600)])[None]  # two packed examples
    batch = PackedRow(input_ids=ids, labels=ids, position_ids=positions,
                      cu_seqlens=torch.tensor([0, 600, tokens], dtype=torch.int32), max_seqlen=600, tokens=tokens,
                      supervised=tokens - 1)

    def step():
        loss, _ = summed_loss(model, batch)
        loss.backward()

    step()  # first call: lazy initialisation stays out of the measurement
    model.zero_grad(set_to_none=True)
    measured = peak_tensor_bytes(step)

    facts = ModelFacts(parameters=0, layers=3, hidden=256, intermediate=688, vocab=2000, max_positions=2048,
                       heads=4, kv_heads=2, head_dim=64)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = TrainingShape(weight_bytes=4, dense_mask=attention == "sdpa")
    estimate = MemoryModel(facts, shape, trainable, GIB).estimate(tokens, checkpointing)
    modelled = (estimate.activations_gib + estimate.logits_gib + estimate.mask_gib) * GIB + trainable * 4  # + gradients
    assert measured <= modelled <= 1.2 * measured, (measured, modelled)
