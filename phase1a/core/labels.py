"""The label of a token that is not trained: prompts, padding, the first token of a packed example.

-100 is PyTorch's `cross_entropy(ignore_index=...)` default and what transformers' collators write, so datasets
tokenized here and there agree. Tokenize writes it (phase1a/data/render.py); training, evaluation and generation
read it.
"""
from __future__ import annotations

IGNORE_INDEX = -100
