"""Corpus, tokenizer and Megatron indexed dataset preparation.

One call, :func:`prepare_data`, turns a corpus into everything a GPT training run reads:

* ``tokenizer.model``: a sentencepiece BPE model trained on the corpus, with byte fallback (any
  text can be encoded) and an end-of-document (EOD) control piece;
* ``<name>_text_document.bin/.idx``: a Megatron indexed dataset, one sequence per document, each
  document's token ids followed by the EOD id;
* ``meta.json``: what went in (inputs, settings, file list) and what came out (counts, timings).

The default corpus is the source of the running interpreter's standard library: it is present
wherever Python is, and it is real code and prose. Users can pass their own ``.txt``/``.py``/...
files (one document each), ``.jsonl`` files (one document per line) or directories.

:func:`build_gpt_datasets` then wraps the indexed dataset in megatron-core's ``GPTDataset`` (train
and validation splits), whose items are dicts of ``tokens``/``labels``/``loss_mask``/
``position_ids`` tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import random
import shutil
import sys
import sysconfig
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy
import sentencepiece
from tqdm import tqdm

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.core.tokenizers import MegatronTokenizerBase

PathLike = str | os.PathLike

DEFAULT_VOCAB_SIZE = 8192
# Lines sampled (uniformly at random) to train the tokenizer. Of the stdlib corpus's ~740k
# non-blank lines, 300k train in ~6 s on 2 cores and compress as well as all of them (3.46
# characters per token either way at 8192 pieces), which take ~17 s.
DEFAULT_MAX_TRAINING_LINES = 300_000
DEFAULT_SEED = 1234

EOD_PIECE = "<|endoftext|>"
PAD_PIECE = "<pad>"
UNK_PIECE = "<unk>"
# unk, pad, EOD, the newline piece and the 256 byte-fallback pieces are always in the vocabulary.
RESERVED_VOCAB_SIZE = 3 + 1 + 256

# Suffixes picked up when a directory is walked; files named explicitly are read whatever their
# suffix.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
DEFAULT_TEXT_FIELD = "text"

TOKENIZER_MODEL_FILENAME = "tokenizer.model"
META_FILENAME = "meta.json"
# GPTDataset's document/sample/shuffle index cache, kept next to the data it indexes.
INDEX_CACHE_DIRNAME = "index_cache"
# Bump when the outputs of prepare_data change for the same settings, so that old outputs are
# rebuilt instead of reused.
_PREPARE_FORMAT_VERSION = 1


def _log(message: str) -> None:
    print(f"[data] {message}", flush=True)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def stdlib_corpus_files() -> list[Path]:
    """The running interpreter's standard-library ``.py`` files, the default training corpus.

    Walks ``sysconfig.get_paths()["stdlib"]`` (the base interpreter's library, also from inside a
    virtual environment), skipping ``site-packages``/``dist-packages`` (third-party code) and files
    that are not valid UTF-8 (CPython ships a few on purpose, as encoding test cases). Whether
    ``test/`` (CPython's own test suite, ~60% of the text) is there depends on how Python was
    installed; :func:`prepare_data` records the resulting counts in ``meta.json``.

    Returns:
        list[Path]: absolute paths, sorted by their path relative to the stdlib root, so the order
        is the same on every run.
    """
    stdlib_root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirectories, filenames in os.walk(stdlib_root):
        subdirectories[:] = [
            d for d in subdirectories if d not in ("site-packages", "dist-packages", "__pycache__")
        ]
        files.extend(Path(directory, f) for f in filenames if f.endswith(".py"))
    files.sort(key=lambda path: path.relative_to(stdlib_root).as_posix())
    return [path for path in files if _is_utf8(path)]


def list_input_files(
    paths: PathLike | Sequence[PathLike], suffixes: Sequence[str] = TEXT_SUFFIXES
) -> list[Path]:
    """Expand files and directories into the list of files they stand for.

    Args:
        paths: a path, or files and/or directories. Files are kept whatever their suffix;
            directories are walked recursively (sorted, hidden entries skipped) for files ending
            in ``suffixes``.
        suffixes: suffixes picked up in directories (case-insensitive).

    Returns:
        list[Path]: the files, in the order given (directory contents sorted).

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: no file was found.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    lowered_suffixes = tuple(s.lower() for s in suffixes)
    files: list[Path] = []
    for raw_path in paths:
        path = Path(raw_path)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = []
            for directory, subdirectories, filenames in os.walk(path):
                subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
                found.extend(
                    Path(directory, f)
                    for f in filenames
                    if not f.startswith(".") and f.lower().endswith(lowered_suffixes)
                )
            files.extend(sorted(found))
        else:
            raise FileNotFoundError(
                f"corpus input {str(path)!r} does not exist; pass existing text/.jsonl files or "
                f"directories"
            )
    if not files:
        raise ValueError(
            f"no corpus files found in {[str(p) for p in paths]}: directories are searched for "
            f"files ending in {list(suffixes)}; name other files explicitly"
        )
    return files


def read_documents(
    paths: PathLike | Sequence[PathLike],
    text_field: str = DEFAULT_TEXT_FIELD,
    suffixes: Sequence[str] = TEXT_SUFFIXES,
) -> Iterator[str]:
    """Yield the documents of a corpus, one string each.

    * a ``.jsonl`` file yields one document per non-blank line: the line's JSON object's
      ``text_field`` string;
    * any other file (``.txt``, ``.py``, ...) is one document, read as UTF-8 with universal
      newlines (``\\r\\n`` becomes ``\\n``);
    * a directory is walked, see :func:`list_input_files`.

    Args:
        paths: a path, or files and/or directories.
        text_field: the JSON field holding the text in ``.jsonl`` files.
        suffixes: suffixes picked up in directories.

    Yields:
        str: one document.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a file is not UTF-8, or a ``.jsonl`` line is not a JSON object with a string
            ``text_field`` (the message names the file and line).
    """
    for path in list_input_files(paths, suffixes):
        try:
            if path.suffix.lower() == ".jsonl":
                yield from _read_jsonl_documents(path, text_field)
            else:
                yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{path} is not UTF-8 text ({error}); convert it to UTF-8 or leave it out of the "
                f"inputs"
            ) from None


