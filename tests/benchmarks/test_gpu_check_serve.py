"""The gpu-check part serve-vllm, in this process on the CPU: the validate stage and promotion where they import
(this venv has what a bare GPU host lacks), and the comparison with a stand-in for vLLM that serves the prompts
with transformers, the adapter applied or, as a broken server would, left out. vLLM itself runs on a GPU host
only (docs/gpu.md); the dry run in test_gpu_check.py shows the part stopping there."""
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_check  # noqa: E402 - after its folder is on the path


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    threads = torch.get_num_threads()
    job = gpu_check._serve_job(tmp_path_factory.mktemp("serve"), dry_run=True)  # sets one thread
    try:
        yield job, gpu_check._validated(job)
    finally:
        torch.set_num_threads(threads)


def test_the_validate_stage_scores_and_promotes_the_adapter(validated):
    job, result = validated
    assert result["validated_by"].startswith("the validate stage; promoted as ")
    assert Path(result["adapter"]).is_relative_to(job.run_dir / "promoted") and result["train_steps"] == 96
    assert result["validate_exact_match"] > 0.5  # the lookup task, learnt; the base model scores 0


def fake_vllm(monkeypatch, apply_adapter: bool) -> dict:
    """`vllm` whose LLM generates greedily with transformers: with the LoRARequest's adapter, or without it."""
    from phase1a.evaluate.generation import generate_greedy
    from phase1a.model.loading import load_for_eval, load_tokenizer

    seen = {}

    class LLM:
        def __init__(self, model: str, **options):
            seen.update(options, model=model)

        def generate(self, prompts, params, lora_request):
            seen["adapter"] = lora_request.lora_path
            adapter = Path(lora_request.lora_path) if apply_adapter else None
            model = load_for_eval(Path(seen["model"]), adapter, torch.device("cpu"))
            outputs = generate_greedy(model, [np.array(p["prompt_token_ids"]) for p in prompts], params.max_tokens,
                                      params.stop_token_ids, load_tokenizer(Path(seen["model"])).pad_token_id, 16)
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=o.tokens)]) for o in outputs]

    vllm, request = types.ModuleType("vllm"), types.ModuleType("vllm.lora.request")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = LLM, types.SimpleNamespace, "stand-in"
    request.LoRARequest = lambda name, number, path: types.SimpleNamespace(lora_path=path)
    modules = {"vllm": vllm, "vllm.lora": types.ModuleType("vllm.lora"), "vllm.lora.request": request}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return seen


def test_a_server_that_applies_the_adapter_matches_the_validate_stage(validated, monkeypatch):
    job, result = validated
    seen = fake_vllm(monkeypatch, apply_adapter=True)
    served = gpu_check._serve_and_compare(job, result, max_lora_rank=8)
    assert served["status"] == "ok" and "reason" not in served, served
    assert served["vllm_exact_match"] == pytest.approx(result["validate_exact_match"]) and served["difference"] == 0
    assert seen["enable_lora"] and seen["max_lora_rank"] == 8 and seen["skip_tokenizer_init"]
    assert seen["adapter"] == result["adapter"] and served["examples"] == gpu_check.SERVE_EXAMPLES


def test_a_server_that_drops_the_adapter_fails_the_part(validated, monkeypatch):
    job, result = validated
    fake_vllm(monkeypatch, apply_adapter=False)
    served = gpu_check._serve_and_compare(job, result, max_lora_rank=8)
    assert served["status"] == "failed" and served["vllm_exact_match"] < 0.2
    assert served["reason"].startswith(f"vLLM's exact match {served['vllm_exact_match']:.3f} differs from the "
                                       f"validate stage's {result['validate_exact_match']:.3f}")
