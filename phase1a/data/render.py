"""Conversations to token ids and labels, a batch at a time, with no per-token Python.

Masking: the conversation is rendered with the model's chat template and split at message boundaries;
assistant turns (tool-call turns included) carry labels, the rest is -100 (all of it is trained with
`train_on_inputs`). An assistant message marked `"train": False` is context, not trained (a TRL prompt's
earlier replies). Without a chat template the documented fallback is
    "<bos>" "### System:\n{system}\n\n" "### User:\n{user}\n\n" "### Assistant:\n{assistant}<eos>\n\n"
Plain `text` records are never templated: "<bos>{text}<eos>", all trained.

Speed: rendering a Jinja template per record dominates tokenization time, so each conversation shape (its
sequence of roles) is rendered once with placeholders into a recipe of literal and content pieces; records
of that shape are then assembled by substitution. The first record of every shape is also rendered the slow
way and compared; a template that transforms content falls back to per-record rendering. Only conversations
of plain role/content messages without tools take recipes (a role sequence is then the whole structure);
tool calls, tool schemas and untrained replies are rendered per record.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from phase1a.core.errors import DataError
from phase1a.core.labels import IGNORE_INDEX

_MARK = "\x00phase1a-content-{}\x00"


def _trained(message: dict) -> bool:
    return message["role"] == "assistant" and message.get("train", True)


def render_segments(messages: list[dict], tokenizer, tools: list[dict] | None = None) -> list[tuple[str, bool]]:
    """The conversation as (text, trained) pieces; assistant turns are the trained ones."""
    if len(messages) == 1 and messages[0]["role"] == "assistant":  # a plain `text` record
        return [(tokenizer.bos_token or "", False), (messages[0]["content"] + (tokenizer.eos_token or ""), True)]
    if not getattr(tokenizer, "chat_template", None):
        return _fallback_segments(messages, tokenizer, tools)
    segments: list[tuple[str, bool]] = []
    done = ""
    for index, message in enumerate(messages):
        if not _trained(message):
            continue
        prompt = tokenizer.apply_chat_template(messages[:index], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[: index + 1], tools=tools, tokenize=False)
        if not (prompt.startswith(done) and full.startswith(prompt)):
            raise DataError("the chat template does not render conversations incrementally; cannot mask by turn")
        segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    return segments


def _fallback_segments(messages: list[dict], tokenizer, tools: list[dict] | None) -> list[tuple[str, bool]]:
    if tools or any(m["role"] == "tool" or "tool_calls" in m for m in messages):
        # The fallback has no agreed way to write calls; inventing one would teach the model a private format.
        raise DataError("tool calls and tools need a chat template; the tokenizer has none: set data.chat_template")
    headers = {"system": "### System:\n", "user": "### User:\n", "assistant": "### Assistant:\n"}
    segments: list[tuple[str, bool]] = [(tokenizer.bos_token or "", False)]
    for message in messages:
        segments.append((headers[message["role"]], False))
        if _trained(message):
            segments.append((message["content"] + (tokenizer.eos_token or ""), True))
            segments.append(("\n\n", False))
        else:
            segments.append((message["content"] + "\n\n", False))
    return segments


@dataclass
class _Recipe:
    """Per segment: pieces that are literal text (str) or the index of a message's content (int)."""

    segments: list[tuple[list[str | int], bool]]
    verified: bool = False
    usable: bool = True


class Renderer:
    def __init__(self, tokenizer, train_on_inputs: bool = False) -> None:
        self.tokenizer = tokenizer
        self.train_on_inputs = train_on_inputs
        self._recipes: dict[tuple[str, ...], _Recipe] = {}

    def segments(self, messages: list[dict], tools: list[dict] | None = None) -> list[tuple[str, bool]]:
        if tools is not None or any(len(m) != 2 for m in messages):  # more than role and content: no recipe
            return self._inputs_trained(render_segments(messages, self.tokenizer, tools))
        shape = tuple(m["role"] for m in messages)
        recipe = self._recipes.get(shape) or self._recipes.setdefault(shape, self._recipe(shape))
        if not recipe.usable:
            segments = render_segments(messages, self.tokenizer)
        else:
            segments = [("".join(p if isinstance(p, str) else messages[p]["content"] for p in pieces), trained)
                        for pieces, trained in recipe.segments]
            if not recipe.verified:
                recipe.verified = True
                if segments != render_segments(messages, self.tokenizer):
                    recipe.usable = False  # the template changes content (trims, escapes): render each record
                    segments = render_segments(messages, self.tokenizer)
        return self._inputs_trained(segments)

    def _inputs_trained(self, segments: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
        if self.train_on_inputs:
            segments = [(text, True) for text, _ in segments]
        return [segment for segment in segments if segment[0]]

    def _recipe(self, shape: tuple[str, ...]) -> _Recipe:
        marked = [{"role": role, "content": _MARK.format(i)} for i, role in enumerate(shape)]
        recipe = []
        for text, trained in render_segments(marked, self.tokenizer):
            pieces: list[str | int] = []
            for part_index, part in enumerate(text.split("\x00")):
                if part_index % 2 == 1 and part.startswith("phase1a-content-"):
                    pieces.append(int(part.removeprefix("phase1a-content-")))
                elif part:
                    pieces.append(part)
            recipe.append((pieces, trained))
        return _Recipe(recipe)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """The Rust tokenizer directly (threads across cores, no offsets), skipping transformers' per-text wrapping."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]


@dataclass
class TokenizedChunk:
    """Flat token ids and labels with per-record offsets: an Arrow list column without copies."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray


def tokenize_conversations(conversations: list[list[tuple[str, bool]]], tokenizer) -> TokenizedChunk:
    """One batched fast-tokenizer call for every segment of every conversation; labels by numpy masks."""
    texts = [text for segments in conversations for text, _ in segments]
    trained = np.fromiter((flag for segments in conversations for _, flag in segments), dtype=bool, count=len(texts))
    # pyarrow turns the list of id lists into flat values and offsets in C++, not a Python loop per token.
    encoded = pa.array(_encode(tokenizer, texts), type=pa.list_(pa.int32()))
    values = encoded.values.to_numpy()
    segment_lengths = np.diff(encoded.offsets.to_numpy()).astype(np.int64)
    labels = np.where(np.repeat(trained, segment_lengths), values, IGNORE_INDEX).astype(np.int32)
    per_record = np.fromiter((len(segments) for segments in conversations), dtype=np.int64, count=len(conversations))
    segment_ends = np.concatenate([[0], np.cumsum(segment_lengths)])
    offsets = segment_ends[np.concatenate([[0], np.cumsum(per_record)])].astype(np.int32)
    return TokenizedChunk(values, labels, offsets)
