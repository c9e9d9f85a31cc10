"""Stage + tokenize of one source with the code of one checkout, in a fresh cache: run it with two checkouts,
alternating, to compare a change's first night (everything new) with the code before it.

    git worktree add /tmp/before REV
    for i in 1 2; do for code in /tmp/before .; do rm -rf /tmp/w
        uv run python benchmarks/tokenize_checkout.py $code SOURCE /tmp/w; done; done

Prints one JSON line: the checkout, the seconds, and the dataset's tokens and split sizes (which must agree).
"""
import json
import sys
import time
from pathlib import Path

root, source, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sys.path.insert(0, str(Path(root).resolve()))

import phase1a  # noqa: E402

assert phase1a.__file__.startswith(str(Path(root).resolve())), f"imported {phase1a.__file__}, not {root}'s"

from phase1a.config.schema import ModelConfig  # noqa: E402
from phase1a.data.staging import data_source_fingerprint, stage_dataset  # noqa: E402
from phase1a.data.tokenizing import TokenizeOptions, tokenize_dataset  # noqa: E402
from phase1a.model.loading import load_tokenizer, resolve_model  # noqa: E402

tokenizer = load_tokenizer(Path(resolve_model(ModelConfig(name_or_path="smollm2-135m-instruct"))))
began = time.perf_counter()
data_source_fingerprint(source)
staged = stage_dataset(source, work / "staging")
data = tokenize_dataset(staged, tokenizer, 8192, TokenizeOptions(), work / "cache" / "tokenized" / "fp")
print(json.dumps({"code": root, "seconds": round(time.perf_counter() - began, 2), "tokens": data.lengths.total_tokens,
                  "train": data.train_examples, "validation": data.validation_examples}))
