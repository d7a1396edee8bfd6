"""The retrieval task's options: filler, key and value vocabularies, the key-blind baseline."""

from __future__ import annotations

import numpy as np
import pytest

from hyscale_jax.data import KEY_TOKENS, QUERY_MARK, VALUE_TOKENS, DataConfig, Dataset

CORPUS = np.frombuffer(b"def f(x):\n    return x + 1\n" * 64, dtype=np.uint8)


def _needles(batch, row):
    """(keys, values, filler) of a sequence's context, read back from the tokens: a key byte
    is always followed by its value byte; everything else before QUERY_MARK is filler."""
    tokens = batch["tokens"][row]
    context = tokens[: batch["query_pos"][row, 0] - 1]
    at = np.flatnonzero(np.isin(context, KEY_TOKENS))
    return context[at], context[at + 1], np.delete(context, np.r_[at, at + 1])


@pytest.mark.parametrize("filler", ["text", "random"])
def test_vocabularies_and_filler(filler):
    cfg = DataConfig(n_pairs=5, n_queries=3, n_keys=6, n_values=7, filler=filler)
    batch = Dataset(cfg, corpus=CORPUS).batch(3, 8, 61)
    for row in range(8):
        keys, values, rest = _needles(batch, row)
        assert len(keys) == 5 and len(set(keys)) == 5
        assert set(keys) <= set(KEY_TOKENS[:6]) and set(values) <= set(VALUE_TOKENS[:7])
        assert len(set(values)) == 5  # distinct while the vocabulary allows
        assert batch["tokens"][row, batch["query_pos"][row, 0] - 1] == QUERY_MARK
        # T + 1 tokens, less the query section (1 + 2 * 3) and the needles (2 * 5)
        assert len(rest) == 62 - 7 - 10 and QUERY_MARK not in rest
        if filler == "random":
            assert ((rest >= 32) & (rest < 127)).all()
        else:  # a window of the corpus
            assert set(rest.tolist()) <= set(CORPUS.tolist())


def test_blind_baseline_with_all_values_distinct():
    """n_pairs = n_values: the values present are the whole vocabulary, so a key-blind guess
    among the needles not asked yet is right 1 time in (needles left)."""
    cfg = DataConfig(n_pairs=4, n_queries=4, n_keys=4, n_values=4)
    batch = Dataset(cfg, corpus=CORPUS).batch(0, 5, 40)
    np.testing.assert_allclose(batch["blind_acc"], np.tile([1 / 4, 1 / 3, 1 / 2, 1.0], (5, 1)))


def test_blind_baseline_with_repeated_values():
    """More needles than values: a guess is right for every needle left that shares the
    answer's value. Counted here from the tokens themselves."""
    cfg = DataConfig(n_pairs=6, n_queries=4, n_keys=8, n_values=2)
    batch = Dataset(cfg, corpus=CORPUS).batch(1, 16, 64)
    assert (batch["blind_acc"] < 1).any()  # the draw exercises repeats
    for row in range(16):
        keys, values, _ = _needles(batch, row)
        value_of = dict(zip(keys.tolist(), values.tolist()))
        asked = batch["tokens"][row, batch["query_pos"][row]].tolist()
        for j, key in enumerate(asked):
            left = [value_of[k] for k in keys.tolist() if k not in asked[:j]]
            expected = left.count(value_of[key]) / len(left)
            assert batch["blind_acc"][row, j] == pytest.approx(expected), (row, j)


def test_text_batches_have_no_baseline():
    batch = Dataset(DataConfig(kind="text"), corpus=CORPUS).batch(0, 2, 32)
    assert batch["blind_acc"].shape == (2, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(filler="noise"), "filler"),
        (dict(n_keys=0), "n_keys"),
        (dict(n_keys=65), "n_keys"),
        (dict(n_values=0), "n_values"),
        (dict(n_values=65), "n_values"),
        (dict(n_pairs=5, n_queries=1, n_keys=4), "n_pairs"),
    ],
)
def test_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)
