"""The Hugging Face side of our tokenizer: a fast tokenizer that transformers loads with its own class
and that gives exactly our source ids for a raw text. Also where transformers, an optional
dependency, is imported for every part of the Hugging Face export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformer.data.text import clean_text_normalizer
from transformer.data.tokenizer import BOS, EOS, EOS_ID, PAD, UNK, Tokenizers
from transformer.errors import UserError
from transformer.files import write_json_atomic

INSTALL_HINT = 'pip install -e ".[hf]"'


def import_transformers() -> Any:
    """The transformers module, or a UserError saying how to install it (an optional dependency)."""
    try:
        import transformers
    except ImportError:
        raise UserError(f"the transformers package is not installed; install it with {INSTALL_HINT}") from None
    return transformers


def build_hf_tokenizer(tokenizers: Tokenizers, max_len: int) -> Any:
    """A fast tokenizer that gives exactly our source ids for a raw text: clean_text as a normalizer
    before our tokenizer's own, our source tokenizer, its source prefix first (an imported multi-target
    model's target-language token: the exported model translates into that language without being told)
    and EOS appended (our sources have EOS and no BOS). Where the run has two tokenizer files over one
    vocabulary (an imported OPUS-MT model), the source one: it decodes target ids too."""
    transformers = import_transformers()
    from tokenizers import Tokenizer, normalizers, processors

    tokenizer = Tokenizer.from_str(tokenizers.source.to_str())  # a copy: the run's object stays as it is
    own = [tokenizer.normalizer] if tokenizer.normalizer is not None else []
    tokenizer.normalizer = normalizers.Sequence([clean_text_normalizer(), *own])
    prefix = list(tokenizers.source_prefix)
    first = [token for token, _ in prefix]
    tokenizer.post_processor = processors.TemplateProcessing(single=[*first, "$A", EOS],
                                                             pair=[*first, "$A", "$B", EOS],
                                                             special_tokens=[*prefix, (EOS, EOS_ID)])
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return transformers.PreTrainedTokenizerFast(
        # An imported Marian vocabulary has no <s>: naming one would add it to the vocabulary.
        tokenizer_object=tokenizer, bos_token=BOS if tokenizer.token_to_id(BOS) is not None else None,
        eos_token=EOS, unk_token=UNK, pad_token=PAD,
        model_max_length=max_len,  # with truncation=True: max_len - 1 subwords and EOS, as we truncate
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids, which generate() would refuse
        clean_up_tokenization_spaces=False,  # it would glue French "! ? : ;" to the word before
        # A text that spells a special token reads as ours does (tokenizer.py decides it); the copy above
        # lost the setting, which tokenizer files do not keep, and transformers saves it in its config.
        split_special_tokens=tokenizers.source.encode_special_tokens,
    )


def name_tokenizer_class(path: Path) -> None:
    """Name the tokenizer class as transformers 4 and 5 both know it: 5 writes its new name for the
    class (TokenizersBackend), which 4 cannot load, and reads the old one as that class."""
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json_atomic(path, settings)


__all__ = ["INSTALL_HINT", "import_transformers", "build_hf_tokenizer", "name_tokenizer_class"]
