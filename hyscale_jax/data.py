"""Training data that needs no download, generated on the fly in a seeded, resumable order.

Two sources, both byte-level (vocabulary 256):
  * "text": windows of the Python standard library's own source files (every machine with
    Python has them).
  * "retrieval": multi-query key-value retrieval over long distractor context. The context is
    filler (stdlib text with bytes >= 128 folded to '?', or uniform printable bytes) with
    `n_pairs` needles (key byte, value byte; `n_keys` and `n_values` of them to draw from)
    dropped at random positions; the sequence ends with a query section
        QUERY_MARK k_1 v_1 k_2 v_2 ...
    asking `n_queries` of the keys. Predicting v_i at the query key k_i needs the one earlier
    position holding k_i: the indexer must select that needle out of T keys. With one needle
    (passkey retrieval) finding it is enough; with several the model must also match the key
    (docs/training.md).

Every example is a pure function of (seed, source, example index), example index
`step * batch_size + row`: a run resumed at step n sees exactly the batches it would have seen.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import sysconfig
from pathlib import Path

import numpy as np

KEY_TOKENS = np.arange(128, 192)  # needle keys
VALUE_TOKENS = np.arange(192, 256)  # needle values
QUERY_MARK = 1  # starts the query section (never in the filler)
_FILLER_FOLD = ord("?")  # filler bytes outside printable ASCII fold to this
_SOURCES = ("retrieval", "text")
_FILLERS = ("text", "random")
_RANDOM_FILLER = np.arange(32, 127)  # printable ASCII: never a key, value or QUERY_MARK
_SALT = {"retrieval": 0x5E7, "text": 0x7E47}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    kind: str = "retrieval"  # "retrieval" (needles in filler) | "text" (plain byte-level LM)
    seed: int = 0  # data seed: with the step, fixes every example
    n_pairs: int = 8  # needles (key-value pairs) per retrieval sequence
    n_queries: int = 8  # queries per retrieval sequence (<= n_pairs)
    filler: str = "text"  # retrieval context: "text" (stdlib source) | "random" (uniform bytes)
    n_keys: int = 64  # key vocabulary: the first n_keys of KEY_TOKENS (>= n_pairs)
    n_values: int = 64  # value vocabulary: the first n_values of VALUE_TOKENS (chance 1/n_values)
    corpus_bytes: int = 16 * 2**20  # how much stdlib source to read (sorted by path)
    answer_weight: float = 1.0  # LM-loss weight of the retrieved values (other targets: 1)

    def __post_init__(self):
        if self.kind not in _SOURCES:
            raise ValueError(f"DataConfig.kind={self.kind!r} is not one of {_SOURCES}")
        if self.filler not in _FILLERS:
            raise ValueError(f"DataConfig.filler={self.filler!r} is not one of {_FILLERS}")
        if not 1 <= self.n_keys <= len(KEY_TOKENS):
            raise ValueError(
                f"DataConfig.n_keys must be in [1, {len(KEY_TOKENS)}]; got {self.n_keys}"
            )
        if not 1 <= self.n_values <= len(VALUE_TOKENS):
            raise ValueError(
                f"DataConfig.n_values must be in [1, {len(VALUE_TOKENS)}]; got {self.n_values}"
            )
        if not 1 <= self.n_pairs <= self.n_keys:
            raise ValueError(
                f"DataConfig.n_pairs must be in [1, n_keys={self.n_keys}] (keys are distinct); "
                f"got {self.n_pairs}"
            )
        if not 1 <= self.n_queries <= self.n_pairs:
            raise ValueError(
                f"DataConfig.n_queries must be in [1, n_pairs={self.n_pairs}]; got {self.n_queries}"
            )

    def min_seq_len(self) -> int:
        """Shortest sequence a retrieval example fits in (needles, queries and some filler)."""
        return 4 * self.n_pairs + 2 * self.n_queries + 2


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 16 * 2**20) -> np.ndarray:
    """The Python standard library's .py sources, sorted by path, concatenated: uint8 [N]."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if total >= max_bytes:
            break
    if total < 4096:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def corpus_fingerprint(corpus: np.ndarray) -> str:
    """Short hash of the corpus (stdlib sources differ across Python versions)."""
    return hashlib.sha256(corpus.tobytes()).hexdigest()[:16]


