"""The data of a case: synthetic batches, and readers for CIFAR-10 (python pickles) and WikiText-2.

What it does:
  * ``SyntheticDataset(config, seed, split)``: random global batches drawn from a generator
    seeded by (seed, split, step), so every rank slices the same global batch.
  * ``Cifar10(path, split)``: reads the "CIFAR-10 python version" batch files in ``path``
    (data_batch_1..5 for "train", test_batch for "test"). Images come out as float32
    (N,3,32,32) in [0,1], normalised per channel with the CIFAR-10 mean/std.
  * ``WikiText2(path, split, vocab_size, seq_len)``: reads wiki.<split>.tokens or
    <split>.txt in ``path``, builds a word dictionary from that file and cuts the token
    stream into windows of seq_len + 1 tokens (inputs and next-token targets).
  * Both have ``batch(step, start, stop, global_batch)`` returning samples [start, stop) of
    global batch number ``step``; sample i of that batch is example
    (step * global_batch + i) mod N, in file order (no shuffling, so every rank agrees on
    the global batch without communicating). Only the requested samples are converted.

What it doesn't do: never downloads anything, no augmentation, no shuffling, no subword
tokenisation. The CIFAR files are pickles; a restricted unpickler accepts only the numpy
array classes they need, so a foreign pickle cannot run code.
"""

from __future__ import annotations

import collections
import hashlib
import importlib
import os
import pickle
from typing import Any

import numpy as np
import torch


def check_slice(start: int, stop: int, global_batch: int) -> None:
    """Raises ValueError unless 0 <= start <= stop <= global_batch."""
    if not 0 <= start <= stop <= global_batch:
        raise ValueError(f"sample slice [{start}, {stop}) is not inside the global batch of {global_batch}")


