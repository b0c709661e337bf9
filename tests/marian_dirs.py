"""Tiny MarianMT directories built offline, laid out as OPUS-MT ships them: the importer's test input.

`build_marian_dir` trains two SentencePiece unigram models (source.spm on the English side, target.spm on
the French side of data/eng_-french.csv), builds Marian's vocabulary from them and saves a randomly
initialised MarianMTModel with transformers' own `save_pretrained`, beside MarianTokenizer's files. Nothing
is downloaded; the same arguments give the same bytes.
"""

from __future__ import annotations

import csv
import functools
import io
import json
from collections import Counter
from pathlib import Path

DATA_CSV = Path(__file__).resolve().parent.parent / "data" / "eng_-french.csv"
SOURCE_COLUMN, TARGET_COLUMN = "English words/sentences", "French words/sentences"
# Every 40th pair of the CSV (about 4,100): the file is sorted by length, so a stride gives short and long
# sentences alike, and the pairs in between are text the SentencePiece models never saw.
TRAINING_STRIDE = 40

# Marian's special pieces, as OPUS-MT's vocab.yml and transformers' convert_marian_to_pytorch lay them out:
# "</s>" 0, "<unk>" 1, the pieces, "<pad>" appended last. There is no "<s>": the decoder starts from <pad>.
EOS_PIECE, UNK_PIECE, PAD_PIECE = "</s>", "<unk>", "<pad>"


@functools.lru_cache(maxsize=1)
def csv_pairs() -> tuple[tuple[str, str], ...]:
    """Every (English, French) pair of data/eng_-french.csv, in file order."""
    with DATA_CSV.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        return tuple((row[SOURCE_COLUMN], row[TARGET_COLUMN]) for row in reader)


def training_pairs() -> tuple[tuple[str, str], ...]:
    """The pairs the SentencePiece models are trained on."""
    return csv_pairs()[::TRAINING_STRIDE]


def unseen_pairs(count: int) -> list[tuple[str, str]]:
    """`count` pairs spread over the CSV that are not among `training_pairs`."""
    others = [pair for i, pair in enumerate(csv_pairs()) if i % TRAINING_STRIDE]
    step = max(1, len(others) // count)
    return others[::step][:count]


@functools.lru_cache(maxsize=8)
def _train_spm(side: int, vocab_size: int) -> bytes:
    """A SentencePiece unigram model of one side's training texts, as spm_train writes it.

    One thread, the input in file order and not sampled: the same bytes every time. The defaults that
    OPUS-MT's models keep are kept too: the nmt_nfkc normaliser (a precompiled character map), a dummy
    prefix, extra whitespace removed, character_coverage 0.9995 (so that rare characters are <unk>).
    """
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([pair[side] for pair in training_pairs()]), model_writer=model,
        model_type="unigram", vocab_size=vocab_size, num_threads=1, input_sentence_size=0,
        shuffle_input_sentence=False, minloglevel=2)
    return model.getvalue()


def _normal_pieces(processor) -> list[str]:
    """The pieces of a SentencePiece model that text is segmented into (not <unk>, <s>, </s>), in model order."""
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())
            if not (processor.is_unknown(i) or processor.is_control(i) or processor.is_unused(i))]


