"""Data: from a corpus file to batches of subword ids. prepare.py is the stage's one entry (training
calls `prepare` once). In the order it runs: formats/ holds the readers of the data formats (CSV/TSV,
two text files, Parquet, JSON lines, save_to_disk folders, the Hub), one module each, and the table
that picks one by data.format; corpus.py cleans with text.py's one cleaning and drops unusable rows;
split.py holds out whole groups of pairs that share a sentence; tokenizer.py trains, saves and loads
the BPE tokenizers; encode.py encodes the pairs and writes the training ids as token files
(token_files.py); batching.py builds length-bucketed token-budget batches, dropout.py their
BPE-dropout. rows.py reads datasets' cached tables through masks of ours; cache.py keys the cache by
content and writes its entries whole. No model, no training and no run directory here: data/ imports
neither training/ nor checkpoints/."""
