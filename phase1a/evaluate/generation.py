"""Batched greedy generation on held-out examples: prompts and references come from the tokenized rows.

An example's prompt is its tokens up to its first supervised token (the rendered conversation up to the
assistant's first reply, generation header included); its reference is that first run of supervised tokens
(the reply and its end-of-turn token). Later turns of a multi-turn example are not generated: the prompt
would need the reference's own tokens.

Prompts are left-padded so every row's next token sits in the last column; the attention mask hides the
padding and transformers derives position ids from it, so a padded row generates what it would alone (tested).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from phase1a.core.labels import IGNORE_INDEX
from phase1a.evaluate.result import DecodeBatch
from phase1a.train.packing import TokenRows


@dataclass
class GenerationExample:
    prompt: np.ndarray  # token ids
    reference: np.ndarray  # token ids of the first supervised run


@dataclass
class Generated:
    tokens: list[int]  # up to and including the first stop token, or max_new_tokens of them
    token_probs: list[float]  # the probability the model gave each of those tokens

    @property
    def mean_prob(self) -> float:
        return float(np.mean(self.token_probs)) if self.token_probs else 0.0


def generation_examples(rows: TokenRows, indices: np.ndarray) -> list[GenerationExample] | str:
    """Prompt and reference per example, or why the sample cannot be generated from (a string)."""
    examples = []
    for i in indices:
        start, end = int(rows.offsets[i]), rows.end(int(i))
        supervised = np.flatnonzero(rows.labels[start:end] != IGNORE_INDEX)
        if supervised.size == 0:
            return f"validation example {int(i)} has no supervised tokens"
        first = int(supervised[0])
        if first == 0:
            return (f"validation example {int(i)} is supervised from its first token (train_on_inputs or plain "
                    "text), so it has no prompt to generate from")
        gaps = np.flatnonzero(np.diff(supervised) > 1)
        last = int(supervised[gaps[0]]) if gaps.size else int(supervised[-1])
        examples.append(GenerationExample(prompt=rows.input_ids[start : start + first].astype(np.int64),
                                          reference=rows.input_ids[start + first : start + last + 1].astype(np.int64)))
    return examples


def stop_token_ids(tokenizer, model, examples: list[GenerationExample] = ()) -> list[int]:
    """EOS of the tokenizer and of the model's generation config (chat models end a turn with their own), and
    the last special token of each reference: the end-of-turn token of the template the data was rendered
    with, which under a `data.chat_template` override may be one the model's configs do not name."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    added = tokenizer.added_tokens_decoder.items()
    special = set(tokenizer.all_special_ids) | {i for i, token in added if token.special}
    for example in examples:
        ends = [int(token) for token in example.reference if int(token) in special]
        ids.update(ends[-1:])
    return sorted(i for i in ids if i is not None)


