"""Unit tests of the real-data readers (models.data) on tiny generated files in the real
formats, plus one test on the real WikiText-2 copy when the machine has it."""

from __future__ import annotations

import datetime
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from models.bert import BertConfig
from models.data import CIFAR10_MEAN, CIFAR10_STD, Cifar10, WikiText2, build_vocab
from models.vgg19 import VGG19Config

PER_FILE = 3  # images per generated CIFAR batch file: 15 train rows, 3 test rows
REAL_WIKITEXT = "/work/shared/data/wikitext-2"


def _write_cifar(directory, per_file=PER_FILE, seed=0, protocol=2):
    """Writes data_batch_1..5 and test_batch like the official python-version files."""
    rng = np.random.default_rng(seed)
    rows = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_file, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_file)]
        with open(directory / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"data": data, b"labels": labels}, f, protocol=protocol)
        rows[name] = (data, labels)
    return rows


def _expected_image(row):
    pixels = row.reshape(3, 32, 32).astype(np.float64) / 255.0
    mean = np.array(CIFAR10_MEAN).reshape(3, 1, 1)
    std = np.array(CIFAR10_STD).reshape(3, 1, 1)
    return torch.tensor((pixels - mean) / std, dtype=torch.float32)


# ---------------------------------------------------------------- CIFAR-10


def test_cifar_train_batch_shapes_normalisation_and_wraparound(tmp_path):
    rows = _write_cifar(tmp_path)
    data = np.concatenate([rows[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = [label for i in range(1, 6) for label in rows[f"data_batch_{i}"][1]]
    dataset = Cifar10(str(tmp_path), "train")
    assert len(dataset) == 5 * PER_FILE
    # Global batch 8, step 2: samples 16..23 -> rows 1..8 (mod 15); slice [1, 4) -> rows 2, 3, 4.
    images, targets = dataset.batch(2, 1, 4, 8)
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32
    assert targets.dtype == torch.int64
    for got, row in zip(images, (2, 3, 4)):
        torch.testing.assert_close(got, _expected_image(data[row]))
    assert targets.tolist() == [labels[2], labels[3], labels[4]]


def test_cifar_rank_slices_are_slices_of_one_global_batch(tmp_path):
    _write_cifar(tmp_path)
    dataset = Cifar10(str(tmp_path), "train")
    full = dataset.batch(5, 0, 8, 8)
    head, tail = dataset.batch(5, 0, 3, 8), dataset.batch(5, 3, 8, 8)
    for f, h, t in zip(full, head, tail):
        assert torch.equal(torch.cat([h, t]), f)
    assert all(t.shape[0] == 0 for t in dataset.batch(5, 4, 4, 8))


def test_cifar_test_split_and_config_integration(tmp_path):
    rows = _write_cifar(tmp_path, protocol=5)
    cfg = VGG19Config.from_preset("tiny")
    dataset = cfg.dataset("cifar10", str(tmp_path), "test", seed=0)
    images, labels = dataset.batch(0, 0, 4, 4)
    # 3 test rows: the fourth sample wraps to row 0.
    torch.testing.assert_close(images[3], _expected_image(rows["test_batch"][0][0]))
    assert labels.tolist() == rows["test_batch"][1] + rows["test_batch"][1][:1]
    torch.manual_seed(0)
    assert torch.isfinite(cfg.build()(images, labels))
    with pytest.raises(ValueError, match="split"):
        Cifar10(str(tmp_path), "valid")


def _py2_str(raw):
    """Pickle opcode of a Python 2 str: SHORT_BINSTRING (< 256 bytes) or BINSTRING."""
    if len(raw) < 256:
        return b"U" + bytes([len(raw)]) + raw
    return b"T" + struct.pack("<i", len(raw)) + raw


def _py2_cifar_pickle(data, labels):
    """A batch file as Python 2's cPickle (protocol 2) wrote the official CIFAR-10 files:
    strings are str opcodes and the array names numpy.core.multiarray."""
    out = b"\x80\x02}(" + _py2_str(b"data")
    out += b"cnumpy.core.multiarray\n_reconstruct\n"
    out += b"cnumpy\nndarray\n" + b"K\x00\x85" + _py2_str(b"b") + b"\x87R"
    shape = b"(" + b"".join(b"J" + struct.pack("<i", n) for n in data.shape) + b"t"
    dtype = (
        b"cnumpy\ndtype\n"
        + _py2_str(b"u1")
        + b"K\x00K\x01\x87R"
        + b"(K\x03"
        + _py2_str(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
    )
    out += b"(K\x01" + shape + dtype + b"\x89" + _py2_str(data.tobytes()) + b"tb"
    out += _py2_str(b"labels") + b"](" + b"".join(b"K" + bytes([label]) for label in labels) + b"e"
    return out + b"u."


def test_cifar_reads_python2_pickles(tmp_path):
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size=(2, 3072), dtype=np.uint8)
    (tmp_path / "test_batch").write_bytes(_py2_cifar_pickle(data, [3, 9]))
    images, labels = Cifar10(str(tmp_path), "test").batch(0, 0, 2, 2)
    torch.testing.assert_close(images[1], _expected_image(data[1]))
    assert labels.tolist() == [3, 9]


def test_cifar_missing_directory_and_file(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError) as info:
        Cifar10(str(missing), "train")
    message = str(info.value)
    assert str(missing) in message and "data_batch_1" in message and "never downloads" in message
    assert isinstance(info.value, FileNotFoundError)
    _write_cifar(tmp_path)
    os.remove(tmp_path / "data_batch_3")
    with pytest.raises(ValueError, match=str(tmp_path / "data_batch_3")):
        Cifar10(str(tmp_path), "train")


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"this is not a pickle", "pickle"),
        (pickle.dumps({b"pixels": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}), "keys"),
        (pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}), "uint8"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}), "labels"),
        (pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}), "labels"),
        (pickle.dumps([1, 2, 3]), "dict"),
        # A global outside numpy's array classes is refused rather than imported.
        (pickle.dumps({b"data": datetime.date(2020, 1, 1)}), "refusing"),
    ],
)
def test_cifar_corrupt_file(tmp_path, content, problem):
    _write_cifar(tmp_path)
    (tmp_path / "test_batch").write_bytes(content)
    with pytest.raises(ValueError) as info:
        Cifar10(str(tmp_path), "test")
    message = str(info.value)
    assert str(tmp_path / "test_batch") in message and problem in message