def _read_jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where} is not valid JSON ({error})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(
                    f"{where} has no {text_field!r} field; every line of a .jsonl corpus must be "
                    f"a JSON object with the text under {text_field!r} (choose the field with "
                    f"text_field=...)"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{where}: field {text_field!r} is a {type(text).__name__}, expected a string"
                )
            yield text


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class SentencePieceTokenizer(MegatronTokenizerBase):
    """A sentencepiece model with the interface megatron-core's GPT datasets use.

    ``GPTDatasetConfig``/``GPTDataset`` read ``vocab_size`` (to pick the token dtype), ``eod``
    (the document separator for masks and position ids), ``pad`` (to mask padded positions) and
    ``unique_identifiers`` (part of the key of their on-disk index cache).

    The EOD id is the model's end-of-sentence (``eos``) piece; :func:`train_tokenizer` makes it the
    control piece ``<|endoftext|>``, which encoding text never produces (so a literal
    ``"<|endoftext|>"`` in a document does not end it).

    Args:
        model_path: a sentencepiece ``.model`` file that defines an ``eos`` piece.
    """

    def __init__(self, model_path: PathLike) -> None:
        model_path = Path(model_path)
        if not model_path.is_file():
            raise FileNotFoundError(
                f"tokenizer model {str(model_path)!r} does not exist; train one with "
                f"train_tokenizer() or prepare_data()"
            )
        super().__init__(str(model_path), config={})
        model_bytes = model_path.read_bytes()
        self._processor = sentencepiece.SentencePieceProcessor(model_proto=model_bytes)
        # Identifies the model by content, so GPTDataset's index cache is not reused across
        # retrained tokenizers that happen to be written to the same path.
        self._model_sha256 = hashlib.sha256(model_bytes).hexdigest()
        if self._processor.eos_id() < 0:
            raise ValueError(
                f"tokenizer model {str(model_path)!r} has no eos piece to use as end-of-document; "
                f"train it with train_tokenizer() or with sentencepiece's eos_id >= 0"
            )

    @property
    def vocab_size(self) -> int:
        """Number of pieces, i.e. the size of the embedding table the ids index."""
        return self._processor.get_piece_size()

    @property
    def vocab(self) -> dict[str, int]:
        """Piece string -> id."""
        return {self._processor.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def eod(self) -> int:
        """End-of-document id, appended after every document in the indexed dataset."""
        return self._processor.eos_id()

    @property
    def pad(self) -> int:
        """Padding id, or -1 when the model has none."""
        return self._processor.pad_id()

    @property
    def unique_identifiers(self) -> OrderedDict:
        """JSON-serialisable identity of this tokenizer, hashed into GPTDataset's cache key."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("model_path", self.path),
                ("model_sha256", self._model_sha256),
            ]
        )

    def tokenize(self, text: str) -> list[int]:
        """Encode text, no EOD added. Returns: list[int], ~len(text) / 3.5 ids for code at 8192
        pieces."""
        return self._processor.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Decode ids back to text; control pieces such as EOD decode to nothing."""
        return self._processor.decode(list(ids))

    def apply_chat_template(self, *args, **kwargs):
        """Required by MegatronTokenizerBase; a plain-text pretraining tokenizer has no chat
        template."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")


def _sample_training_lines(
    documents: Iterable[str], max_lines: int, seed: int
) -> tuple[list[str], int]:
    """A uniform random sample of at most ``max_lines`` of the documents' non-blank lines.

    Lines, because sentencepiece trains on "sentences" and skips any longer than 4192 bytes, so
    whole files cannot be its sentences. Sampled here (reservoir sampling) rather than by
    sentencepiece's own ``input_sentence_size``, whose sample differs from process to process
    despite ``set_random_generator_seed``, so the same corpus would give different models.

    Returns:
        tuple[list[str], int]: the sampled lines and the number of non-blank lines seen.
    """
    generator = random.Random(seed)
    sample: list[str] = []
    num_lines = 0
    for document in tqdm(documents, desc="sampling lines for the tokenizer", unit="doc"):
        for line in document.split("\n"):
            if not line.strip():
                continue
            num_lines += 1
            if len(sample) < max_lines:
                sample.append(line)
            else:
                slot = generator.randrange(num_lines)
                if slot < max_lines:
                    sample[slot] = line
    return sample, num_lines


def _check_tokenizer_settings(vocab_size: int, model_type: str, max_training_lines: int) -> None:
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type={model_type!r}; use 'bpe' or 'unigram'")
    if vocab_size <= RESERVED_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for learned pieces: {RESERVED_VOCAB_SIZE} ids "
            f"are reserved (specials, newline, 256 byte pieces); use e.g. 512 or more"
        )
    if max_training_lines < 1:
        raise ValueError(f"max_training_lines={max_training_lines}; it must be at least 1")


def train_tokenizer(
    documents: Iterable[str],
    model_prefix: PathLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
    max_training_lines: int = DEFAULT_MAX_TRAINING_LINES,
    seed: int = DEFAULT_SEED,
    num_threads: int | None = None,
) -> SentencePieceTokenizer:
    """Train a sentencepiece tokenizer on documents and write ``<model_prefix>.model``.

    The model is set up for source code as well as prose:

    * ``bpe`` by default: on the stdlib corpus it trains in ~5 s where ``unigram`` takes ~220 s
      (unigram's seed-piece search is slow once pieces may span whitespace, below), and it
      compresses slightly better (3.46 vs 3.40 characters per token at 8192 pieces);
    * identity normalisation and no whitespace collapsing, so indentation and every character
      survive: ``detokenize(tokenize(text)) == text``;
    * pieces may contain and span spaces (``"▁▁▁▁return"``, ``"def▁f"``), so indentation costs
      few tokens;
    * byte fallback: characters outside the vocabulary become UTF-8 byte pieces, never ``<unk>``;
    * ``"\\n"`` is a piece of its own (lines are trained separately and never contain it);
    * ids: 0 ``<unk>``, 1 ``<pad>``, 2 ``<|endoftext|>`` (EOD, a control piece), 3 ``"\\n"``,
      then the 256 byte pieces, then learned pieces. No BOS: GPT-style documents are separated by
      EOD only.

    Training input is bounded: at most ``max_training_lines`` of the non-blank lines, sampled
    uniformly at random with ``seed``, so the same corpus and seed give the same model.

    Args:
        documents: the corpus, one string per document.
        model_prefix: the model is written to ``<model_prefix>.model`` (directories created).
        vocab_size: number of pieces, at least ``RESERVED_VOCAB_SIZE`` (260) plus the corpus's
            distinct characters; ids are < vocab_size.
        model_type: ``"bpe"`` or ``"unigram"``.
        max_training_lines: lines sampled for training.
        seed: sampling seed.
        num_threads: training threads; defaults to all CPUs.

    Returns:
        SentencePieceTokenizer: the trained model, loaded.

    Raises:
        ValueError: a bad argument, an empty corpus, or a vocabulary size this corpus cannot fill.
    """
    _check_tokenizer_settings(vocab_size, model_type, max_training_lines)
    model_path = Path(f"{os.fspath(model_prefix)}.model")
    model_path.parent.mkdir(parents=True, exist_ok=True)

    lines, num_lines = _sample_training_lines(documents, max_training_lines, seed)
    if not lines:
        raise ValueError("the corpus has no non-blank lines to train a tokenizer on")
    _log(f"training the tokenizer on {len(lines):,} of {num_lines:,} non-blank lines")
    model_buffer = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model_buffer,
            model_type=model_type,
            vocab_size=vocab_size,
            input_sentence_size=0,  # lines are sampled already
            character_coverage=0.9999,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_by_whitespace=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            unk_id=0,
            pad_id=1,
            eos_id=2,
            bos_id=-1,
            unk_piece=UNK_PIECE,
            pad_piece=PAD_PIECE,
            eos_piece=EOD_PIECE,
            user_defined_symbols=["\n"],
            num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2,  # sentencepiece logs every merge otherwise
        )
    except RuntimeError as error:
        # Keep sentencepiece's explanation (it says which way to move vocab_size), drop its
        # "src/trainer_interface.cc(744) [check]" prefix.
        explanation = str(error).rsplit("] ", 1)[-1]
        raise ValueError(
            f"sentencepiece could not train a {model_type} tokenizer with vocab_size={vocab_size} "
            f"on {len(lines)} lines: {explanation}"
        ) from None

    # Write-then-rename, so an interrupted run never leaves a truncated model behind.
    partial_path = model_path.with_name(model_path.name + ".partial")
    partial_path.write_bytes(model_buffer.getvalue())
    os.replace(partial_path, model_path)
    return SentencePieceTokenizer(model_path)


# --------------------------------------------------------------------------------------------
# Indexed dataset
# --------------------------------------------------------------------------------------------


_worker_tokenizer: SentencePieceTokenizer | None = None  # in a tokenizing worker process


def _start_tokenizing_worker(model_path: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = SentencePieceTokenizer(model_path)


def _tokenize_in_worker(text: str) -> tuple[list[int], int]:
    return _worker_tokenizer.tokenize(text), len(text)


def write_indexed_dataset(
    documents: Iterable[str], tokenizer: SentencePieceTokenizer, output_prefix: PathLike,
    workers: int = 1,
) -> dict[str, int]:
    """Tokenize documents into a Megatron indexed dataset ``<output_prefix>.bin/.idx``.

    Each document becomes one sequence (and one Megatron "document"): its token ids followed by
    ``tokenizer.eod``. Documents that encode to no tokens (empty files) are skipped rather than
    stored as a lone EOD. Ids are stored as uint16 when the vocabulary fits, else int32 (Megatron's
    ``DType.optimal_dtype``).

    Args:
        documents: the corpus, one string per document.
        tokenizer: the tokenizer to encode with.
        output_prefix: path prefix of the ``.bin``/``.idx`` pair (directories created).
        workers: processes that tokenize (each loads the tokenizer); documents are written in
            their order whatever the count, so the output is the same.

    Returns:
        dict[str, int]: ``documents`` (sequences written), ``tokens`` (ids written, EOD
        included), ``characters`` (of the documents written), ``empty_documents_skipped``.

    Raises:
        ValueError: no document had any token.
    """
    output_prefix = os.fspath(output_prefix)
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    token_dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=token_dtype)
    stats = {"documents": 0, "tokens": 0, "characters": 0, "empty_documents_skipped": 0}
    total = len(documents) if hasattr(documents, "__len__") else None
    with contextlib.ExitStack() as stack:
        if workers > 1:
            pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
                workers, initializer=_start_tokenizing_worker, initargs=(tokenizer.path,)))
            encoded = pool.imap(_tokenize_in_worker, documents, chunksize=16)
        else:
            encoded = ((tokenizer.tokenize(text), len(text)) for text in documents)
        for token_ids, characters in tqdm(encoded, total=total, desc="tokenizing", unit="doc"):
            if not token_ids:
                stats["empty_documents_skipped"] += 1
                continue
            token_ids.append(tokenizer.eod)
            builder.add_document(numpy.asarray(token_ids, dtype=token_dtype), [len(token_ids)])
            stats["documents"] += 1
            stats["tokens"] += len(token_ids)
            stats["characters"] += characters
    builder.finalize(get_idx_path(output_prefix))
    if stats["documents"] == 0:
        os.remove(get_bin_path(output_prefix))
        os.remove(get_idx_path(output_prefix))
        raise ValueError(
            f"no document in the corpus has any text; nothing written to {output_prefix}"
        )
    return stats


# --------------------------------------------------------------------------------------------
# One-call preparation
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """The outputs of :func:`prepare_data`.

    Attributes:
        output_dir: the output directory.
        tokenizer_model: ``<output_dir>/tokenizer.model``.
        tokenizer: that model, loaded.
        data_prefix: ``<output_dir>/<name>_text_document``, prefix of the ``.bin``/``.idx`` pair,
            as :func:`build_gpt_datasets` takes it.
        meta: the contents of ``meta.json``.
        reused: True when existing outputs were reused (always, from :func:`load_prepared`).
    """

    output_dir: Path
    tokenizer_model: Path
    tokenizer: SentencePieceTokenizer
    data_prefix: Path
    meta: dict
    reused: bool

    @classmethod
    def from_meta(cls, output_dir: Path, meta: dict, reused: bool) -> "PreparedData":
        tokenizer_model = output_dir / meta["outputs"]["tokenizer_model"]
        return cls(
            output_dir=output_dir,
            tokenizer_model=tokenizer_model,
            tokenizer=SentencePieceTokenizer(tokenizer_model),
            data_prefix=output_dir / meta["outputs"]["data_prefix"],
            meta=meta,
            reused=reused,
        )


def _inputs_fingerprint(files: Sequence[Path]) -> str:
    """Changes when any input file is added, removed, resized or touched."""
    digest = hashlib.sha256()
    for path in files:
        status = path.stat()
        digest.update(f"{path}\t{status.st_size}\t{status.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _load_meta(meta_path: Path) -> dict | None:
    try:
        return json.loads(meta_path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def prepare_data(
    inputs: PathLike | Sequence[PathLike] | None = None,
    *,
    output_dir: PathLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    name: str | None = None,
    text_field: str = DEFAULT_TEXT_FIELD,
    model_type: str = "bpe",
    max_training_lines: int = DEFAULT_MAX_TRAINING_LINES,
    seed: int = DEFAULT_SEED,
    overwrite: bool = False,
    tokenizer_model: PathLike | None = None,
    workers: int = 1,
) -> PreparedData:
    """Train a tokenizer on a corpus (or take an existing one) and write the corpus as a Megatron
    indexed dataset.

    Writes into ``output_dir``: ``tokenizer.model``, ``<name>_text_document.bin/.idx`` and
    ``meta.json`` (inputs, settings, the file list in document order, file/document/token counts,
    vocabulary size, Python version, timings). ``meta.json`` is written last, so it only exists
    for complete outputs. When it matches the same inputs (paths, sizes, modification times) and
    settings, the outputs are reused and the call returns at once; ``overwrite=True`` rebuilds.

    Files are put in a seeded random order before tokenizing, so Megatron's contiguous
    train/validation split (see :func:`build_gpt_datasets`) holds out a random set of files rather
    than, e.g., the alphabetically last stdlib packages.

    Args:
        inputs: a path or files/directories (see :func:`read_documents`); None for the standard
            library (:func:`stdlib_corpus_files`).
        output_dir: where the outputs go (created).
        vocab_size: tokenizer vocabulary size.
        name: dataset name in the file names; defaults to ``"stdlib"`` or ``"corpus"``.
        text_field: JSON field with the text in ``.jsonl`` inputs.
        model_type, max_training_lines: see :func:`train_tokenizer`.
        seed: seed for the file order and the tokenizer's line sample.
        overwrite: rebuild even if matching outputs exist.
        tokenizer_model: an existing sentencepiece ``.model`` (with an ``eos`` piece, the
            documents' separator) to tokenize with, copied to ``output_dir``; None trains one
            (then ``vocab_size``, ``model_type`` and ``max_training_lines`` apply).
        workers: processes that tokenize the corpus (:func:`write_indexed_dataset`).

    Returns:
        PreparedData: output paths, the meta dict and whether outputs were reused.
    """
    started = time.perf_counter()
    _check_tokenizer_settings(vocab_size, model_type, max_training_lines)
    output_dir = Path(output_dir).resolve()
    if inputs is None:
        files = stdlib_corpus_files()
        corpus_inputs = [f"<stdlib {sysconfig.get_paths()['stdlib']}>"]
        name = name or "stdlib"
    else:
        if isinstance(inputs, (str, os.PathLike)):
            inputs = [inputs]
        files = [path.resolve() for path in list_input_files(inputs)]
        corpus_inputs = [str(Path(path).resolve()) for path in inputs]
        name = name or "corpus"
    settings = {
        "format_version": _PREPARE_FORMAT_VERSION,
        "inputs": corpus_inputs,
        "name": name,
        "text_field": text_field,
        "vocab_size": vocab_size,
        "model_type": model_type,
        "max_training_lines": max_training_lines,
        "seed": seed,
        "tokenizer_model": None if tokenizer_model is None else {
            "path": str(Path(tokenizer_model).resolve()),
            "sha256": hashlib.sha256(Path(tokenizer_model).read_bytes()).hexdigest()},
    }
    fingerprint = _inputs_fingerprint(files)
    model_path = output_dir / TOKENIZER_MODEL_FILENAME
    data_prefix = output_dir / f"{name}_text_document"
    meta_path = output_dir / META_FILENAME

    meta = _load_meta(meta_path)
    outputs_exist = model_path.is_file() and IndexedDataset.exists(str(data_prefix))
    if (
        not overwrite
        and meta is not None
        and outputs_exist
        and meta.get("settings") == settings
        and meta.get("inputs_fingerprint") == fingerprint
    ):
        counts = meta["counts"]
        _log(
            f"reusing {data_prefix} ({counts['files']} files, {counts['documents']} documents, "
            f"{counts['tokens']:,} tokens, vocab {vocab_size}); pass overwrite=True to rebuild"
        )
        return PreparedData.from_meta(output_dir, meta, reused=True)

    output_dir.mkdir(parents=True, exist_ok=True)
    meta_path.unlink(missing_ok=True)
    # GPTDataset indices cached for the previous data would silently index the new one wrongly.
    shutil.rmtree(output_dir / INDEX_CACHE_DIRNAME, ignore_errors=True)
    random.Random(seed).shuffle(files)

    tokenizer_started = time.perf_counter()
    if tokenizer_model is not None:
        _log(f"tokenizing with {tokenizer_model}")
        shutil.copyfile(tokenizer_model, model_path)
        tokenizer = SentencePieceTokenizer(model_path)
    else:
        _log(f"training a {model_type} tokenizer (vocab {vocab_size}) on up to "
             f"{max_training_lines:,} lines sampled from {len(files)} files")
        tokenizer = train_tokenizer(
            read_documents(files, text_field),
            output_dir / Path(TOKENIZER_MODEL_FILENAME).stem,
            vocab_size=vocab_size,
            model_type=model_type,
            max_training_lines=max_training_lines,
            seed=seed,
        )
    tokenizer_seconds = time.perf_counter() - tokenizer_started

    _log(f"writing {data_prefix}.bin/.idx")
    dataset_started = time.perf_counter()
    stats = write_indexed_dataset(read_documents(files, text_field), tokenizer, data_prefix,
                                  workers=workers)
    dataset_seconds = time.perf_counter() - dataset_started

    meta = {
        "settings": settings,
        "inputs_fingerprint": fingerprint,
        "counts": {"files": len(files), **stats},
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod,
        "pad_id": tokenizer.pad,
        "characters_per_token": round(stats["characters"] / stats["tokens"], 3),
        "outputs": {"tokenizer_model": model_path.name, "data_prefix": data_prefix.name},
        "python_version": sys.version,
        "timings_s": {
            "tokenizer": round(tokenizer_seconds, 2),
            "dataset": round(dataset_seconds, 2),
            "total": round(time.perf_counter() - started, 2),
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": [str(path) for path in files],
    }
    partial_meta_path = meta_path.with_name(META_FILENAME + ".partial")
    partial_meta_path.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(partial_meta_path, meta_path)
    _log(
        f"prepared {name}: {len(files)} files, {stats['documents']} documents, "
        f"{stats['tokens']:,} tokens, vocab {tokenizer.vocab_size} in "
        f"{meta['timings_s']['total']:.1f} s -> {output_dir}"
    )
    return PreparedData.from_meta(output_dir, meta, reused=False)


def load_prepared(output_dir: PathLike) -> PreparedData:
    """Open the outputs :func:`prepare_data` wrote to ``output_dir``, without checking inputs.

    Raises:
        FileNotFoundError: ``output_dir`` holds no complete outputs (no ``meta.json``).
    """
    output_dir = Path(output_dir).resolve()
    meta = _load_meta(output_dir / META_FILENAME)
    if meta is None:
        raise FileNotFoundError(
            f"no prepared data in {str(output_dir)!r} (no readable {META_FILENAME}); run "
            f"prepare_data(output_dir=...) or `megatron-ext prepare-data --output-dir ...` first"
        )
    return PreparedData.from_meta(output_dir, meta, reused=True)


# --------------------------------------------------------------------------------------------
# Megatron GPT datasets
# --------------------------------------------------------------------------------------------


def build_gpt_datasets(
    data_prefix: PathLike,
    tokenizer: SentencePieceTokenizer,
    seq_length: int,
    num_train_samples: int,
    num_valid_samples: int,
    seed: int = DEFAULT_SEED,
    *,
    valid_fraction: float = 0.05,
    create_attention_mask: bool = False,
) -> tuple[GPTDataset, GPTDataset]:
    """Train and validation ``GPTDataset`` s over an indexed dataset, via megatron-core's builder.

    The documents are split contiguously: the first ``1 - valid_fraction`` of them train, the rest
    validate (:func:`prepare_data` shuffles files, so that is a random hold-out). Documents are
    concatenated (EOD-separated) and cut into samples of ``seq_length + 1`` tokens; each split is
    repeated over as many shuffled epochs as the requested number of samples needs.

    Each item is a dict of tensors of length ``seq_length``: ``tokens`` (int64), ``labels``
    (int64, ``tokens`` shifted left by one), ``loss_mask`` (float32, ones) and ``position_ids``
    (int64, 0..seq_length-1); plus ``attention_mask`` (bool, shape (1, seq_length, seq_length),
    True = masked) when ``create_attention_mask``. It is off by default because megatron-core's
    attention builds the causal mask itself when none is given, and a per-sample square mask costs
    seq_length**2 bytes.

    The sample indices are cached in ``<data_prefix's directory>/index_cache``, nothing is written
    elsewhere. Works with and without ``torch.distributed``: when it is initialised (any backend,
    gloo on CPU included), every rank must call this; rank 0 builds the cache first and the others
    load it after a barrier.

    Args:
        data_prefix: prefix of the ``.bin``/``.idx`` pair (``PreparedData.data_prefix``).
        tokenizer: the tokenizer the data was written with.
        seq_length: tokens per sample.
        num_train_samples: train samples wanted (the dataset has at least that many).
        num_valid_samples: validation samples wanted (the dataset has at least that many).
        seed: seed of the document and sample shuffles.
        valid_fraction: share of documents held out for validation, in (0, 1).
        create_attention_mask: also return ``attention_mask``.

    Returns:
        tuple[GPTDataset, GPTDataset]: (train, valid).

    Raises:
        FileNotFoundError: no ``.bin``/``.idx`` at ``data_prefix``.
        ValueError: bad sizes, or a split that would get no document.
    """
    # Absolute, because the path is part of GPTDataset's cache key.
    data_prefix = os.path.abspath(data_prefix)
    if not IndexedDataset.exists(data_prefix):
        raise FileNotFoundError(
            f"no indexed dataset at {data_prefix!r} (.bin/.idx); create one with prepare_data()"
        )
    for argument, value in (
        ("seq_length", seq_length),
        ("num_train_samples", num_train_samples),
        ("num_valid_samples", num_valid_samples),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{argument}={value!r}; it must be a positive integer")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction={valid_fraction}; it must be in (0, 1), e.g. 0.05")

    train_percent = 100.0 * (1.0 - valid_fraction)
    data_dir = os.path.dirname(data_prefix)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([data_prefix], None),
        split=f"{train_percent:.6f},{100.0 - train_percent:.6f},0",
        path_to_cache=os.path.join(data_dir, INDEX_CACHE_DIRNAME),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )
    # Megatron loops forever building an empty split's epochs (it adds 0 tokens per epoch until
    # it has enough), so check that both splits get documents, splitting exactly as it does.
    num_documents = len(IndexedDataset(data_prefix).sequence_lengths)
    for split_name, bounds in zip(("train", "valid"), config.split_matrix):
        begin, end = (int(round(bound * num_documents)) for bound in bounds)
        if end <= begin:
            raise ValueError(
                f"valid_fraction={valid_fraction} gives the {split_name} split no document out of "
                f"{num_documents} in {data_prefix!r}; add documents or change valid_fraction"
            )

    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset,
        [num_train_samples, num_valid_samples, None],
        # Every rank gets the whole datasets; each data-parallel rank picks its own samples.
        lambda: True,
        config,
    ).build()
    return train, valid
