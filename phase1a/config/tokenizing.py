"""The tokenize settings a config names: `tokenize_options`, its `data` section as the library's TokenizeOptions
(phase1a/data/tokenizing.py), the one place that maps one onto the other."""
from __future__ import annotations

from phase1a.config.schema import Phase1aConfig
from phase1a.data.tokenizing import TokenizeOptions
from phase1a.store.base import Store


def tokenize_options(config: Phase1aConfig, store: Store | None = None) -> TokenizeOptions:
    """`store`: the open store the shards are shared through (config.stores.open_store); None shares none, and
    never changes the dataset's key."""
    settings = config.data.model_dump(include=set(TokenizeOptions.model_fields) - {"s3_endpoint_url", "store"})
    return TokenizeOptions(**settings, store=store, s3_endpoint_url=config.endpoint_for(config.data.source))
