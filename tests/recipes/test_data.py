"""Corpus -> tokenizer -> Megatron indexed dataset -> GPTDataset, on a small corpus (CPU only)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron_ext.data import (
    EOD_PIECE,
    INDEX_CACHE_DIRNAME,
    SentencePieceTokenizer,
    build_gpt_datasets,
    load_prepared,
    prepare_data,
    read_documents,
    stdlib_corpus_files,
    train_tokenizer,
    write_indexed_dataset,
)

STDLIB_FILES = [
    "bisect.py", "colorsys.py", "keyword.py", "textwrap.py", "this.py", "json/encoder.py",
]
JSONL_TEXTS = [
    "Plain prose, with accents: café, naïve, Ærøskøbing.",
    "Emoji 🐍 and CJK 蛇 go through byte fallback; a literal <|endoftext|> is just text.",
    "",  # encodes to no token: skipped, not stored as a lone EOD
    "def f(x):\n\tif x:\n\t\treturn x  # tabs, too\n",
]
VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A directory of a few stdlib files, a .jsonl file, and a file the directory walk skips."""
    corpus = tmp_path_factory.mktemp("corpus")
    stdlib_root = Path(sysconfig.get_paths()["stdlib"])
    for relative_path in STDLIB_FILES:
        shutil.copy(stdlib_root / relative_path, corpus / relative_path.replace("/", "_"))
    with open(corpus / "notes.jsonl", "w", encoding="utf-8") as jsonl:
        for text in JSONL_TEXTS:
            jsonl.write(json.dumps({"text": text, "id": len(text)}) + "\n")
    (corpus / "weights.bin").write_bytes(b"\xff\xfe not text")
    return corpus


@pytest.fixture(scope="module")
def documents(corpus_dir) -> list[str]:
    return list(read_documents([corpus_dir]))


@pytest.fixture(scope="module")
def tokenizer(documents, tmp_path_factory) -> SentencePieceTokenizer:
    return train_tokenizer(
        documents, tmp_path_factory.mktemp("tokenizer") / "tokenizer", vocab_size=VOCAB_SIZE
    )


@pytest.fixture(scope="module")
def indexed_dataset(documents, tokenizer, tmp_path_factory):
    """(data prefix, stats) of the small corpus written as an indexed dataset."""
    prefix = tmp_path_factory.mktemp("indexed") / "small_text_document"
    return prefix, write_indexed_dataset(documents, tokenizer, prefix)


def test_stdlib_corpus_files_are_deterministic_stdlib_sources():
    files = stdlib_corpus_files()
    assert files == stdlib_corpus_files()
    assert len(files) > 500
    assert all(path.suffix == ".py" for path in files)
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.parts)
    assert Path(sysconfig.get_paths()["stdlib"], "os.py") in files


def test_read_documents_one_per_file_and_one_per_jsonl_line(corpus_dir, documents):
    stdlib_root = Path(sysconfig.get_paths()["stdlib"])
    stdlib_texts = {(stdlib_root / f).read_text(encoding="utf-8") for f in STDLIB_FILES}
    # weights.bin is skipped: directories only contribute text suffixes.
    assert len(documents) == len(STDLIB_FILES) + len(JSONL_TEXTS)
    assert stdlib_texts <= set(documents)
    assert [d for d in documents if d not in stdlib_texts] == JSONL_TEXTS

    assert list(read_documents([corpus_dir / "notes.jsonl"])) == JSONL_TEXTS
    with pytest.raises(ValueError, match=r"notes\.jsonl:1: field 'id' is a int"):
        list(read_documents([corpus_dir / "notes.jsonl"], text_field="id"))


