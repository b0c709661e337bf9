"""Export a trained run for deployment: ctranslate2.py writes a self-contained CTranslate2 directory,
huggingface.py a directory that transformers' own Marian/Pegasus classes load; destination.py refuses
any destination that holds anything but an earlier export of that kind, or lies in a run, and publishes
an export in one rename; run_cache.py keeps the export translate.py's CTranslate2 engine uses inside the
run. Translating with an export is translation/'s job (ct2_engine.py), which never imports this package.
"""
