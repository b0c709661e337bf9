"""An English-to-French Transformer (Vaswani et al., 2017): config, data, model, training, decoding."""

__version__ = "0.1.0"
