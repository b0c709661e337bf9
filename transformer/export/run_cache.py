"""The CTranslate2 model that `translate.py --engine ctranslate2` translates with: an export directory
given as such, or the export a run keeps of its best checkpoint in RUN/ctranslate2/<weights hash>/,
written there on first use, and written again, with a warning, when its files are no longer those it
recorded. No torch unless that export has to be written (ctranslate2.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformer.checkpoints.lookup import pinned_checkpoint, run_dir_of
from transformer.checkpoints.pins import pin
from transformer.checkpoints.rundir import RunDirectory
from transformer.errors import CheckpointError
from transformer.translation.ct2_format import (cached_export_dir, cached_export_damage, damaged_file,
                                                import_ctranslate2, read_export_info)

log = logging.getLogger(__name__)


def cached_run_export(checkpoint: Path) -> Path:
    """The run's export of `checkpoint` (RUN/ctranslate2/<weights hash>), exported there first if it is
    missing, of other weights, or damaged (a file not as its description recorded it: a full disk, a
    partial copy). Written beside and renamed into place, so a reader sees all of it. A run this user
    cannot write is an ExportCacheError (RunDirectory.publish_export)."""
    with pin(checkpoint) as checkpoint:  # a run still training may prune it meanwhile (pins.py)
        directory, digest = cached_export_dir(checkpoint)
        damage = cached_export_damage(directory, digest)
        if damage is not None:
            # The clearest error first, and before torch: imported after it, CTranslate2 would run on torch's
            # OpenMP runtime, several times slower (bench/one_process.py).
            import_ctranslate2()
            from transformer.export.ctranslate2 import write_export_files  # torch: only to write it

            if directory.exists():
                log.warning("%s: %s; exporting %s into it again", directory, damage, checkpoint)
            else:
                log.info("exporting %s for CTranslate2 into %s (once: later calls reuse it)", checkpoint, directory)
            RunDirectory(run_dir_of(checkpoint)).publish_export(directory.name,
                                                                lambda tmp: write_export_files(checkpoint, tmp))
    return directory


def ctranslate2_model(run: Path | None, checkpoint_dir: Path | None, runs_root: Path = Path("runs")
                      ) -> tuple[Path, Path | None]:
    """The export directory to translate with and the checkpoint it comes from: `checkpoint_dir` itself
    when it is an export (no checkpoint known), else the best checkpoint of `run` (default: the newest
    run under `runs_root`) or `checkpoint_dir`, through `cached_run_export`."""
    info = None if checkpoint_dir is None else read_export_info(checkpoint_dir)
    if info is not None:
        # Not this project's to write again: whoever exported it can.
        damage = damaged_file(checkpoint_dir, info)
        if damage is not None:
            raise CheckpointError(f"{checkpoint_dir}: a damaged CTranslate2 export ({damage}); export the "
                                  "checkpoint into it again")
        return Path(checkpoint_dir), None
    with pinned_checkpoint(run, checkpoint_dir, runs_root) as found:
        return cached_run_export(found), found


__all__ = ["cached_run_export", "ctranslate2_model"]
