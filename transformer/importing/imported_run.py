"""A model of another toolkit imported as a run of ours: `import_model` reads it (source.py finds the
files, marian.py checks the config, marian_weights.py maps the weights, tokenizer_files.py brings the
tokenizer into our ids), rebuilds it as our Transformer, and writes a run directory as training would
leave one: config.yaml, tokenizer/, one checkpoint that `best` names, state.json, and imported.json
recording the source. Everything is read and checked before anything is written, and the run appears
whole or not at all (RunDirectory.written_whole, the run's one writer).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from transformer.checkpoints.files import write_checkpoint, write_failure_reason
from transformer.checkpoints.layout import Best, RunState, step_dir_name
from transformer.checkpoints.rundir import RunDirectory
from transformer.config import Config, DataConfig, DecodeConfig, ModelConfig, TokenizerConfig, TrainConfig
from transformer.config import config_to_yaml
from transformer.data.tokenizer import (BOS, BOS_ID, UNK_ID, save_tokenizers, tokenizer_fingerprint,
                                        with_source_prefix)
from transformer.errors import CheckpointError, ConfigError, UserError
from transformer.importing.marian import CONFIG_FILE, MarianShape, read_generation, read_marian_config
from transformer.importing.marian_weights import our_state_dict, read_weights
from transformer.importing.source import WEIGHTS_FILE, ModelSource, open_source
from transformer.importing.tokenizer_files import ImportedTokenizer, Vocabulary, check_target_language, read_tokenizer
from transformer.model import Transformer

log = logging.getLogger(__name__)

IMPORT_FORMAT = "transformer-enfr/import"  # in imported.json
IMPORT_VERSION = 1
_STEP = 0  # the imported checkpoint's step: this project has trained it for none
# The budget config.yaml names for a run that is not trained here: a fine-tuning config gives its own.
_TRAIN_MINUTES = 30.0


def import_model(source: str, run_dir: Path, target_language: str | None = None,
                 revision: str | None = None) -> Path:
    """Import the MarianMT model `source` (a local transformers directory or a Hub model id, at
    `revision`) as a new run at `run_dir`; `target_language`: a multilingual model's target-language
    code (its source prefix token, `>>fra<<`). Returns the run's path."""
    found = open_source(source, revision)
    directory = found.directory
    shape = read_marian_config(directory)
    generation = read_generation(directory, shape)
    tensors = read_weights(directory)
    tokenizer = read_tokenizer(directory)
    _check_vocabularies(shape, tokenizer, directory)
    prefix = check_target_language(tokenizer, target_language, directory)
    if prefix is not None:  # the token MarianTokenizer reads first, put there by the source tokenizer's file
        tokenizer = replace(tokenizer, tokenizers=with_source_prefix(tokenizer.tokenizers, *prefix))
    src_order, tgt_order = tokenizer.source.order, tokenizer.target.order
    state, share, output_bias = our_state_dict(tensors, directory / WEIGHTS_FILE, shape, torch.tensor(src_order),
                                               torch.tensor(tgt_order))
    ours = {their: our for our, their in enumerate(tgt_order)}  # their target id -> ours
    outside = [token_id for token_id in (shape.decoder_start_id, *generation.never_generate) if token_id not in ours]
    if outside:
        raise UserError(f"{directory}: the token id {outside[0]} (a start or never-generated token) is not in the "
                        f"target vocabulary of {tokenizer.target.size} tokens; the files do not belong together")
    try:
        model_config = ModelConfig(
            d_model=shape.d_model, n_heads=shape.n_heads, n_encoder_layers=shape.n_encoder_layers,
            n_decoder_layers=shape.n_decoder_layers, d_ff=shape.d_ff, dropout=shape.dropout, pre_norm=False,
            share_embeddings=share, tie_output=not share and shape.tied_output, max_len=shape.max_len, activation=shape.activation, output_bias=output_bias,
            decoder_start_id=ours[shape.decoder_start_id],
            never_generate=tuple(sorted(ours[token_id] for token_id in generation.never_generate)))
    except ConfigError as error:
        raise UserError(f"{directory / CONFIG_FILE}: not a model this project can build ({error})") from None
    model = Transformer(model_config, tokenizer.source.size, tokenizer.target.size)
    model.load_state_dict(state, strict=True)
    config = _run_config(run_dir, model_config, tokenizer, generation.num_beams)
    record = _record(found, tokenizer, prefix, target_language)
    log.info("importing %s: %d+%d layers, d_model %d, %s, vocabulary %d%s", source, shape.n_encoder_layers,
             shape.n_decoder_layers, shape.d_model, shape.activation, tokenizer.target.size,
             f", target language {target_language}" if target_language else "")
    _write_run(run_dir, model, tokenizer, config, record, _header(found))
    return Path(run_dir)


