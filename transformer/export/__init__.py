"""Export a trained run for deployment. destination.py is what every format shares (the checkpoint
pinned while read, which destinations are refused, the leftovers of a killed export, the rename into
place); ctranslate2.py maps our weights to a self-contained CTranslate2 directory, huggingface.py to
transformers' own Marian/Pegasus classes, with hf_tokenizer.py and model_card.py beside it;
run_cache.py keeps the export translate.py's CTranslate2 engine uses inside the run. Translating with
an export is translation/'s job (ct2_engine.py), which never imports this package.
"""
