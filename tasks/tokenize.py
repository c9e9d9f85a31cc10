"""Tokenize: the staged dataset (and held-out set) to token ids and labels with a held-out split, once per
content (the work: phase1a/data/tokenizing.py).

The recipe, in named phases:
  1. settings   the config's data settings as TokenizeOptions (phase1a/config/tokenizing.py), with the store
                the shards are shared through
  2. tokenizer  the model's, with `data.chat_template` applied
  3. tokenize   `tokenize_dataset` into the directory the dataset's fingerprint names, reused when complete

Its key (`tokenized_fingerprint`) is the staged content, the tokenizer and the data settings; where it lands is the
dataset's manifest, written last.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from phase1a.config.schema import Phase1aConfig
from phase1a.config.stores import open_store
from phase1a.config.tokenizing import tokenize_options
from phase1a.data.templates import apply_chat_template_setting
from phase1a.data.tokenized import TokenizedData
from phase1a.data.tokenizing import dataset_dir, tokenize_dataset, tokenize_fingerprint
from phase1a.model.loading import load_tokenizer
from phase1a.model.result import ResolvedModel
from tasks.caching import StageCache, task

if TYPE_CHECKING:  # staging imports boto3, which a bare GPU host (that tokenizes local files) lacks
    from phase1a.data.staging import StagedData


def tokenized_fingerprint(config: Phase1aConfig, model: ResolvedModel, staged: StagedData,
                          held_out: StagedData | None = None) -> str:
    """The tokenize stage's key, from its own inputs: the staged content, the tokenizer, the data settings."""
    return tokenize_fingerprint([item.fingerprint for item in (staged, held_out) if item], model.tokenizer_fingerprint,
                                model.max_positions, tokenize_options(config))


def _tokenized_manifest(fingerprint: str, config: Phase1aConfig, **_) -> Path:
    return dataset_dir(config.cache_dir, fingerprint) / "manifest.json"  # written last: the dataset is whole


@task(name="tokenize", cache_policy=StageCache(fingerprint=tokenized_fingerprint, output=_tokenized_manifest),
      persist_result=True, result_serializer="json")
def tokenize_task(config: Phase1aConfig, model: ResolvedModel, staged: StagedData,
                  held_out: StagedData | None = None) -> TokenizedData:
    options = tokenize_options(config, open_store(config.store))  # 1. settings
    tokenizer = apply_chat_template_setting(load_tokenizer(Path(model.path), config.model.trust_remote_code),
                                            options.chat_template)  # 2. tokenizer
    out_dir = dataset_dir(config.cache_dir, tokenized_fingerprint(config, model, staged, held_out))
    return tokenize_dataset(staged, tokenizer, model.max_positions, options, out_dir, held_out)  # 3. tokenize
