"""Import a model trained elsewhere as a run of ours. vocabulary.py reads a foreign vocabulary and
permutes its ids into ours (PAD 0, UNK 1, BOS 2, EOS 3, data/tokenizer.py's constants);
sentencepiece_unigram.py converts a SentencePiece unigram model into a `tokenizers` tokenizer that gives
those ids; marian_tokenizer.py reads a MarianMT directory's tokenizer files (OPUS-MT's layout) with both.
Nothing here trains, translates or writes a run directory's checkpoints."""