class Dataset:
    """Batches as a pure function of the step.

    `batch(step, batch_size, seq_len)` returns numpy arrays:
      tokens      int32 [B, T + 1]  inputs are tokens[:, :-1], targets tokens[:, 1:]
      loss_mask   f32   [B, T]      weight of each target in the LM loss (answer_weight at
                                    the retrieved values, 1 elsewhere)
      query_pos   int32 [B, Q]      input positions of the query keys (their targets are the
                                    values to retrieve); Q = n_queries, or 0 for text
      needle_pos  int32 [B, Q]      context position of each queried key (its value sits at
                                    needle_pos + 1)
      blind_acc   f32   [B, Q]      chance that a guess blind to the query key is right: the
                                    value of a needle not asked yet, drawn uniformly (what the
                                    values in the context alone give away)
    """

    def __init__(self, config: DataConfig, corpus: np.ndarray | None = None):
        self.config = config
        self.corpus = stdlib_corpus(config.corpus_bytes) if corpus is None else corpus
        filler = self.corpus.copy()
        filler[(filler < 32) & (filler != 10)] = _FILLER_FOLD
        filler[filler >= 128] = _FILLER_FOLD
        self._filler = filler
        self.fingerprint = corpus_fingerprint(self.corpus)

    def _rng(self, source: str, index: int) -> np.random.Generator:
        return np.random.default_rng([self.config.seed, _SALT[source], index])

    def _window(self, array: np.ndarray, rng: np.random.Generator, length: int) -> np.ndarray:
        if len(array) >= length:
            start = int(rng.integers(0, len(array) - length + 1))
            return array[start : start + length]
        reps = -(-length // len(array))
        return np.tile(array, reps)[:length]

    def text_example(self, index: int, seq_len: int) -> dict[str, np.ndarray]:
        tokens = self._window(self.corpus, self._rng("text", index), seq_len + 1)
        return {
            "tokens": tokens.astype(np.int32),
            "loss_mask": np.ones(seq_len, np.float32),
            "query_pos": np.zeros(0, np.int32),
            "needle_pos": np.zeros(0, np.int32),
            "blind_acc": np.zeros(0, np.float32),
        }

    def retrieval_example(self, index: int, seq_len: int) -> dict[str, np.ndarray]:
        cfg = self.config
        if seq_len < cfg.min_seq_len():
            raise ValueError(
                f"seq_len={seq_len} is too short for {cfg.n_pairs} needles and "
                f"{cfg.n_queries} queries (need >= {cfg.min_seq_len()})"
            )
        rng = self._rng("retrieval", index)
        if cfg.filler == "text":
            tokens = self._window(self._filler, rng, seq_len + 1).astype(np.int32)
        else:
            tokens = rng.choice(_RANDOM_FILLER, seq_len + 1).astype(np.int32)
        query_len = 1 + 2 * cfg.n_queries
        context = seq_len + 1 - query_len
        keys = rng.choice(KEY_TOKENS[: cfg.n_keys], cfg.n_pairs, replace=False)
        # Distinct values while there are enough: the values present then say as little as
        # possible about which one a query asks for (n_pairs = n_values: nothing).
        values = rng.choice(
            VALUE_TOKENS[: cfg.n_values], cfg.n_pairs, replace=cfg.n_pairs > cfg.n_values
        )
        # Needles on even slots so no two overlap; anywhere in the context, near or far.
        key_pos = 2 * np.sort(rng.choice(context // 2, cfg.n_pairs, replace=False))
        tokens[key_pos] = keys
        tokens[key_pos + 1] = values
        asked = rng.choice(cfg.n_pairs, cfg.n_queries, replace=False)
        q0 = context
        tokens[q0] = QUERY_MARK
        query_key_pos = q0 + 1 + 2 * np.arange(cfg.n_queries)
        tokens[query_key_pos] = keys[asked]
        tokens[query_key_pos + 1] = values[asked]
        loss_mask = np.ones(seq_len, np.float32)
        loss_mask[query_key_pos] = cfg.answer_weight
        # Key-blind guess: the value of a needle not asked yet, drawn uniformly.
        blind = [
            np.mean(np.delete(values, asked[:j]) == values[asked[j]]) for j in range(cfg.n_queries)
        ]
        return {
            "tokens": tokens,
            "loss_mask": loss_mask,
            "query_pos": query_key_pos.astype(np.int32),
            "needle_pos": key_pos[asked].astype(np.int32),
            "blind_acc": np.asarray(blind, np.float32),
        }

    def batch(self, step: int, batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
        make = self.retrieval_example if self.config.kind == "retrieval" else self.text_example
        rows = [make(step * batch_size + r, seq_len) for r in range(batch_size)]
        return {name: np.stack([row[name] for row in rows]) for name in rows[0]}

    def batches(self, start_step: int, batch_size: int, seq_len: int):
        """Infinite iterator from `start_step` (resuming is starting at the saved step)."""
        step = start_step
        while True:
            yield self.batch(step, batch_size, seq_len)
            step += 1