class SyntheticDataset:
    """Random data: global batch ``step`` is drawn from a generator seeded by (seed, split, step).

    Each call generates the whole global batch and returns the requested slice, so the
    slices of different ranks are always slices of one and the same global batch.
    """

    def __init__(self, config, seed: int, split: str):
        self.config = config
        self.seed = int(seed)
        self.split = str(split)

    def _generator(self, step: int) -> torch.Generator:
        # A stable hash (not Python's salted hash()) so every process derives the same seed.
        digest = hashlib.blake2b(f"{self.seed}/{self.split}/{int(step)}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))

    def batch(self, step: int, start: int, stop: int, global_batch: int) -> tuple[torch.Tensor, ...]:
        check_slice(start, stop, global_batch)
        full = self.config.synthetic_batch(global_batch, self._generator(step))
        return tuple(t[start:stop].contiguous() for t in full)


# Per-channel statistics of the CIFAR-10 training images (pixel values scaled to [0,1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_FILES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
# Pixels per image: 3 channels x 32 x 32, stored channel-major in the pickles.
CIFAR10_PIXELS = 3 * 32 * 32
CIFAR10_CLASSES = 10

WIKITEXT_SPLITS = ("train", "valid", "test")
UNK = "<unk>"
EOS = "<eos>"

NO_DOWNLOAD = "hetbench never downloads data; put the files there or use data.source=synthetic"


class DataNotFoundError(FileNotFoundError, ValueError):
    """A data directory or file is missing (catchable as FileNotFoundError or ValueError)."""


def _check_split(split: str, valid: tuple[str, ...], source: str) -> None:
    if split not in valid:
        raise ValueError(f"split={split!r} is not valid for data.source={source!r}; valid: {', '.join(valid)}")


def _require_dir(path: str, expected: str) -> str:
    full = os.path.abspath(path)
    if not os.path.isdir(full):
        raise DataNotFoundError(f"data directory {full} does not exist; expected {expected} in it ({NO_DOWNLOAD})")
    return full


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals a pickled numpy array needs."""

    # Python 2 pickles (the official files) use the first four; Python 3 pickles of protocol
    # 2 add _codecs.encode (raw bytes as latin-1 text), protocol 5 uses _frombuffer.
    _ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("_codecs", "encode"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        if module.startswith("numpy.core"):
            # numpy >= 2 moved numpy.core to numpy._core; old pickles name the old module.
            try:
                return getattr(importlib.import_module("numpy._core" + module[len("numpy.core") :]), name)
            except ImportError:
                pass
        return getattr(importlib.import_module(module), name)


def _load_cifar_file(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns (data uint8 (N,3072), labels int64 (N,)) of one CIFAR-10 batch file."""
    try:
        with open(path, "rb") as f:
            # encoding="bytes": the official files were written by Python 2.
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except OSError as err:
        raise ValueError(f"cannot read CIFAR-10 batch file {path}: {err}") from err
    except Exception as err:
        raise ValueError(f"corrupt CIFAR-10 batch file {path}: not a readable pickle ({err})") from err
    if not isinstance(batch, dict):
        raise ValueError(f"corrupt CIFAR-10 batch file {path}: expected a dict, got {type(batch).__name__}")
    # Files written by Python 3 tools may use str keys; accept both.
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        keys = ", ".join(repr(k) for k in batch)
        raise ValueError(f"corrupt CIFAR-10 batch file {path}: expected keys b'data' and b'labels', found {keys}")
    data = np.asarray(data)
    if data.ndim != 2 or data.shape[1] != CIFAR10_PIXELS or data.dtype != np.uint8:
        raise ValueError(
            f"corrupt CIFAR-10 batch file {path}: b'data' must be uint8 (N, {CIFAR10_PIXELS}), "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"corrupt CIFAR-10 batch file {path}: b'labels' is not a list of ints ({err})") from err
    if labels.shape != (data.shape[0],):
        raise ValueError(f"corrupt CIFAR-10 batch file {path}: {labels.size} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= CIFAR10_CLASSES):
        raise ValueError(f"corrupt CIFAR-10 batch file {path}: labels outside 0..{CIFAR10_CLASSES - 1}")
    return data, labels


class Cifar10:
    """CIFAR-10 images and labels of one split, read from the python-version pickles.

    Args:
        path: directory holding data_batch_1..data_batch_5 and test_batch.
        split: "train" (the five data batches, 50,000 images) or "test" (10,000).
    """

    def __init__(self, path: str, split: str):
        _check_split(split, tuple(CIFAR10_FILES), "cifar10")
        names = CIFAR10_FILES[split]
        expected = "the CIFAR-10 python-version files " + ", ".join(names)
        self.path = _require_dir(path, expected)
        data, labels = [], []
        for name in names:
            file = os.path.join(self.path, name)
            if not os.path.isfile(file):
                raise DataNotFoundError(
                    f"CIFAR-10 file {file} does not exist; expected {expected} in {self.path} ({NO_DOWNLOAD})"
                )
            images, targets = _load_cifar_file(file)
            data.append(images)
            labels.append(targets)
        self.data = np.concatenate(data)
        self.labels = np.concatenate(labels)
        if len(self.labels) == 0:
            raise ValueError(f"corrupt CIFAR-10 data in {self.path}: split {split!r} has no images")
        self._mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
        self._std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, step: int, start: int, stop: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (images float32 (n,3,32,32), labels int64 (n,)) for samples [start, stop)."""
        check_slice(start, stop, global_batch)
        rows = (step * global_batch + np.arange(start, stop, dtype=np.int64)) % len(self)
        pixels = torch.from_numpy(self.data[rows]).view(len(rows), 3, 32, 32).float() / 255.0
        images = (pixels - self._mean) / self._std
        return images, torch.from_numpy(self.labels[rows])


def _find_wikitext_file(path: str, split: str) -> str:
    names = (f"wiki.{split}.tokens", f"{split}.txt")
    expected = f"the WikiText-2 token file {names[0]} or {names[1]}"
    full = _require_dir(path, expected)
    for name in names:
        file = os.path.join(full, name)
        if os.path.isfile(file):
            return file
    raise DataNotFoundError(
        f"WikiText-2 file {os.path.join(full, names[0])} (or {os.path.join(full, names[1])}) does not exist; "
        f"expected {expected} in {full} ({NO_DOWNLOAD})"
    )


def build_vocab(words: list[str], vocab_size: int) -> list[str]:
    """The dictionary: '<unk>' (id 0) then the vocab_size - 1 most frequent other words.

    Ties are broken by first appearance. The list may be shorter than vocab_size.
    """
    counts = collections.Counter(word for word in words if word != UNK)
    # Counter keeps first-appearance order and sorted() is stable, so ties keep that order.
    ranked = sorted(counts, key=lambda word: -counts[word])
    return [UNK] + ranked[: vocab_size - 1]


class WikiText2:
    """Word-level WikiText-2 windows of one split.

    Tokens: each non-empty line split on whitespace, followed by '<eos>'. Words outside the
    dictionary (see ``build_vocab``) become '<unk>' (id 0). Window w is
    tokens[w*S : w*S + S + 1]; the input is its first S tokens, the target its last S.

    Args:
        path: directory holding wiki.<split>.tokens or <split>.txt.
        split: "train", "valid" or "test".
        vocab_size: the model's vocabulary size; all ids are below it.
        seq_len: S, tokens per sample.
    """

    def __init__(self, path: str, split: str, vocab_size: int, seq_len: int):
        _check_split(split, WIKITEXT_SPLITS, "wikitext2")
        self.file = _find_wikitext_file(path, split)
        self.seq_len = int(seq_len)
        try:
            words: list[str] = []
            with open(self.file, encoding="utf-8") as f:
                for line in f:
                    line_words = line.split()
                    if line_words:
                        words.extend(line_words)
                        words.append(EOS)
        except UnicodeDecodeError as err:
            raise ValueError(f"corrupt WikiText-2 file {self.file}: not UTF-8 text ({err})") from err
        if not words:
            raise ValueError(f"corrupt WikiText-2 file {self.file}: it contains no tokens")
        self.vocab = build_vocab(words, vocab_size)
        ids = {word: index for index, word in enumerate(self.vocab)}
        self.tokens = np.fromiter((ids.get(word, 0) for word in words), dtype=np.int64, count=len(words))
        self.num_windows = (len(self.tokens) - 1) // self.seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"WikiText-2 file {self.file} has {len(self.tokens)} tokens, too few for one window "
                f"of seq_len + 1 = {self.seq_len + 1}"
            )

    def __len__(self) -> int:
        return self.num_windows

    def batch(self, step: int, start: int, stop: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (inputs int64 (n,S), targets int64 (n,S)) for samples [start, stop)."""
        check_slice(start, stop, global_batch)
        windows = (step * global_batch + np.arange(start, stop, dtype=np.int64)) % self.num_windows
        index = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)
        chunk = torch.from_numpy(self.tokens[index])
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
