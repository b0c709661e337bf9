"""A Transformer translation model (Vaswani et al., 2017), shipped for English to French. The folders
follow the pipeline, and a lower stage never imports a higher one: config/, errors.py, files.py
(atomic writes), runtime.py (devices, precision) → data/ → model.py → checkpoints/ (the run
directory) → translation/ → training/ (whose validation translates) → export/ → serving/
(the HTTP API and web page). One leaf of data/ sits below config/: data/formats/__init__.py, what each
format's reader reads, which imports nothing and which the config checks a corpus's keys against."""

__version__ = "0.1.0"
