"""Errors a user can cause and fix (bad config, bad data, missing run). The CLIs print
these as one clear message and exit with code 2; anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Base class: a problem in the user's input, not in the code."""


class ConfigError(UserError):
    """The YAML config or a --set override is invalid."""


class DataError(UserError):
    """The training data file cannot be read as sentence pairs."""


class CheckpointError(UserError):
    """A run directory or checkpoint is missing, corrupt or does not match."""


class ExportCacheError(CheckpointError):
    """The CTranslate2 export a run keeps of a checkpoint could not be written there (no permission, a
    full disk): a caller that can translate without it (the torch engine) may."""