# ---------------------------------------------------------------- WikiText-2

TEXT = " = Title = \n \n the cat sat on the mat \n the dog <unk> sat \n"
# Tokens: = Title = <eos> the cat sat on the mat <eos> the dog <unk> sat <eos>  (16)
# Counts: <eos> 3, the 3, = 2, sat 2, Title/cat/on/mat/dog 1 (ties in order of first appearance;
# '<unk>' is never counted: it is id 0).


def test_build_vocab_ranks_by_count_then_first_appearance():
    words = TEXT.split()
    assert build_vocab(words, 4) == ["<unk>", "the", "=", "sat"]
    assert build_vocab(words, 100)[:6] == ["<unk>", "the", "=", "sat", "Title", "cat"]


def test_wikitext_windows_shift_and_unk(tmp_path):
    (tmp_path / "wiki.train.tokens").write_text(TEXT)
    dataset = WikiText2(str(tmp_path), "train", vocab_size=5, seq_len=4)
    assert dataset.vocab == ["<unk>", "<eos>", "the", "=", "sat"]
    ids = {w: i for i, w in enumerate(dataset.vocab)}
    words = [
        "=",
        "Title",
        "=",
        "<eos>",
        "the",
        "cat",
        "sat",
        "on",
        "the",
        "mat",
        "<eos>",
        "the",
        "dog",
        "<unk>",
        "sat",
        "<eos>",
    ]
    expected = [ids.get(w, 0) for w in words]
    assert dataset.tokens.tolist() == expected
    assert len(dataset) == (16 - 1) // 4
    # Global batch 2, step 1: windows 2 and 3 % 3 = 0; take both.
    x, y = dataset.batch(1, 0, 2, 2)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 4)
    assert x.tolist() == [expected[8:12], expected[0:4]]
    assert y.tolist() == [expected[9:13], expected[1:5]]
    assert int(x.max()) < 5
    head, tail = dataset.batch(1, 0, 1, 2), dataset.batch(1, 1, 2, 2)
    assert torch.equal(torch.cat([head[0], tail[0]]), x)


def test_wikitext_txt_name_and_config_integration(tmp_path):
    (tmp_path / "valid.txt").write_text(TEXT * 20)
    cfg = BertConfig.from_preset("tiny", seq_len=8)
    dataset = cfg.dataset("wikitext2", str(tmp_path), "valid", seed=0)
    x, y = dataset.batch(0, 0, 2, 2)
    torch.manual_seed(0)
    assert torch.isfinite(cfg.build()(x, y))


def test_wikitext_missing_and_corrupt(tmp_path):
    with pytest.raises(ValueError) as info:
        WikiText2(str(tmp_path / "absent"), "train", 10, 4)
    assert str(tmp_path / "absent") in str(info.value) and "never downloads" in str(info.value)
    with pytest.raises(ValueError) as info:
        WikiText2(str(tmp_path), "test", 10, 4)
    message = str(info.value)
    assert str(tmp_path / "wiki.test.tokens") in message and "test.txt" in message
    (tmp_path / "wiki.test.tokens").write_text("\n  \n\n")
    with pytest.raises(ValueError, match="no tokens") as info:
        WikiText2(str(tmp_path), "test", 10, 4)
    assert str(tmp_path / "wiki.test.tokens") in str(info.value)
    (tmp_path / "wiki.test.tokens").write_bytes(b"\xff\xfe bad")
    with pytest.raises(ValueError, match="UTF-8"):
        WikiText2(str(tmp_path), "test", 10, 4)
    (tmp_path / "wiki.test.tokens").write_text("a b\n")
    with pytest.raises(ValueError, match="too few"):
        WikiText2(str(tmp_path), "test", 10, 4)


@pytest.mark.skipif(not os.path.isdir(REAL_WIKITEXT), reason="no local WikiText-2 copy")
def test_real_wikitext2_valid_split():
    dataset = WikiText2(REAL_WIKITEXT, "valid", vocab_size=33280, seq_len=128)
    with open(os.path.join(REAL_WIKITEXT, "valid.txt"), encoding="utf-8") as f:
        lines = [line.split() for line in f]
    assert len(dataset.tokens) == sum(len(words) + 1 for words in lines if words)
    assert dataset.vocab[0] == "<unk>" and "<eos>" in dataset.vocab
    assert len(dataset.vocab) < 33280  # one split has far fewer words than the padded vocabulary
    x, y = dataset.batch(3, 0, 4, 8)
    assert x.shape == (4, 128) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < len(dataset.vocab)