class _GreedyProbability:
    """A logits processor that records, per step, the probability of the token greedy decoding picks (the
    arg-max, since this is the last processor and nothing samples). It keeps (batch, steps) floats instead of
    the (batch, steps, vocab) logits that `output_logits` would hold on the device."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.steps.append(torch.softmax(scores.float(), dim=-1).amax(dim=-1).cpu())
        return scores


def left_padded(prompts: list[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with every prompt ending in the last column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.from_numpy(prompt)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def decode_batches(examples: list[GenerationExample], max_new_tokens: int, batch_size: int,
                   to_max: bool = False) -> list[DecodeBatch]:
    """The batches generating `examples`: a batch runs until its longest answer has ended, taken as its longest
    reference plus the stop token, at most `max_new_tokens` (`to_max`: every batch to `max_new_tokens`, as a
    model that rarely stops where the references do)."""
    batches = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        steps = max_new_tokens if to_max else min(max_new_tokens, max(len(e.reference) for e in batch) + 1)
        batches.append(DecodeBatch(width=max(len(e.prompt) for e in batch), steps=steps))
    return batches


@torch.no_grad()
def time_decode_step(model, prompts: list[np.ndarray], pad_id: int, steps: int = 8,
                     deadline: float = math.inf, wider: int = 0) -> DecodeTiming:
    """One prefill of this batch of prompts, then up to `steps` greedy steps with the KV cache, timed after one
    untimed step, none started past `deadline` (perf_counter time) but the first timed one: the prefill's seconds
    and the seconds per step. Each step records its token's probability as `generate_greedy` does (a softmax over
    the vocabulary per row). With `wider`, the cache then grows by that many masked columns and the steps are
    timed again: a step's cost grows with what it attends to, and a long answer's last steps attend to far more
    than its first (the cache is widened, not prefilled: a prefill that wide would cost more than the steps).
    Run under no_grad."""
    device = next(model.parameters()).device
    input_ids, attention_mask = (t.to(device) for t in left_padded(prompts, pad_id))
    _sync(device)
    began = time.perf_counter()
    output = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
    _sync(device)
    prefill = time.perf_counter() - began
    state = _Decoding(model, output.past_key_values, output.logits[:, -1:].argmax(dim=-1), attention_mask)
    narrow = state.timed(steps, deadline)
    timing = DecodeTiming(prefill_seconds=prefill, seconds_per_step=narrow.seconds, steps=narrow.steps,
                          context=narrow.context)
    if wider <= 0 or time.perf_counter() + narrow.seconds * (steps + 1) > deadline or not state.widen(wider):
        return timing
    wide = state.timed(steps, deadline)
    return dataclasses.replace(timing, wide_seconds_per_step=wide.seconds, wide_context=wide.context)


@dataclass(frozen=True)
class _TimedSteps:
    seconds: float  # a timed step's mean
    steps: int
    context: float  # the timed steps' mean attention length


class _Decoding:
    """Greedy decoding's state between timed runs of steps."""

    def __init__(self, model, cache, token: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.model, self.cache, self.token, self.attention_mask = model, cache, token, attention_mask
        self.device, self.recorder = token.device, _GreedyProbability()

    def timed(self, steps: int, deadline: float) -> _TimedSteps:
        ones = self.attention_mask.new_ones((self.attention_mask.size(0), 1))  # each step attends to one more token
        durations, contexts = [], []
        for _ in range(1 + steps):  # the first step is untimed: the cache's first growth, lazy set-up
            if len(durations) > 1 and time.perf_counter() + durations[-1] > deadline:
                break
            began = time.perf_counter()
            self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
            output = self.model(input_ids=self.token, attention_mask=self.attention_mask, past_key_values=self.cache,
                                use_cache=True, logits_to_keep=1)
            self.cache = output.past_key_values
            self.token = self.recorder(self.token, output.logits[:, -1]).argmax(dim=-1, keepdim=True)
            _sync(self.device)
            durations.append(time.perf_counter() - began)
            contexts.append(self.attention_mask.size(1))
        return _TimedSteps(float(np.mean(durations[1:])), len(durations) - 1, float(np.mean(contexts[1:])))

    def widen(self, columns: int) -> bool:
        """`columns` more cache positions, masked (zeros in every layer's keys and values); False where this cache
        cannot be widened so (a cache type without per-layer tensors)."""
        layers = getattr(self.cache, "layers", None)
        if not layers or getattr(layers[0], "keys", None) is None:
            return False
        for index, layer in enumerate(layers):
            keys, values = layer.keys, layer.values
            self.cache.update(keys.new_zeros((*keys.shape[:2], columns, keys.shape[-1])),
                              values.new_zeros((*values.shape[:2], columns, values.shape[-1])), index)
        masked = self.attention_mask.new_zeros((self.attention_mask.size(0), columns))
        self.attention_mask = torch.cat([self.attention_mask, masked], dim=1)
        return True


@dataclass(frozen=True)
class DecodeTiming:
    prefill_seconds: float
    seconds_per_step: float
    steps: int  # timed
    context: float = 0.0  # the timed steps' mean attention length
    wide_seconds_per_step: float | None = None  # the steps timed again with the cache widened
    wide_context: float | None = None

    def per_context_token(self) -> float:
        """What a step costs more for each position it attends to: the line through the two timings (0 without a
        wide timing, or where noise makes the wide steps no dearer, or so much dearer that a step would cost nothing
        apart from what it attends to: a step always reads the weights)."""
        if self.wide_seconds_per_step is None or not self.wide_context or self.wide_context <= self.context:
            return 0.0
        slope = (self.wide_seconds_per_step - self.seconds_per_step) / (self.wide_context - self.context)
        return slope if 0.0 < slope * self.context < self.seconds_per_step else 0.0

    def at_no_context(self) -> float:
        """A step's cost apart from what it attends to (the timed step's own where no slope was measured)."""
        return max(0.0, self.seconds_per_step - self.per_context_token() * self.context)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate_greedy(model, prompts: list[np.ndarray], max_new_tokens: int, stop_ids: list[int], pad_id: int,
                    batch_size: int) -> list[Generated]:
    """Greedy continuations of `prompts`, `batch_size` at a time, cut after the first stop token."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    # A fresh config: a checkpoint's own generation_config may ask for sampling; this run must be greedy.
    # use_cache=True explicitly: training switches the model config's cache off for packed rows, and without
    # the KV cache every new token would recompute the whole prefix.
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                              eos_token_id=stop_ids, pad_token_id=pad_id)
    results: list[Generated] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        input_ids, attention_mask = left_padded(batch, pad_id)
        width = input_ids.shape[1]
        recorder = _GreedyProbability()
        sequences = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                   generation_config=config, logits_processor=LogitsProcessorList([recorder]))
        new_tokens = sequences[:, width:].cpu()
        probs = torch.stack(recorder.steps, dim=1)
        for row in range(len(batch)):
            tokens, token_probs = [], []
            for token, prob in zip(new_tokens[row].tolist(), probs[row].tolist()):
                tokens.append(token)
                token_probs.append(prob)
                if token in stop_ids:
                    break
            results.append(Generated(tokens, token_probs))
    return results
