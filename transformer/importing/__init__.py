"""Importing a model trained elsewhere as a run of ours (import_model.py). source.py finds its files (a
local transformers directory or the Hub's cache), marian.py checks a MarianMT config and maps its weights
onto our model, tokenizer_files.py and vocabulary.py bring its tokenizer into our ids, imported_run.py
writes the run through the run directory's writer. Translating, serving, fine-tuning and exporting an
imported run is what they are for any run; nothing outside this package knows a run was imported.
"""