def test_jsonl_without_text_field_names_file_and_line(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 has no 'text' field"):
        list(read_documents([corpus]))


def test_missing_path_raises_file_not_found(tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(FileNotFoundError, match="nowhere.txt"):
        list(read_documents([missing]))


def test_tokenizer_round_trips_and_keeps_eod_out_of_text(documents, tokenizer):
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert tokenizer.eod == tokenizer.vocab[EOD_PIECE]
    assert tokenizer.pad not in (tokenizer.eod, -1)
    for document in documents:
        token_ids = tokenizer.tokenize(document)
        assert tokenizer.detokenize(token_ids) == document
        assert tokenizer.eod not in token_ids
        assert all(0 <= i < VOCAB_SIZE for i in token_ids)


def test_vocab_too_large_for_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=50000"):
        train_tokenizer(["tiny corpus\n"] * 200, tmp_path / "tokenizer", vocab_size=50000)


def test_indexed_dataset_holds_tokenization_plus_eod(documents, tokenizer, indexed_dataset):
    prefix, stats = indexed_dataset
    expected = [tokenizer.tokenize(d) + [tokenizer.eod] for d in documents if d]
    assert stats["documents"] == len(expected)
    assert stats["empty_documents_skipped"] == 1
    assert stats["tokens"] == sum(map(len, expected))

    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == len(expected)
    assert dataset.index.dtype == numpy.uint16
    # one document per sequence
    numpy.testing.assert_array_equal(dataset.document_indices, numpy.arange(len(expected) + 1))
    for index, token_ids in enumerate(expected):
        assert dataset[index].tolist() == token_ids


def test_prepare_data_reuses_matching_outputs(corpus_dir, tmp_path):
    output_dir = tmp_path / "prepared"
    first = prepare_data([corpus_dir], output_dir=output_dir, vocab_size=VOCAB_SIZE)
    assert not first.reused
    meta = json.loads((output_dir / "meta.json").read_text())
    assert meta["counts"]["files"] == len(STDLIB_FILES) + 1
    assert meta["counts"]["documents"] == len(STDLIB_FILES) + len(JSONL_TEXTS) - 1
    assert meta["counts"]["tokens"] == IndexedDataset(str(first.data_prefix)).sequence_lengths.sum()
    model_mtime = first.tokenizer_model.stat().st_mtime_ns

    # A bare path means the same inputs as a one-element list.
    second = prepare_data(corpus_dir, output_dir=output_dir, vocab_size=VOCAB_SIZE)
    assert second.reused
    assert second.meta == meta
    assert second.tokenizer_model.stat().st_mtime_ns == model_mtime

    loaded = load_prepared(output_dir)
    assert loaded.data_prefix == first.data_prefix
    assert loaded.tokenizer.tokenize("x = 1") == first.tokenizer.tokenize("x = 1")
    with pytest.raises(FileNotFoundError, match="no prepared data"):
        load_prepared(tmp_path / "empty")

    rebuilt = prepare_data(
        [corpus_dir], output_dir=output_dir, vocab_size=VOCAB_SIZE, overwrite=True
    )
    assert not rebuilt.reused


def _check_samples(dataset, seq_length):
    for index in range(len(dataset)):
        sample = dataset[index]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert sample["tokens"].shape == (seq_length,)
        # labels are the next tokens
        torch.testing.assert_close(sample["labels"][:-1], sample["tokens"][1:])
        torch.testing.assert_close(sample["position_ids"], torch.arange(seq_length))
        assert bool((sample["loss_mask"] == 1).all())


def test_build_gpt_datasets_gives_shifted_samples_inside_data_dir(tokenizer, indexed_dataset):
    prefix, _ = indexed_dataset
    files_before = {p.relative_to(prefix.parent) for p in prefix.parent.rglob("*")}
    train, valid = build_gpt_datasets(prefix, tokenizer, 32, 50, 10, seed=7, valid_fraction=0.25)
    assert len(train) >= 50 and len(valid) >= 10
    _check_samples(train, 32)
    _check_samples(valid, 32)
    created = {p.relative_to(prefix.parent) for p in prefix.parent.rglob("*")} - files_before
    assert created and all(p.parts[0] == INDEX_CACHE_DIRNAME for p in created)


def test_build_gpt_datasets_rejects_a_split_without_documents(tokenizer, indexed_dataset):
    prefix, _ = indexed_dataset
    with pytest.raises(ValueError, match="valid split no document"):
        build_gpt_datasets(prefix, tokenizer, 32, 50, 10, valid_fraction=0.01)


def _build_on_gloo_rank(rank, world_size, model_path, prefix, results_dir):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{results_dir}/store", rank=rank, world_size=world_size
    )
    try:
        train, valid = build_gpt_datasets(
            prefix, SentencePieceTokenizer(model_path), 32, 50, 10, seed=7, valid_fraction=0.25
        )
        torch.save(
            {"train": train[0]["tokens"], "valid": valid[0]["tokens"]},
            Path(results_dir, f"rank{rank}.pt"),
        )
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.dist
def test_build_gpt_datasets_under_gloo(tokenizer, indexed_dataset, tmp_path):
    prefix, _ = indexed_dataset
    # A fresh copy, so that rank 0 builds the index cache and rank 1 loads it.
    fresh_prefix = tmp_path / "data" / prefix.name
    fresh_prefix.parent.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{prefix}{suffix}", f"{fresh_prefix}{suffix}")

    # A fresh interpreter, since forked ranks would inherit any process group this pytest process
    # holds; it forks rather than spawns its ranks, so megatron is imported once, not three times.
    launch = (
        "import torch.multiprocessing, test_data; torch.multiprocessing.start_processes("
        "test_data._build_on_gloo_rank, "
        f"args=(2, {tokenizer.path!r}, {str(fresh_prefix)!r}, {str(tmp_path)!r}), "
        "nprocs=2, start_method='fork')"
    )
    # It imports this module from the working directory: not in safe-path mode (scripts/env.sh).
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    result = subprocess.run(
        [sys.executable, "-c", launch], cwd=Path(__file__).parent, capture_output=True, text=True,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (fresh_prefix.parent / INDEX_CACHE_DIRNAME).is_dir()
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    train, valid = build_gpt_datasets(
        fresh_prefix, tokenizer, 32, 50, 10, seed=7, valid_fraction=0.25
    )
    for split, dataset in (("train", train), ("valid", valid)):
        torch.testing.assert_close(rank0[split], rank1[split])
        torch.testing.assert_close(rank0[split], dataset[0]["tokens"])


def test_tokenizing_workers_write_the_same_dataset(documents, tokenizer, indexed_dataset, tmp_path):
    """Two tokenizing processes write the byte-identical .bin/.idx and the same counts as one."""
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    prefix, stats = indexed_dataset
    parallel = tmp_path / "parallel_text_document"
    assert write_indexed_dataset(documents, tokenizer, parallel, workers=2) == stats
    for path in (get_bin_path, get_idx_path):
        assert Path(path(str(parallel))).read_bytes() == Path(path(str(prefix))).read_bytes()
