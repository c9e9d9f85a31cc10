"""Answer extraction for exact match: what of a generated (or reference) text counts as the answer.

Both the model's output and the reference go through the same extractor, so formatting that the task does
not care about (surrounding whitespace, the end-of-turn token, thousands separators) never decides a match.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Iterable, Literal

Extractor = Literal["whole", "last_number", "regex"]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+")


def normalise(text: str, special_tokens: Iterable[str] = ()) -> str:
    """Strip, drop trailing special tokens (EOS, end-of-turn; repeatedly, with whitespace between them), and
    collapse inner whitespace to single spaces."""
    specials = sorted({token for token in special_tokens if token}, key=len, reverse=True)
    text = text.strip()
    while True:
        for token in specials:
            if text.endswith(token):
                text = text[: -len(token)].rstrip()
                break
        else:
            break
    return " ".join(text.split())


def _canonical_number(raw: str) -> str:
    # "1,000", "1000.0" and "+1000" are the same answer; Decimal keeps 0.1 exact where float would not.
    try:
        value = Decimal(raw.replace(",", ""))
    except InvalidOperation:
        return raw
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return str(value.normalize())


def extract_answer(text: str, extractor: Extractor, pattern: str | None = None,
                   special_tokens: Iterable[str] = ()) -> str | None:
    """The answer in `text`, or None when there is none (no number, no match): None never equals anything."""
    text = normalise(text, special_tokens)
    if extractor == "whole":
        return text
    if extractor == "last_number":
        numbers = _NUMBER.findall(text)
        return _canonical_number(numbers[-1]) if numbers else None
    if extractor == "regex":
        if not pattern:
            raise ValueError("the regex extractor needs a pattern (validation.answer_pattern)")
        match = re.search(pattern, text)
        if match is None or match.group(1) is None:
            return None
        return " ".join(match.group(1).split())
    raise ValueError(f"unknown extractor {extractor!r}")
