"""Character-level data from the documentation text shipped with Python (no download).

The corpus is Python 3.11's `pydoc_data.topics.topics`, its values joined in sorted-key order,
stored next to this file as ``corpus.txt.xz`` (95 kB; 464,970 characters, 103 distinct). Each
Python release ships a different revision of that text (3.12's is 492,155 characters, 3.13's
510,586), so the copy keeps the text, and with a given JAX version the numbers the main job
prints, the same whichever Python runs it. `python_docs_text` gives the running Python's own
text. The last `val_fraction` is held out.
Training batches are a pure function of ``(seed, step)``: a run resumed at step ``s`` sees
exactly the batches an uninterrupted run would have seen from step ``s`` on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import lzma
import math
import pathlib

import numpy as np

CORPUS_PATH = pathlib.Path(__file__).with_name("corpus.txt.xz")
CORPUS_SHA256 = "37d06970fc926e60c16dff401e441b84752446a36b6b64516c229fdec77e992c"


def python_docs_text() -> str:
    """The running Python's documentation topics, joined in sorted-key order.

    ``corpus.txt.xz`` was written from Python 3.11.7 with
    ``lzma.compress(python_docs_text().encode(), preset=9)``.
    """
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


def load_corpus() -> str:
    """The stored corpus (Python 3.11's documentation topics), checked against its hash."""
    data = lzma.decompress(CORPUS_PATH.read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(f"{CORPUS_PATH} is damaged: sha256 {digest}, expected {CORPUS_SHA256}")
    return data.decode()


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Token ids of the train and validation splits and the character vocabulary."""

    vocab: str
    train: np.ndarray  # int32 token ids
    val: np.ndarray  # int32 token ids

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.vocab)}
        return np.array([index[c] for c in text], dtype=np.int32)

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def make_dataset(val_fraction: float = 0.1, text: str | None = None) -> Dataset:
    """Splits the corpus (or `text`) into train and the last `val_fraction` for validation."""
    text = load_corpus() if text is None else text
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = np.array([index[c] for c in text], dtype=np.int32)
    split = int(len(ids) * (1.0 - val_fraction))
    return Dataset(vocab=vocab, train=ids[:split], val=ids[split:])


def unigram_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats/char) on `val` of the train split's character frequencies.

    This is the loss of a model that ignores context; a language model must beat it. Counts
    are add-one smoothed so characters unseen in training have a finite cost.
    """
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[val].mean())


def train_batch(train: np.ndarray, seed: int, step: int, batch_size: int, seq_len: int):
    """The training batch of `step`: `batch_size` random windows, inputs and next-char targets.

    Returns:
        ``(inputs, targets)``, int32 arrays of shape ``(batch_size, seq_len)``.
    """
    rng = np.random.default_rng((seed, step))
    starts = rng.integers(0, len(train) - seq_len - 1, size=batch_size)
    windows = train[starts[:, None] + np.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


def eval_batches(val: np.ndarray, num_batches: int, batch_size: int, seq_len: int):
    """A fixed list of validation batches: windows spread evenly over the validation split."""
    count = num_batches * batch_size
    last = len(val) - seq_len - 1
    if last < 0:
        raise ValueError(f"the validation split ({len(val)} chars) is shorter than seq_len.")
    starts = np.linspace(0, last, num=count).astype(np.int64)
    windows = val[starts[:, None] + np.arange(seq_len + 1)]
    windows = windows.reshape(num_batches, batch_size, seq_len + 1)
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def bits(nats: float) -> float:
    return nats / math.log(2.0)
