"""The config: a run's YAML, validated into typed, frozen sections. sections.py holds the sections,
each key's default and the rules joining keys (a value's own check is values.py's; which corpus keys
a data format reads, its reader declares in data/formats/__init__.py); loader.py reads YAML (the only
code that does) and `--set` overrides, and writes the mapping a run directory stores. Imports no
torch and no datasets.
"""

from transformer.config.loader import (config_from_dict, config_to_dict, config_to_yaml, load_config,
                                       model_config_from_dict)
from transformer.config.sections import (Config, CorpusConfig, DataConfig, DecodeConfig, FilterConfig, ModelConfig,
                                         TokenizerConfig, TrainConfig)
from transformer.errors import ConfigError  # noqa: F401 (importers name it here too)

__all__ = [
    "Config", "DataConfig", "CorpusConfig", "FilterConfig", "TokenizerConfig", "ModelConfig", "TrainConfig",
    "DecodeConfig", "load_config", "config_from_dict", "config_to_dict", "config_to_yaml", "model_config_from_dict",
]
