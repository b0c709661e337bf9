"""The CTranslate2 engine: CTranslate2's greedy search, beam search or sampling over batches of
source ids (`CT2_SEARCHES`: each method of decoding.STRATEGIES that it runs), optionally from target
prefixes, and its scoring of target ids, from a model exported by export/ (ct2_format.py says what an
export is). Text goes through texts.py, as with every engine. Imports no torch, so that `translate.py
--engine ctranslate2` starts without it; writing an export, when a run has none yet, is export/'s job and
not this module's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformer.checkpoints.lookup import load_decode_config, run_dir_of
from transformer.config import DecodeConfig
from transformer.data.tokenizer import BOS_ID, EOS, PAD_ID, Tokenizers, load_tokenizers
from transformer.decoding import DecodeOptions, Sampling
from transformer.errors import CheckpointError, ConfigError, EngineUnavailableError
from transformer.hardware import parse_device
from transformer.translation.ct2_format import EXPORT_TOKENIZER_DIR, import_ctranslate2, read_export_info
from transformer.translation.texts import gnmt_length_penalty, translate_texts

log = logging.getLogger(__name__)

# Beam search goes on until BEAM_PATIENCE x beam_size hypotheses have finished. With 2, CTranslate2 took
# about as many decoding steps as our exact stopping rule (2,712 against 2,685 on 135 test sentences of a
# tiny model trained 1,200 steps) and gave the same output on all 945 sentences tried; with 1 it stops
# sooner and missed one. Models that repeat a token until the length limit (a few training steps) are
# its worst case: with a length penalty, our search keeps going long after CTranslate2 has stopped.
BEAM_PATIENCE = 2.0

# Every search call: we truncate sources ourselves (texts.py); EOS may come first, as in ours. The ids
# the model never generates (model.never_generate) are suppressed, as step_decoder.StepDecoder does:
# CTranslate2Translator.search_options.
_OPTIONS = dict(max_input_length=0, min_decoding_length=0)


def _device(spec: str, ctranslate2: Any, key: str) -> tuple[str, int]:
    """CTranslate2's (device, device_index) for a device setting named `key`; it has no Apple MPS backend."""
    kind, index = parse_device(spec, key)
    if kind == "mps":
        raise ConfigError(f"{key}: CTranslate2 does not run on Apple's MPS; use auto or cpu")
    if kind == "cuda":
        count = ctranslate2.get_cuda_device_count()
        if not count:
            raise ConfigError(f"{key}: {spec!r} requested but CUDA is not available here; use auto or cpu")
        if index is not None and index >= count:
            raise ConfigError(f"{key}: {spec!r} requested but this machine has {count} GPU(s), numbered from 0")
    return kind, index or 0


def _check_it_runs(translator: Any) -> None:
    """One decoding step of one token, so that a GPU CTranslate2 finds but cannot use fails at load
    time, as an EngineUnavailableError, and not at the first batch of a file. Its wheels are built
    against one CUDA major version and load that version's cuBLAS at the first matrix product: on a
    machine with another, the GPU is counted and nothing runs."""
    try:
        translator.translate_batch([[EOS]], max_decoding_length=1, beam_size=1)
    except RuntimeError as error:
        raise EngineUnavailableError(f"CTranslate2 finds a GPU here but cannot run on it: {error}") from None


