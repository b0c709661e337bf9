"""A Transformer translation model (Vaswani et al., 2017), shipped for English to French: config, data,
model, training, decoding."""

__version__ = "0.1.0"
