"""Importing a model trained elsewhere as a run of ours (import_model.py). source.py finds its files (a
local transformers directory or the Hub's cache); marian.py checks a MarianMT config, marian_weights.py
maps its weights onto our model; vocabulary.py permutes a foreign vocabulary's ids into ours (PAD 0,
UNK 1, BOS 2, EOS 3, data/tokenizer.py's constants); sentencepiece_unigram.py converts a SentencePiece
unigram model into a `tokenizers` tokenizer that gives those ids, marian_tokenizer.py reads OPUS-MT's
tokenizer files with both, and tokenizer_files.py chooses between those and a tokenizer.json;
imported_run.py writes the run through the run directory's writer. An imported run then translates,
serves, fine-tunes and exports as any run.
"""