def _check_vocabularies(shape: MarianShape, tokenizer: ImportedTokenizer, directory: Path) -> None:
    """The tokenizer's vocabularies must be the model's: their sizes, and the padding and end ids config.json
    gives (theirs)."""
    sizes = (tokenizer.source.size, tokenizer.target.size)
    if sizes != (shape.src_vocab_size, shape.tgt_vocab_size):
        raise UserError(f"{directory}: the tokenizer's vocabularies have {sizes[0]} and {sizes[1]} tokens (source, "
                        f"target) but {CONFIG_FILE} {shape.src_vocab_size} and {shape.tgt_vocab_size}; the files do "
                        "not belong together")
    if shape.shared_embeddings and tokenizer.source.tokens != tokenizer.target.tokens:
        raise UserError(f"{directory / CONFIG_FILE}: share_encoder_decoder_embeddings is true, but the tokenizer "
                        "has two different vocabularies; the files do not belong together")
    for key, theirs, token_id in (("pad_token_id", shape.pad_id, tokenizer.target.pad),
                                  ("eos_token_id", shape.eos_id, tokenizer.target.eos)):
        if theirs != token_id:
            raise UserError(f"{directory / CONFIG_FILE}: {key} is {theirs}, but the tokenizer's target vocabulary "
                            f"has that token at {token_id}; the files do not belong together")


def _run_config(run_dir: Path, model: ModelConfig, tokenizer: ImportedTokenizer, num_beams: int | None) -> Config:
    """The config.yaml of the imported run: model and tokenizer say what the model is; decode takes the
    model's beam size; data, filter and train are our defaults (a fine-tuning config gives its own), with
    training lengths within the model's position table."""
    name = Path(run_dir).resolve().name
    decode = DecodeConfig()
    if num_beams is not None:
        try:
            decode = DecodeConfig(beam_size=num_beams)
        except ConfigError:
            log.warning("the model's num_beams %d is beyond what this project searches; decode.beam_size stays %d",
                        num_beams, decode.beam_size)
    data = DataConfig()
    data = replace(data, max_length=min(data.max_length, model.max_len - 1))
    return Config(name=name if name not in ("", ".", "..") else "imported", data=data,
                  # joint: one vocabulary for both sides (two SentencePiece models may still read them)
                  tokenizer=TokenizerConfig(joint=tokenizer.one_vocabulary,
                                            vocab_size=max(tokenizer.target.size, 16)),
                  model=model, train=TrainConfig(max_minutes=_TRAIN_MINUTES), decode=decode)


def _record(found: ModelSource, tokenizer: ImportedTokenizer, prefix: tuple[str, int] | None,
            target_language: str | None) -> dict[str, Any]:
    return {"format": IMPORT_FORMAT, "version": IMPORT_VERSION, **found.record(), "tokenizer": tokenizer.kind,
            "target_language": target_language, "source_prefix": None if prefix is None else prefix[0],
            # What the ids of the run are: vocabulary.py's permutation of each side, given by its special ids.
            "id_order": {"rule": ORDER_RULE, "source": _specials(tokenizer.source),
                         "target": _specials(tokenizer.target)}}


# How a side's ids were permuted (vocabulary.id_order), as the record says it.
ORDER_RULE = ("our id i is the model's id order[i]: its pad 0, its unk 1, its bos (else its lowest other id) 2, "
              "its eos 3, then its other ids in increasing order")


def _specials(side: Vocabulary) -> dict[str, int | None]:
    """The model's ids of a side's special tokens, which give its permutation (ORDER_RULE)."""
    bos = side.order[BOS_ID]
    return {"pad": side.pad, "unk": side.order[UNK_ID], "eos": side.eos,
            "bos": bos if side.tokens[bos] == BOS else None}


def _header(found: ModelSource) -> str:
    revision = f" at revision {found.revision}" if found.revision else ""
    return (f"# Imported from {found.given}{revision} ({found.directory.resolve()}); its files are recorded in "
            "imported.json.\n# model and tokenizer say what that model is; data, filter and train are defaults, "
            "which a\n# fine-tuning config (train.init_from) replaces.\n")


def _write_run(run_dir: Path, model: Transformer, tokenizer: ImportedTokenizer, config: Config,
               record: dict[str, Any], header: str) -> None:
    """The run, written whole: its config, tokenizer, one checkpoint (which `best` names), state and record."""
    name = step_dir_name(_STEP)
    try:
        with RunDirectory.written_whole(run_dir) as run:
            run.create()
            run.write_config(header + config_to_yaml(config))
            run.replace_tokenizer(lambda directory: save_tokenizers(tokenizer.tokenizers, directory))
            meta = {"step": _STEP, "metrics": {}, "config_name": config.name,
                    "tokenizer_fingerprint": tokenizer_fingerprint(run.tokenizer_dir),
                    "imported_from": {"source": record["source"], "revision": record["revision"]}}
            run.publish_checkpoint(_STEP, lambda directory: write_checkpoint(directory, model, None, meta))
            run.write_import_record(record)
            run.commit_state(RunState(latest=name, kept=[name], best=Best(name, _STEP, {})))
    except (OSError, CheckpointError) as error:
        reason = write_failure_reason(error)
        if reason is None:
            raise
        raise CheckpointError(f"cannot write the run {run_dir}: {reason}; nothing was written") from None


__all__ = ["IMPORT_FORMAT", "IMPORT_VERSION", "import_model"]
