"""Where an imported model's files are: a local transformers directory, or a Hub model that
huggingface_hub downloads into its cache as transformers does (offline: the cache alone), and what the
import records of them (the name given, the Hub revision, each file's size and SHA-256). What the files
say is marian.py's to read.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer.errors import UserError
from transformer.files import file_sha256

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
# Weights in a pickle, which loading would run as code: never read, only named in the refusal.
PICKLED_WEIGHTS = ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")
SHARDED_INDEX = "model.safetensors.index.json"
# What an import reads, the only files a Hub download fetches: the config, the generation settings, the
# weights, and either MarianTokenizer's files or a fast tokenizer's.
FILES = ("config.json", "generation_config.json", WEIGHTS_FILE, "source.spm", "target.spm", "vocab.json",
         "target_vocab.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")
# A Hub model id: a name, or an owner and a name (huggingface_hub's own rule is stricter; it names the rest).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


@dataclass(frozen=True)
class ModelSource:
    """The directory holding the model's files, and where it came from: `given` as the user named it,
    `hub_id` and `revision` (the snapshot's commit) for a Hub model, None for a local directory."""

    directory: Path
    given: str
    hub_id: str | None = None
    revision: str | None = None

    def record(self) -> dict[str, Any]:
        """What the imported run records of its source: the name given, the Hub id and commit, the
        directory read, and the size and SHA-256 of each file read from it."""
        files = {name: {"bytes": (self.directory / name).stat().st_size, "sha256": file_sha256(self.directory / name)}
                 for name in FILES if (self.directory / name).is_file()}
        return {"source": self.given, "hub_id": self.hub_id, "revision": self.revision,
                "directory": str(self.directory.resolve()), "files": files}


def open_source(source: str, revision: str | None = None) -> ModelSource:
    """The model `source` names: a local directory if one is there, else a Hub model id, downloaded
    into the Hub's cache (or found there, offline). `revision`: a Hub branch, tag or commit."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{source}: is a file; give the directory that holds the model's config.json and "
                            f"{WEIGHTS_FILE}")
        if revision is not None:
            raise UserError(f"{source}: a local directory has no revisions; a revision is for a Hub model id")
        return ModelSource(path, source)
    if not _HUB_ID.fullmatch(source) or ".." in source:
        raise UserError(f"{source}: no such directory (and not a Hub model id such as Helsinki-NLP/opus-mt-en-fr)")
    return _from_hub(source, revision)


def _silent_progress() -> type:
    """A tqdm class that draws nothing (the library prints nothing), for huggingface_hub's `tqdm_class`."""
    from tqdm.auto import tqdm

    class Silent(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    return Silent


def _from_hub(repo_id: str, revision: str | None) -> ModelSource:
    """Hub model `repo_id`'s files, downloaded into huggingface_hub's cache (HF_HUB_CACHE) or found there."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{repo_id}{f' (revision {revision})' if revision else ''}"
    log.info("%s: not a local directory; fetching it from the Hugging Face Hub (cache %s)", repo_id,
             constants.HF_HUB_CACHE)
    try:
        directory = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(FILES),
                                           tqdm_class=_silent_progress()))
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else "the Hub cannot be reached from here")
        raise UserError(f"{where}: no such local directory, and this Hub model is not in the cache "
                        f"({constants.HF_HUB_CACHE}, HF_HUB_CACHE) while {why}: download it where there is a "
                        "network (the same command, or huggingface-cli download), or give a local directory"
                        ) from None
    except GatedRepoError:
        raise UserError(f"{where}: a gated Hub model; accept its terms on the Hub and log in "
                        "(huggingface-cli login) first") from None
    except RevisionNotFoundError:
        raise UserError(f"{where}: the Hub model has no such revision") from None
    except RepositoryNotFoundError:
        raise UserError(f"{where}: no such local directory, and no such Hub model (or a private one: log in "
                        "with huggingface-cli login)") from None
    except HFValidationError as error:
        raise UserError(f"{repo_id}: no such local directory, and not a valid Hub model id ({error})") from None
    commit = directory.name if re.fullmatch(r"[0-9a-f]{40}", directory.name) else None
    return ModelSource(directory, repo_id, repo_id, commit)


__all__ = ["WEIGHTS_FILE", "PICKLED_WEIGHTS", "SHARDED_INDEX", "FILES", "ModelSource", "open_source"]
