"""Named chat templates that `data.chat_template` can select instead of the tokenizer's own.

(Skeleton: the registry is being built.)
"""
from __future__ import annotations

CHAT_TEMPLATES: dict[str, str] = {}