def _marian_vocabulary(processors_and_texts: list[tuple[object, list[str]]], language_codes: tuple[str, ...] = ()
                       ) -> dict[str, int]:
    """Marian's vocabulary of these SentencePiece models: "</s>" 0, "<unk>" 1, then a multi-target model's
    target-language tokens (">>fra<<" for each code of `language_codes`: one starts every source line of its
    training corpus, so they are among the most frequent), then the pieces, most frequent in the encoded texts
    first (Marian builds its vocab.yml from the encoded corpus), then "<pad>".

    Every piece of every model is in it, used or not, so that MarianTokenizer never maps a piece of its own
    model to <unk>.
    """
    counts: Counter[str] = Counter()
    order: dict[str, int] = {}
    for processor, texts in processors_and_texts:
        for piece in _normal_pieces(processor):
            order.setdefault(piece, len(order))
        for pieces in processor.encode(texts, out_type=str):
            counts.update(pieces)
    pieces = sorted(order, key=lambda piece: (-counts[piece], order[piece]))
    vocabulary = {EOS_PIECE: 0, UNK_PIECE: 1}
    for piece in [f">>{code}<<" for code in language_codes] + pieces:
        vocabulary[piece] = len(vocabulary)
    vocabulary[PAD_PIECE] = len(vocabulary)
    return vocabulary


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_tokenizer_files(dest: Path, *, separate_vocabs: bool = False, vocab_size: int = 600,
                          language_codes: tuple[str, ...] = ()) -> tuple[dict[str, int], dict[str, int]]:
    """MarianTokenizer's files of `build_marian_dir`'s directory (source.spm, target.spm, vocab.json, with
    `separate_vocabs` target_vocab.json, tokenizer_config.json) written into `dest` (created), without the
    model; returns the source and target vocabularies (one dict twice when joint). `language_codes`: a
    multi-target model's, each a token ">>code<<" in every vocabulary (not in the SentencePiece models:
    MarianTokenizer takes the code off a text before SentencePiece reads it)."""
    import sentencepiece

    dest.mkdir(parents=True, exist_ok=True)
    spm_bytes = [_train_spm(side, vocab_size) for side in (0, 1)]
    (dest / "source.spm").write_bytes(spm_bytes[0])
    (dest / "target.spm").write_bytes(spm_bytes[1])
    processors = [sentencepiece.SentencePieceProcessor(model_proto=model) for model in spm_bytes]
    side_texts = [[pair[side] for pair in training_pairs()] for side in (0, 1)]
    if separate_vocabs:
        source_vocab = _marian_vocabulary([(processors[0], side_texts[0])], language_codes)
        target_vocab = _marian_vocabulary([(processors[1], side_texts[1])], language_codes)
        if len(source_vocab) != len(target_vocab):  # one <pad> id serves both embeddings
            raise ValueError(f"source and target vocabularies differ in size: {len(source_vocab)} and "
                             f"{len(target_vocab)}")
        _write_json(dest / "vocab.json", source_vocab)
        _write_json(dest / "target_vocab.json", target_vocab)
    else:
        source_vocab = target_vocab = _marian_vocabulary(list(zip(processors, side_texts)), language_codes)
        _write_json(dest / "vocab.json", source_vocab)
    # As convert_marian_to_pytorch's save_tokenizer_config writes it.
    _write_json(dest / "tokenizer_config.json", {"source_lang": "en", "target_lang": "fr",
                                                 "separate_vocabs": separate_vocabs})
    return source_vocab, target_vocab


def build_marian_dir(dest: Path, *, separate_vocabs: bool = False, seed: int = 0, vocab_size: int = 600,
                     d_model: int = 32, layers: int = 2, heads: int = 2, ffn: int = 64,
                     activation: str = "swish", max_positions: int = 128, language_codes: tuple[str, ...] = (),
                     init_std: float = 0.3) -> Path:
    """Write a MarianMT directory at `dest` (created) and return it.

    `vocab_size` is each SentencePiece model's size. One vocab.json for both sides (the union of both
    models' pieces; embeddings shared by encoder, decoder and output, as opus-mt-en-fr), or with
    `separate_vocabs` vocab.json for the source and target_vocab.json for the target, each its own model's
    pieces and of equal size (encoder and decoder embeddings apart, the output tied to the decoder's, as the
    newer OPUS-MT models lay them out). Random weights from `seed` (normal with `init_std`; MarianConfig's
    own default, 0.02, gives a model that learns faster from scratch), with a non-zero final_logits_bias and
    the <pad> embedding row zero, as OPUS-MT's converted models have. `language_codes` make it a multi-target
    model (opus-mt-en-ROMANCE's kind): a token ">>code<<" for each in the vocabularies, which MarianTokenizer
    reads at the start of a source text.
    """
    import torch
    import transformers

    dest = Path(dest)
    source_vocab, target_vocab = write_tokenizer_files(dest, separate_vocabs=separate_vocabs, vocab_size=vocab_size,
                                                       language_codes=language_codes)
    size = len(source_vocab)
    pad_id = size - 1
    config = transformers.MarianConfig(
        vocab_size=size, decoder_vocab_size=len(target_vocab), share_encoder_decoder_embeddings=not separate_vocabs,
        d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
        activation_function=activation, max_position_embeddings=max_positions, scale_embedding=True,
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, init_std=init_std,
        # OPUS-MT's config.json as convert_marian_to_pytorch writes it: bos_token_id 0 is </s>, never used.
        pad_token_id=pad_id, eos_token_id=0, forced_eos_token_id=0, bos_token_id=0, decoder_start_token_id=pad_id,
        tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.MarianMTModel(config)
        with torch.no_grad():
            # Marian's final_logits_bias (decoder_ff_logit_out_b) is trained; zero would hide a missing bias.
            model.final_logits_bias.normal_(0.0, 1.0)
            model.final_logits_bias[0, pad_id] = 0.0  # the row convert_marian_to_pytorch appends for <pad>
            for embedding in {model.model.encoder.embed_tokens, model.model.decoder.embed_tokens}:
                embedding.weight[pad_id] = 0.0  # also appended, as zeros
    model.eval()
    model.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[pad_id]], bos_token_id=0, decoder_start_token_id=pad_id, eos_token_id=0,
        forced_eos_token_id=0, max_length=max_positions, num_beams=4, pad_token_id=pad_id,
        renormalize_logits=True)
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def load_marian(directory: Path):
    """(MarianMTModel, MarianTokenizer) read back from a directory `build_marian_dir` wrote."""
    import transformers

    model = transformers.MarianMTModel.from_pretrained(directory)
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    return model.eval(), tokenizer
