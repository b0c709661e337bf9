"""Export a trained run for deployment: ctranslate2.py writes a self-contained CTranslate2 directory
(and refuses any destination that holds anything but an earlier export, or lies in a run); run_cache.py
keeps the export translate.py's CTranslate2 engine uses inside the run. Translating with an export is
translation/'s job (ct2_engine.py), which never imports this package.
"""
