"""Which engine translates, and loading it: the one policy that translate.py and serve.py share.
CTranslate2 by default (the faster), translating the export a run keeps of its checkpoint, written on
first use; the torch engine where CTranslate2 is not installed, cannot do what is asked (what only it
does, or a decoding method whose decoding.Strategy it alone runs), or the export cannot be written, with
a note saying why. A request's decode options are checked against its run's settings before any model
loads. It joins translation/ and export/, so it lives above both. Messages and notes mark the options
they name (errors.option): the caller names them. No torch is imported until the torch engine loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from transformer.checkpoints.layout import STATE_FILE
from transformer.checkpoints.lookup import find_checkpoint, load_decode_config, run_dir_of
from transformer.config import DecodeConfig
from transformer.decoding import DecodeOptions, RunDecodeSettings, Sampling, Strategy, traced_strategy
from transformer.errors import EngineUnavailableError, ExportCacheError, UserError, option
from transformer.hardware import cpu_flags, parse_device
from transformer.translation.ct2_format import INSTALL_HINT, read_export_info

ENGINES = ("auto", "ctranslate2", "torch")


def int8_engine() -> str:
    """The engine of int8 under engine auto on a CPU: the one whose int8 translated faster on such
    a CPU in bench/engines.py. With AVX-512 VNNI instructions that is the torch engine's dynamic
    quantization (far ahead of CTranslate2's int8 there); on CPUs without them (AVX2 only) the two are
    close and CTranslate2's is ahead at the default batch size. (On a GPU it is always CTranslate2: the
    torch engine's int8 runs on the CPU only.)"""
    return "torch" if "avx512_vnni" in cpu_flags() else "ctranslate2"


@dataclass(frozen=True)
class EngineRequest:
    """What a translation asks of its engine, for choosing one and loading it; checked as it is made,
    but for its decode options, which `options` checks once the run's own settings are known."""

    engine: str = "auto"  # auto, ctranslate2 or torch
    run: Path | None = None  # the run (default: the newest under runs/)
    checkpoint: Path | None = None  # or a checkpoint, or a CTranslate2 export
    ensemble: tuple[Path, ...] = ()  # more runs searching with the first (torch engine)
    device: str = "auto"
    int8: bool = False
    bf16: bool = False  # torch engine
    attention: bool = False  # attention maps or alignments are read (torch engine)
    threads: int = 0  # 0: the engine's default
    n_best: int = 1  # candidates per text: at most the beam, or that many samples
    sampling: Sampling | None = None
    decode: dict[str, Any] = field(default_factory=dict)  # settings over the run's decode config (None: not given)
    scoring: bool = False  # scores given translations: no search, so no n-best and no note on searching
    explain: bool = False  # the search is traced step by step and the model's stages read (torch engine)
    constraints: tuple[str, ...] = ()  # target phrases every output must contain (decoding.DecodeOptions)
    avoid: tuple[str, ...] = ()  # target phrases no output may contain
    per_text_constraints: bool = False  # each text brings its own constraints too
    device_key: str = option("device")  # the device setting's name in errors

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.threads < 0:
            raise UserError(f"{option('threads')} must be 0 (the engine's default) or more, got {self.threads}")
        if self.ensemble and self.attention:
            raise UserError(f"{option('attention')} shows one model's attention: not with an ensemble "
                            f"({option('ensemble')})")
        if self.ensemble and self.explain:
            raise UserError(f"{option('explain')} shows one model's stages: not with an ensemble "
                            f"({option('ensemble')})")

    def options(self) -> DecodeOptions:
        """The decode options this request asks for: its run's decode settings with the request's own
        (decoding.DecodeOptions.over), read before any model loads or export is written; refused where
        the method they choose cannot do what the request asks."""
        options = DecodeOptions.over(self.run_settings(), self.sampling, _n_best(self), self.constraints, self.avoid,
                                     self.per_text_constraints, **self.decode)
        if self.explain:
            traced_strategy(options)
        return options

    def run_settings(self) -> RunDecodeSettings:
        """The decode settings of the run this request translates with: those a CTranslate2 export given
        as its checkpoint records, else its run's config."""
        info = None if self.checkpoint is None else read_export_info(self.checkpoint)
        if info is not None:
            return DecodeConfig(**info["decode"])
        return load_decode_config(run_dir_of(find_checkpoint(self.run, self.checkpoint)))

    def torch_only(self, strategy: Strategy | None = None) -> str | None:
        """Why this request, by the decoding method `strategy` when known, needs the torch engine (what
        CTranslate2 does not do), or None."""
        if strategy is not None and "ctranslate2" not in strategy.engines:
            return f"{option(strategy.chosen_by)}: {strategy.described or strategy.name} runs on the torch engine only"
        if self.ensemble:
            return f"{option('ensemble')}: an ensemble runs on the torch engine only"
        if self.attention:
            return f"{option('attention')} reads the model's attention, which only the torch engine returns"
        if self.explain:
            return f"{option('explain')} traces the search step by step, which only the torch engine can"
        if self.bf16:
            return f"{option('bf16')} is the torch engine's: CTranslate2 offers no bf16 on a CPU"
        return None


def choose_engine(request: EngineRequest, strategy: Strategy | None = None) -> tuple[str, str | None]:
    """The engine to translate with, and why it is not CTranslate2 when engine auto picks torch (for one
    note line; None: nothing to say). An explicit engine is kept as given, and refused where it cannot do
    what is asked (by the decoding method `strategy` too, when known)."""
    torch_only = request.torch_only(strategy)
    is_export = request.checkpoint is not None and read_export_info(request.checkpoint) is not None
    if request.engine != "auto":
        if request.engine == "ctranslate2" and torch_only:
            raise UserError(f"{torch_only}: leave out {option('engine')} ctranslate2")
        if request.engine == "torch" and is_export:
            raise UserError(f"{request.checkpoint}: a CTranslate2 export, not a checkpoint; add {option('engine')} ctranslate2")
        return request.engine, None
    if is_export:
        if torch_only:  # an export runs on CTranslate2 only
            raise UserError(f"{request.checkpoint}: a CTranslate2 export, but {torch_only}: give the run "
                            f"({option('run')}) or one of its checkpoints instead")
        return "ctranslate2", None
    if torch_only:
        return "torch", torch_only
    kind, index = parse_device(request.device, request.device_key)
    if kind == "mps":
        return "torch", f"{request.device_key} mps: CTranslate2 has no Apple MPS backend"
    try:
        import ctranslate2
    except ImportError:
        return "torch", f"CTranslate2 is not installed; install it with {INSTALL_HINT}"
    if kind == "cuda" and (index or 0) >= ctranslate2.get_cuda_device_count():
        return "torch", f"{request.device_key} {request.device}: CTranslate2 finds no such CUDA GPU here"
    on_cpu = kind == "cpu" or (kind == "auto" and ctranslate2.get_cuda_device_count() == 0)
    if request.int8 and on_cpu:
        return int8_engine(), None
    return "ctranslate2", None


def _load_ctranslate2(request: EngineRequest, auto: bool, options: DecodeOptions) -> tuple[Any, list[str]]:
    """The CTranslate2 translator of `request`, or (None, a note) when `auto` and the run's export cannot be
    written or written again (e.g. a run directory this user may only read) or CTranslate2 cannot run on
    the GPU it found: the torch engine can translate without it."""
    from transformer.export.run_cache import ctranslate2_model
    from transformer.translation.ct2_engine import load_ct2_translator

    try:
        model_dir, checkpoint = ctranslate2_model(request.run, request.checkpoint)  # exported on first use
    except ExportCacheError as error:
        if not auto:
            raise UserError(f"{error}; translate with {option('engine')} torch, which needs no export") from None
        return None, [f"engine: torch ({error})"]
    try:
        return load_ct2_translator(model_dir, checkpoint, device=request.device, int8=request.int8,
                                   threads=request.threads, device_key=request.device_key, options=options), []
    except EngineUnavailableError as error:
        if auto:
            return None, [f"engine: torch ({error})"]
        raise UserError(f"{error}; translate with {option('engine')} torch, or with {request.device_key} cpu") \
            from None


def _load_torch(request: EngineRequest, options: DecodeOptions) -> Any:
    from transformer.runtime import select_device, set_threads
    from transformer.translation.torch_engine import load_translator

    device = select_device(request.device, key=request.device_key)
    if request.int8 and device.type != "cpu":  # before the model loads
        raise UserError(f"{option('int8')} with the torch engine runs on the CPU only; add {request.device_key} cpu")
    set_threads(request.threads)
    return load_translator(request.run, request.checkpoint, device, int8=request.int8, bf16=request.bf16,
                           ensemble=list(request.ensemble), options=options)


def _n_best(request: EngineRequest) -> int:
    return 1 if request.scoring else request.n_best  # scoring searches for nothing


def _refuse_run_directory(request: EngineRequest) -> None:
    if request.checkpoint is not None and (request.checkpoint / STATE_FILE).is_file():
        raise UserError(f"{request.checkpoint}: a run directory, not a checkpoint: use {option('run')} "
                        f"{request.checkpoint}")


def load_engine(request: EngineRequest, engine: str, auto: bool, options: DecodeOptions | None = None
                ) -> tuple[Any, list[str]]:
    """The translator of `engine` (as choose_engine chose it) for `request`, and the notes to show. `auto`:
    engine auto chose it, and CTranslate2 then falls back to torch, with a note, when the run's export
    cannot be written. `options`: the request's decode options when already built (request.options());
    they reach the engine as they are."""
    options = request.options() if options is None else options
    notes: list[str] = []
    if engine == "ctranslate2":
        translator, notes = _load_ctranslate2(request, auto, options)
        if translator is not None:
            return translator, notes
    return _load_torch(request, options), notes


def open_engine(request: EngineRequest, notify: Callable[[str], None]) -> Any:
    """The translator the policy gives `request`: its decode options checked first (`request.options`,
    before any model loads), then choose_engine and load_engine. Each note goes to `notify` as soon as it
    is known (before a load that may fail): why the torch engine when engine auto chose it, and how
    CTranslate2 differs from the torch engine when it was asked for by name."""
    _refuse_run_directory(request)
    options = request.options()
    engine, why_torch = choose_engine(request, options.strategy)
    if why_torch:
        notify(f"engine: torch ({why_torch})")
    translator, notes = load_engine(request, engine, request.engine == "auto", options)
    if not request.scoring and request.engine == "ctranslate2":  # worth saying to whoever chose it, not to all
        from transformer.translation.ct2_engine import differences_from_torch

        notes += differences_from_torch(translator.decode, translator.patience)
    for note in notes:
        notify(note)
    return translator


def open_server_engines(request: EngineRequest) -> tuple[Any, Any, list[str]]:
    """serve.py's engines: the torch Translator, which alignment and sampling requests need, and the
    engine of plain requests, CTranslate2 where the policy chooses it (else that same Translator); and
    the notes to show."""
    options = request.options()
    translator = _load_torch(dataclasses.replace(request, engine="torch"), options)
    if request.engine == "torch":
        return translator, translator, []
    plain_request = dataclasses.replace(request, run=None, checkpoint=translator.checkpoint)
    engine, why_torch = choose_engine(plain_request)
    if engine == "torch":
        return translator, translator, [f"engine: torch ({why_torch})"] if why_torch else []
    plain, notes = _load_ctranslate2(plain_request, request.engine == "auto", options)
    if plain is None:
        return translator, translator, notes
    return translator, plain, ["engine: CTranslate2 for plain requests, torch for alignment and sampling requests"]


__all__ = ["ENGINES", "int8_engine", "EngineRequest", "choose_engine", "load_engine", "open_engine",
           "open_server_engines"]