@dataclass
class CTranslate2Translator:
    """Translates like torch_engine.Translator, through CTranslate2.

    Greedy search gives the same tokens as search.greedy_search: CTranslate2 stops a greedy output at
    its length limit as ours does, so one call per batch with the batch's longest limit, each output
    cut to its own, is exact.

    Beam search follows search.beam_search where CTranslate2 lets it (see `_beam`): the same 2k
    candidates and beams ranked by log-probability, one length limit per call (batches are split by
    limit), and its finished hypotheses re-ranked with the GNMT penalty. Two things differ: our search
    stops by an exact bound on what an open beam can still score, CTranslate2 once `patience` x
    beam_size hypotheses have finished (see differences_from_torch); and at the length limit ours ends
    every open beam with EOS, which `_beam` rebuilds from the beams CTranslate2 cut there.
    """

    translator: Any  # ctranslate2.Translator
    tokenizers: Tokenizers
    decode: DecodeOptions  # a sampling seed among them is set when loading (CTranslate2's is process-wide)
    max_len: int
    model_dir: Path
    checkpoint: Path | None  # the checkpoint it was exported from, when known
    patience: float = BEAM_PATIENCE  # beam search goes on until patience x beam_size hypotheses have finished
    # The ids it never emits: the model_config.never_generate its export records (PAD and BOS in runs of
    # this project, and in exports written before the key existed).
    never_generate: tuple[int, ...] = (PAD_ID, BOS_ID)

    def __post_init__(self) -> None:
        source, target = self.tokenizers.source, self.tokenizers.target
        self._source_tokens = [source.id_to_token(i) for i in range(self.tokenizers.source_vocab_size)]
        self._target_tokens = [target.id_to_token(i) for i in range(self.tokenizers.target_vocab_size)]
        self._target_ids = target.get_vocab(with_added_tokens=True)
        # Every search call's options: _OPTIONS, and the never-generated tokens as CTranslate2 takes them (strings).
        self.search_options = dict(_OPTIONS,
                                   suppress_sequences=[[self._target_tokens[i]] for i in self.never_generate] or None)

    def translate(self, texts: list[str], n_best: int | None = None, prefixes: list[str] | None = None
                  ) -> list[list[str]]:
        """For each text, its `n_best` translations, best first (texts.translate_texts)."""
        return translate_texts(self, texts, n_best, prefixes=prefixes)

    def search(self, sources: list[list[int]], n_best: int, prefixes: list[list[int]] | None = None
               ) -> list[list[list[int]]]:
        """Source id lists (no EOS) -> for each, its hypotheses' target ids, best first (texts.Engine), by
        the method the decode options choose (CT2_SEARCHES), each starting with its prefix (CTranslate2's
        target_prefix) when `prefixes` are given. Beam search returns all it finished, at least `n_best`,
        and the text path keeps the first."""
        decode = self.decode
        tokens = [[self._source_tokens[i] for i in ids] for ids in sources]
        targets = None if prefixes is None else [[self._target_tokens[i] for i in ids] or None for ids in prefixes]
        limits = [decode.max_output_length(len(ids), self.max_len) for ids in sources]
        return CT2_SEARCHES[decode.strategy.name](self, tokens, targets, limits, n_best)

    def _greedy(self, tokens: list[list[str]], targets: list[list[str] | None] | None, limits: list[int],
                n_best: int) -> list[list[list[int]]]:
        """Greedy search of a batch: one call with its longest limit, each output cut to its own."""
        return self._token_by_token(tokens, targets, limits, {})

    def _sampling(self, tokens: list[list[str]], targets: list[list[str] | None] | None, limits: list[int],
                  n_best: int) -> list[list[list[int]]]:
        """`n_best` samples of each source, as greedy search is run."""
        s = self.decode.sampling
        # Our top_k at or above the vocabulary keeps every token, as CTranslate2's 0 does (it refuses
        # more); its top-k 1 is greedy search, which finds one hypothesis only.
        top_k = 0 if s.top_k >= len(self._target_tokens) else s.top_k
        copies = n_best if top_k == 1 else 1  # each output repeated: n-best draws of top-k 1 are greedy search's
        options = dict(num_hypotheses=n_best // copies, sampling_topk=top_k, sampling_topp=s.top_p,
                       sampling_temperature=s.temperature)
        return self._token_by_token(tokens, targets, limits, options, copies)

    def _token_by_token(self, tokens: list[list[str]], targets: list[list[str] | None] | None, limits: list[int],
                        options: dict[str, Any], copies: int = 1) -> list[list[list[int]]]:
        results = self.translator.translate_batch(tokens, targets, beam_size=1, max_decoding_length=max(limits),
                                                  **options, **self.search_options)
        return [[self._ids(hypothesis)[:limit] for hypothesis in result.hypotheses for _ in range(copies)]
                for result, limit in zip(results, limits)]

    def _beam_by_limit(self, tokens: list[list[str]], targets: list[list[str] | None] | None, limits: list[int],
                       n_best: int) -> list[list[list[int]]]:
        """Beam search of a batch, one call per output limit (`_beam`)."""
        outputs: list[list[list[int]]] = [[] for _ in tokens]
        groups: dict[int, list[int]] = {}
        for i, limit in enumerate(limits):
            groups.setdefault(limit, []).append(i)
        for limit, members in groups.items():
            group_targets = None if targets is None else [targets[i] for i in members]
            for i, output in zip(members, self._beam([tokens[i] for i in members], limit, group_targets)):
                outputs[i] = output
        return outputs

    def score(self, sources: list[list[int]], targets: list[list[int]]) -> list[list[float]]:
        """CTranslate2's score_batch: the log-probability of each target token and of its EOS, normalised
        over the whole vocabulary as torch_engine.Translator.score's (texts.Engine)."""
        results = self.translator.score_batch([[self._source_tokens[i] for i in ids] for ids in sources],
                                              [[self._target_tokens[i] for i in ids] for ids in targets],
                                              max_input_length=0)
        return [list(result.log_probs) for result in results]

    def _beam(self, tokens: list[list[str]], limit: int, prefixes: list[list[str]] | None = None
              ) -> list[list[list[int]]]:
        """Beam search of sources sharing one output limit: for each, its hypotheses best first.

        With return_end_token a hypothesis that finished shows its EOS. One without EOS was cut at the
        limit: CTranslate2 keeps the k best candidates of its last step as they are, where our search
        takes each of its k open beams one step further, to EOS. So each cut one, a beam of `limit`
        tokens, gets the log-probability of EOS after it (score_batch) and competes as beam + EOS.
        Those k candidates are our k beams unless some of them ended in EOS; then the beams that took
        their places (the next best candidates) are not seen: a rare, small gap.
        """
        k = self.decode.beam_size
        hypotheses_count = max(k, round(k * self.patience))
        results = self.translator.translate_batch(
            tokens, prefixes, beam_size=k, patience=hypotheses_count / k, num_hypotheses=hypotheses_count,
            length_penalty=0.0, return_scores=True, return_end_token=True, max_decoding_length=limit,
            **self.search_options)
        finished: list[list[tuple[float, list[str]]]] = [[] for _ in tokens]
        cut: list[tuple[int, float, list[str]]] = []
        for i, result in enumerate(results):
            for hypothesis, log_prob in zip(result.hypotheses, result.scores):
                if hypothesis and hypothesis[-1] == EOS:
                    finished[i].append((log_prob, hypothesis[:-1]))
                else:
                    cut.append((i, log_prob, hypothesis))
        if cut:
            # Its log-probabilities are normalised over every token, the never-generated ones too, unlike
            # the search's: only the EOS term is taken from it, the beam's own sum from the search.
            scored = self.translator.score_batch([tokens[i] for i, _, _ in cut], [beam for _, _, beam in cut],
                                                 max_input_length=0)
            for (i, log_prob, beam), scores in zip(cut, scored):
                finished[i].append((log_prob + scores.log_probs[-1], beam))
        alpha = self.decode.length_penalty
        return [[self._ids(hypothesis) for _, hypothesis in
                 sorted(sentence, key=lambda pair: -pair[0] / gnmt_length_penalty(len(pair[1]) + 1.0, alpha))]
                for sentence in finished]

    def _ids(self, hypothesis: list[str]) -> list[int]:
        return [self._target_ids[token] for token in hypothesis]


