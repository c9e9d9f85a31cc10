"""What a promotion builds before the version is copied (`VersionArtifacts`): the adapter as promoted (weights
linked, with the tokenizer it was trained with when `data.chat_template` overrode the base's), and with
`promotion.export` the base with the adapter merged in (`merge_adapter`: `merged`, which loads without peft) and
GGUF files of it (`gguf`)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from phase1a.config.schema import Phase1aConfig
from phase1a.data.templates import apply_chat_template_setting
from phase1a.model.gguf import write_gguf
from phase1a.model.loading import is_adapter, load_model, load_tokenizer, peft_wrapping


def merge_adapter(model_dir: Path, adapter_dir: Path, target: Path, trust_remote_code: bool = False,
                  chat_template: str | None = None) -> Path:
    """The base with the adapter folded into its weights (in fp32, saved in the base's dtype), plus its tokenizer
    with the chat template the data was rendered with (`data.chat_template`): a model that loads without peft."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    saved_dtype = getattr(AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code), "dtype", None)
    with peft_wrapping():
        model = PeftModel.from_pretrained(load_model(Path(model_dir), torch.float32, trust_remote_code), adapter_dir)
    merged = model.merge_and_unload()
    if isinstance(saved_dtype, torch.dtype):
        merged = merged.to(saved_dtype)
    shutil.rmtree(target, ignore_errors=True)
    merged.save_pretrained(target)
    _trained_tokenizer(model_dir, chat_template, trust_remote_code).save_pretrained(target)
    return target


def _trained_tokenizer(model_dir: Path, chat_template: str | None, trust_remote_code: bool):
    return apply_chat_template_setting(load_tokenizer(Path(model_dir), trust_remote_code), chat_template)


@dataclass
class VersionArtifacts:
    """What one promotion builds in its scratch directory before the version is copied."""

    config: Phase1aConfig
    model_dir: Path
    adapter_dir: Path
    scratch: Path
    version: str

    def adapter(self) -> Path:
        """The adapter as promoted: its weights linked (a full fine-tune's are not copied twice), and with an
        overriding template the tokenizer it was trained with, which must reach whoever serves it, or prompts
        would be rendered in the base tokenizer's format."""
        target, template = self.scratch / "adapter", self.config.data.chat_template
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(self.adapter_dir, target, copy_function=_link_or_copy)
        if template is not None:
            _trained_tokenizer(self.model_dir, template, self.config.model.trust_remote_code).save_pretrained(target)
        return target

    def exports(self) -> dict[str, Path]:
        """`promotion.export`: the merged model (a full fine-tune's weights already are one) and its GGUF files,
        named by the version."""
        wanted, adapter = self.config.promotion.export, self.adapter_dir
        if not wanted:
            return {}
        merged = (merge_adapter(self.model_dir, adapter, self.scratch / "merged", self.config.model.trust_remote_code,
                                self.config.data.chat_template) if is_adapter(adapter) else adapter)
        exports = {"merged": merged} if "merged" in wanted and merged != adapter else {}
        if "gguf" in wanted:
            write_gguf(merged, self.scratch / "gguf", name=self.version)
            exports["gguf"] = self.scratch / "gguf"
        return exports


def _link_or_copy(source: str, target: str) -> None:
    """Weights are linked (never rewritten in place); the rest is copied, since a tokenizer saved over a linked
    file would rewrite the training directory's."""
    if Path(source).suffix in (".safetensors", ".bin"):
        try:
            return os.link(source, target)
        except OSError:  # another file system
            pass
    shutil.copy2(source, target)
