"""The ``data`` group of a run resolved once: its token sources, each prepared directory's manifest (read and checked
once), the tokenizer (found and loaded once) and the end-of-document id. The data rules
(``lightning_mgpu.cli.data_rules``), the model's ``eod_token_id``, the data module and the sample after training all
read this one :class:`RunData` instead of working the tokenizer or the manifests out again."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from lightning_mgpu.cli.model_source import model_source
from lightning_mgpu.data.manifest import Manifest, PreparedDataError, is_prepared, read_manifest


@dataclass(frozen=True)
class PreparedSource:
    """One token source that is a directory written by ``mgpu-prepare`` (or the token file inside one)."""

    path: str
    manifest: Optional[Manifest]  #: None when it cannot be read
    error: Optional[str] = None  #: why the manifest cannot be read (or does not match its token file)


@dataclass(frozen=True)
class RunTokenizer:
    """The run's tokenizer as found and loaded once: what the data rules, the model and the data module need."""

    path: Path
    name: str  #: how messages name it, e.g. ``data.tokenizer='/tok'``
    vocab_size: Optional[int] = None  #: None when the file cannot be loaded (``error`` says why)
    sha256: Optional[str] = None
    eod: Optional[tuple[str, int]] = None  #: (token, id) that ends a document; None when it has none
    eod_error: Optional[str] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class RunData:
    """What a run's tokens are: ``source`` (corpus | text | tokens), its token sources and what they record."""

    source: str
    sources: tuple[tuple[str, float], ...]  #: ``data.sources`` as (path, weight); empty without a blend
    token_paths: tuple[str, ...]  #: the token sources of ``data=tokens``: each of ``data.sources``, or ``data.path``
    prepared: tuple[PreparedSource, ...]  #: the prepared ones among ``token_paths``, in their order
    tokenizer: Optional[RunTokenizer]  #: None: byte tokens
    #: the prepared tokens' tokenizer, when the run has none because that file moved or changed (its ids are then
    #: not bytes, and decoding them as bytes would print noise)
    lost_tokenizer: Optional[str]

    @property
    def tokenizer_path(self) -> Optional[Path]:
        return None if self.tokenizer is None else self.tokenizer.path

    def readable_manifests(self) -> list[tuple[str, Manifest]]:
        """(path, manifest) of every prepared source whose manifest could be read."""
        return [(s.path, s.manifest) for s in self.prepared if s.manifest is not None]

    def eod_token_id(self) -> tuple[Optional[int], str]:
        """(the id that ends every document in the run's tokens, where it comes from), or (None, why there is none).

        The first prepared source's manifest records the id mgpu-prepare appended (every prepared source of a run
        must have the same one: ``document_mask_problems``); otherwise the tokenizer's end-of-document token, which
        the data modules' own preparation of ``data=corpus``/``data=text`` appends (for a flat token file it is
        taken on trust). Byte tokens mark no document ends."""
        if self.prepared:
            first = self.prepared[0]
            if first.manifest is None:
                return None, first.error
            return first.manifest.eod_id, f"the manifest of {first.path} ({first.manifest.eod_token!r})"
        if self.tokenizer is None:
            if self.source == "tokens":
                return None, "a flat token file records no end-of-document id and no tokenizer is given"
            return None, f"data.source={self.source} without a tokenizer gives byte tokens, which mark no document ends"
        if self.tokenizer.eod is None:
            return None, f"{self.tokenizer.name}: {self.tokenizer.error or self.tokenizer.eod_error}"
        token, eod = self.tokenizer.eod
        return eod, f"{self.tokenizer.name} ({token!r})"


def unread_data(cfg: DictConfig) -> RunData:
    """The data of a run that reads none (``mgpu-plan`` without document masks: the model's shape needs nothing from
    the data, whose files may not even be on the machine that plans)."""
    return RunData(cfg.data.source, (), (), (), None, None)


def resolve_data(cfg: DictConfig) -> RunData:
    """The ``data`` group of ``cfg`` resolved: every manifest read once, the tokenizer found and loaded once."""
    sources = _blend(cfg)
    paths: tuple[str, ...] = ()
    if cfg.data.source in ("tokens", "sft"):
        named = tuple(str(p) for p, _ in sources if p and p != "???")  # a source without a path is refused
        paths = named if sources else (str(cfg.data.path),) if cfg.data.path else ()
    prepared = tuple(_prepared(path) for path in paths if is_prepared(path))
    found = _find_tokenizer(cfg, prepared)
    lost = None
    if found is None and prepared:
        lost = prepared[0].manifest.tokenizer_path if prepared[0].manifest is not None else None
    return RunData(cfg.data.source, sources, paths, prepared, None if found is None else _load_tokenizer(*found), lost)


def _blend(cfg: DictConfig) -> tuple[tuple[str, float], ...]:
    """``data.sources`` as (path, weight) pairs (a source without a weight weighs 1)."""
    sources = cfg.data.get("sources")  # .get: a schema without the key reads as none
    if not sources:
        return ()
    items = OmegaConf.to_container(sources, resolve=True)
    return tuple((s.get("path"), s.get("weight", 1.0)) if isinstance(s, dict) else (s, 1.0) for s in items)


def _prepared(path: str) -> PreparedSource:
    try:
        return PreparedSource(path, read_manifest(path))
    except PreparedDataError as err:
        return PreparedSource(path, None, str(err))


def _find_tokenizer(cfg: DictConfig, prepared: tuple[PreparedSource, ...]) -> Optional[tuple[Path, str]]:
    """(tokenizer path, how to name it) of a run, or None for byte tokens: ``data.tokenizer``; else the
    ``tokenizer.json`` beside the weights of ``model.path`` (``model=hf``) or ``model.init_from``; else the tokenizer the first prepared source was made
    with, where that file is still there unchanged."""
    explicit = cfg.data.get("tokenizer")
    if explicit:
        return Path(explicit), f"data.tokenizer={explicit!r}"
    directory = model_source(cfg).weights_directory()
    if directory is not None:
        from lightning_mgpu.data.tokenizer import TOKENIZER_FILE

        key, path = directory
        beside = path / TOKENIZER_FILE
        if beside.is_file():
            return beside, f"the tokenizer of {key} ({beside})"
    if not prepared or prepared[0].manifest is None:
        return None  # without a readable manifest, validation names what is wrong with it
    from lightning_mgpu.data.tokenizer import file_sha256

    first = prepared[0]
    recorded = Path(first.manifest.tokenizer_path)
    if recorded.is_file() and file_sha256(recorded) == first.manifest.tokenizer_sha256:
        return recorded, f"the tokenizer {first.path} was prepared with ({recorded})"
    return None


def _load_tokenizer(path: Path, name: str) -> RunTokenizer:
    from lightning_mgpu.data.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer(path)
        facts = dict(vocab_size=tok.vocab_size, sha256=tok.sha256)
    except TokenizerError as err:
        return RunTokenizer(path, name, error=str(err))
    try:
        return RunTokenizer(path, name, eod=tok.eod_token(), **facts)
    except TokenizerError as err:
        return RunTokenizer(path, name, eod_error=str(err), **facts)