def differences_from_torch(options: DecodeOptions, patience: float = BEAM_PATIENCE) -> list[str]:
    """Where these settings cannot mean exactly what they mean with the torch engine, one line each.

    Greedy search is exact. So is the best of a beam search without length penalty: CTranslate2 then
    stops only once its best candidate has ended, and nothing after can score higher. With a penalty,
    or for the rest of an n-best list, the point where each search stops matters. Samples follow
    the same distribution, but not the same random numbers.
    """
    return _DIFFERENCES[options.strategy.name](options, patience)


def _beam_differences(options: DecodeOptions, patience: float) -> list[str]:
    if options.length_penalty == 0 and options.n_best == 1:
        return []
    return [f"the ctranslate2 engine stops beam search once {patience:g} x beam_size hypotheses have finished, "
            "not by the torch engine's exact bound, so a few beam outputs can differ"]


_SAMPLES_DIFFER = ("the ctranslate2 engine draws its samples with its own random number generator, so with the "
                   "same seed its samples differ from the torch engine's (they follow the same distribution)")

# decoding.STRATEGIES' methods as this engine runs them, by name, and where each differs from the torch engine's.
CT2_SEARCHES = {"greedy": CTranslate2Translator._greedy, "beam": CTranslate2Translator._beam_by_limit,
                "sampling": CTranslate2Translator._sampling}
