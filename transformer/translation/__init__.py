"""Translation: the one text path every engine shares (texts.py), the tensor searches (search.py; the
model's side of each step in step_decoder.py; which method runs is decoding.py's table, which search
runs it the engine's), terminology (phrases.py reads the phrases an output must contain or avoid, forms.py
the ways BPE may write one, glossary.py a glossary of terms, constrained.py searches held to them, building on
search.py), the
engines (torch_engine.py, ct2_engine.py; ct2_format.py says what a CTranslate2 export is), attention
maps and their pictures, int8 quantization, BLEU/chrF, translating streams of lines (lines.py), and one
translation seen from the inside for a learner (explain_report.py, translate.py --explain's report: the
model's stages, the search step by step, recorded by trace.py).
No training and no exporting here: this package imports nothing from training/ or export/.
"""
