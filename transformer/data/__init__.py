"""Data: from a CSV/TSV or two text files to batches of subword ids. readers.py reads the file with
exact line errors, text.py holds the one text cleaning (also used by translation), pairs.py loads,
filters, splits (leak-free) and encodes the pairs, tokenizer.py trains and saves the BPE
tokenizers, batching.py builds length-bucketed token-budget batches with their masks,
token_files.py keeps token ids and batch plans as files beside datasets' cache, read a batch at a time,
cache.py writes those entries (and the split's) whole and checks them against their manifest before use, and
arrow_stream.py reads that cache without mapping it. No model, no training and no run directory here."""