_DIFFERENCES = {"greedy": lambda options, patience: [], "beam": _beam_differences,
                "sampling": lambda options, patience: [_SAMPLES_DIFFER]}


def load_ct2_translator(model_dir: Path, checkpoint: Path | None = None, device: str = "auto", int8: bool = False,
                        threads: int = 0, patience: float = BEAM_PATIENCE, device_key: str = "device",
                        sampling: Sampling | None = None, n_best: int = 1, options: DecodeOptions | None = None,
                        **decode_overrides: Any) -> CTranslate2Translator:
    """A CTranslate2 translator of the export in `model_dir`.

    `checkpoint`: the checkpoint it was exported from, whose run's decode config then applies (else the
    one the export recorded). `int8` runs CTranslate2's int8 weights (compute_type int8); `threads` > 0
    sets its intra-op threads; `patience` is beam search's (see BEAM_PATIENCE); `device_key` names the
    device setting in errors. The decode options are that decode config with `decode_overrides`,
    `sampling` and `n_best` (decoding.DecodeOptions.over), unless `options` gives them already built (the
    engine policy builds a request's options once, engines.EngineRequest.options); a sampling seed is set with
    ctranslate2.set_random_seed (one seed for the whole process, which is CTranslate2's only kind).
    """
    ctranslate2 = import_ctranslate2()
    device_kind, device_index = _device(device, ctranslate2, device_key)
    model_dir = Path(model_dir)
    info = read_export_info(model_dir)
    if info is None:
        raise CheckpointError(f"{model_dir}: holds no complete CTranslate2 export of this project")
    if options is None:
        settings = load_decode_config(run_dir_of(checkpoint)) if checkpoint is not None else DecodeConfig(**info["decode"])
        options = DecodeOptions.over(settings, sampling, n_best, **decode_overrides)
    decode = options
    try:
        translator = ctranslate2.Translator(str(model_dir), device=device_kind, device_index=device_index,
                                            compute_type="int8" if int8 else "default", intra_threads=threads)
    except (RuntimeError, ValueError) as error:
        raise CheckpointError(f"{model_dir}: CTranslate2 cannot load this export ({error})") from None
    if device_kind == "cuda" or (device_kind == "auto" and ctranslate2.get_cuda_device_count()):
        _check_it_runs(translator)
    tokenizers = load_tokenizers(model_dir / EXPORT_TOKENIZER_DIR)
    if decode.sampling is not None:
        ctranslate2.set_random_seed(decode.sampling.seed)
    log.info("translating with CTranslate2 from %s (step %s%s)", model_dir, info["checkpoint"].get("step"),
             ", int8" if int8 else "")
    # An export written before model_config held never_generate: this project's PAD and BOS, as then.
    never_generate = tuple(info.get("model_config", {}).get("never_generate", (PAD_ID, BOS_ID)))
    return CTranslate2Translator(translator, tokenizers, decode, int(info["max_len"]), model_dir, checkpoint,
                                 patience, never_generate)


__all__ = ["BEAM_PATIENCE", "CTranslate2Translator", "CT2_SEARCHES", "differences_from_torch", "load_ct2_translator"]
