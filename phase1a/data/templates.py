"""Chat templates that `data.chat_template` selects instead of the tokenizer's own: a name or a Jinja file.

A template must render incrementally (a conversation's rendering starts with the rendering of every prefix
of it, generation prompt included) so that assistant turns can be cut out for the loss mask; phase1a/data/render.py
checks this. Neither template here trims or escapes content, so the renderer's fast recipe path applies.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from phase1a.core.errors import DataError

CHAT_TEMPLATES: dict[str, str] = {
    # ChatML as in SmolLM2-Instruct's and Qwen2's tokenizer_config.json, without their default system prompt.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Meta-Llama-3-8B-Instruct's tokenizer_config.json, without its `| trim` on content: the model sees the
    # data's text as written (and the recipe path, which substitutes content verbatim, stays exact).
    "llama3": (
        "{% for message in messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
        " + message['content'] + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
        "{% endif %}{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
}
# Control tokens as ChatML, Llama 3, Phi-3 and most current templates write them: `<|name|>`.
_CONTROL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")


def template_text(setting: str | None) -> str | None:
    """The Jinja text `data.chat_template` names (None: the tokenizer's own template)."""
    if setting is None:
        return None
    if setting in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[setting]
    path = Path(setting)
    if not path.is_file():
        raise DataError(f"data.chat_template: {setting}: no such file, and not a named template "
                        f"({', '.join(CHAT_TEMPLATES)})")
    return path.read_text(encoding="utf-8")


def template_fingerprint(setting: str | None) -> str:
    """The template's text as a cache key: an edited file tokenizes anew ('' for the tokenizer's own, which the
    tokenizer fingerprint already covers)."""
    text = template_text(setting)
    return "" if text is None else hashlib.sha256(text.encode()).hexdigest()


def apply_chat_template_setting(tokenizer, setting: str | None):
    """Give `tokenizer` the template `data.chat_template` names, after checking that each of the template's
    control tokens is one token of this tokenizer (split into pieces, a model could never emit the end of a
    turn as one step, and the template's markers would be trained as ordinary text)."""
    text = template_text(setting)
    if text is None:
        return tokenizer
    for token in sorted(set(_CONTROL_TOKEN.findall(text))):
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
            raise DataError(f"data.chat_template {setting}: {token} is not a single token of this model's tokenizer "
                            f"(it encodes to {len(ids)} tokens); choose a template made for this model")
    tokenizer.chat_template = text
    return tokenizer
