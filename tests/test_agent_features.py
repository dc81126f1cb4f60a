import logging

import numpy as np
import pytest

from edge_agent.features import FeatureCache, LoggedProgress, fingerprint
from export.runtime import BackboneRuntime


class Counting:
    def __init__(self, dim: int = 3) -> None:
        self.calls = 0
        self.dim = dim

    def __call__(self, images: np.ndarray) -> np.ndarray:
        self.calls += len(images)
        return np.repeat(
            images.reshape(len(images), -1).mean(axis=1, keepdims=True), self.dim, axis=1
        )


def test_fingerprint_sees_data_shape_and_labels():
    a = np.zeros((2, 3, 4, 4), np.float32)
    b = a.copy()
    b[1, 2, 3, 3] = 1e-6
    assert fingerprint(a) == fingerprint(a.copy())
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) != fingerprint(a.reshape(1, 6, 4, 4))
    assert fingerprint(a, np.array([0, 1])) != fingerprint(a, np.array([1, 0]))


def test_second_call_and_a_new_process_hit_the_cache(tmp_path):
    images = np.random.default_rng(0).random((10, 3, 4, 4), dtype=np.float32)
    extract = Counting()
    first = FeatureCache(tmp_path).features("b" * 64, images, extract, dim=3, batch=4)
    assert extract.calls == 10
    again = FeatureCache(tmp_path).features("b" * 64, images, extract, dim=3)
    assert extract.calls == 10  # no backbone work
    np.testing.assert_array_equal(first, again)
    assert not again.flags.writeable
    assert [e["shape"] for e in FeatureCache(tmp_path).entries()] == [[10, 3]]


def test_reading_a_cache_creates_nothing(tmp_path):
    cache = FeatureCache(tmp_path / "cache")
    assert cache.entries() == [] and cache.drop_unserved() == []
    assert not (tmp_path / "cache").exists()  # `edge-agent status` leaves no folder behind
    cache.features("b" * 64, np.ones((2, 3, 2, 2), np.float32), Counting(), dim=3)
    assert len(cache.entries()) == 1


def test_a_new_bundle_invalidates_the_old_entries(tmp_path):
    images = np.ones((4, 3, 2, 2), np.float32)
    cache = FeatureCache(tmp_path)
    cache.features("a" * 64, images, Counting(), dim=3)
    extract = Counting()
    cache.features("c" * 64, images, extract, dim=3)
    assert extract.calls == 4
    assert [e["bundle"] for e in cache.entries()] == ["c" * 16]


def test_an_interrupted_write_leaves_no_entry(tmp_path):
    def broken(images: np.ndarray) -> np.ndarray:
        raise RuntimeError("power cut")

    with pytest.raises(RuntimeError):
        FeatureCache(tmp_path).features("a" * 64, np.ones((4, 3, 2, 2), np.float32), broken, dim=3)
    assert FeatureCache(tmp_path).entries() == []


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b"",  # emptied
        lambda b: b[: len(b) // 2],  # cut short mid-data
        lambda b: b[:20],  # cut short mid-header
        lambda b: b"not an array at all",
    ],
    ids=["empty", "half", "header", "garbage"],
)
def test_a_damaged_entry_is_recomputed_and_shown_as_damaged(tmp_path, damage):
    images = np.random.default_rng(1).random((6, 3, 4, 4), dtype=np.float32)
    first = np.array(FeatureCache(tmp_path).features("b" * 64, images, Counting(), dim=3))
    entry = next(tmp_path.glob("*.npy"))
    keys = entry.with_suffix(".keys")

    def spoil() -> None:
        entry.write_bytes(damage(entry.read_bytes()))
        keys.write_bytes(damage(keys.read_bytes()))

    spoil()
    assert [e["shape"] for e in FeatureCache(tmp_path).entries()] == [None]
    extract = Counting()
    again = FeatureCache(tmp_path).features("b" * 64, images, extract, dim=3)
    assert extract.calls == 6  # replaced, not served
    np.testing.assert_array_equal(again, first)
    assert [e["shape"] for e in FeatureCache(tmp_path).entries()] == [[6, 3]]

    # A grown data set asks a damaged entry for its rows: it has none to lend.
    spoil()
    extract = Counting()
    grown = np.concatenate([images, images[:1] + 1])
    FeatureCache(tmp_path).features("b" * 64, grown, extract, dim=3)
    assert extract.calls == 7


def test_cache_with_the_real_runtime(small_zoo, tmp_path):
    runtime = BackboneRuntime(small_zoo)
    images = np.random.default_rng(1).random((12, 3, 32, 32), dtype=np.float32)
    cache = FeatureCache(tmp_path)
    feats = cache.features(runtime.bundle.id, images, runtime.extract, dim=runtime.feature_dim)
    assert feats.shape == (12, runtime.feature_dim) and runtime.samples_processed == 12
    again = cache.features(runtime.bundle.id, images, runtime.extract, dim=runtime.feature_dim)
    assert runtime.samples_processed == 12
    np.testing.assert_allclose(again, runtime.extract(images[:12]), rtol=1e-5, atol=1e-5)


def test_a_changed_data_set_runs_the_backbones_on_its_new_samples_only(tmp_path):
    rng = np.random.default_rng(2)
    seen = rng.random((10, 3, 4, 4), dtype=np.float32)
    cache = FeatureCache(tmp_path)
    cache.features("b" * 64, seen, Counting(), dim=3, labels=np.arange(10) % 2)
    # A day later: two samples deleted, five collected, the order changed.
    new = rng.random((5, 3, 4, 4), dtype=np.float32)
    grown = np.concatenate([seen[[7, 0, 3, 9, 1, 2, 8, 4]], new])[rng.permutation(13)]
    later, extract = FeatureCache(tmp_path), Counting()
    feats = later.features("b" * 64, grown, extract, dim=3)
    assert extract.calls == 5
    np.testing.assert_array_equal(feats, Counting()(grown))
    assert len(later.entries()) == 2  # until the agent says which entries it still uses
    assert later.drop_unserved() != [] and [e["shape"] for e in later.entries()] == [[13, 3]]
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".keys", ".npy"]


def test_relabelled_data_reuses_every_row(tmp_path):
    images = np.random.default_rng(3).random((6, 3, 4, 4), dtype=np.float32)
    cache, extract = FeatureCache(tmp_path), Counting()
    cache.features("b" * 64, images, extract, dim=3, labels=np.zeros(6, np.int64))
    again = cache.features("b" * 64, images, extract, dim=3, labels=np.ones(6, np.int64))
    assert extract.calls == 6  # the first pass only
    np.testing.assert_array_equal(again, Counting()(images))


def test_rows_of_another_bundle_are_never_borrowed(tmp_path):
    images = np.random.default_rng(4).random((6, 3, 4, 4), dtype=np.float32)
    FeatureCache(tmp_path).features("a" * 64, images, Counting(), dim=3)
    extract = Counting()
    FeatureCache(tmp_path).features("c" * 64, images[:4], extract, dim=3)
    assert extract.calls == 4


def test_a_shared_cache_neither_borrows_nor_prunes_other_data(tmp_path):
    rng = np.random.default_rng(5)
    mine, theirs = rng.random((2, 6, 3, 4, 4), dtype=np.float32)
    FeatureCache(tmp_path, shared=True).features("b" * 64, theirs, Counting(), dim=3)
    shared, extract = FeatureCache(tmp_path, shared=True), Counting()
    shared.features("b" * 64, np.concatenate([mine, theirs[:2]]), extract, dim=3)
    assert extract.calls == 8
    with pytest.raises(RuntimeError, match="shared"):
        shared.drop_unserved()
    assert len(shared.entries()) == 2


def test_drop_unserved_clears_what_a_crash_left(tmp_path):
    cache = FeatureCache(tmp_path)
    cache.features("b" * 64, np.ones((2, 3, 2, 2), np.float32), Counting(), dim=3)
    (tmp_path / "x.npy.partial").write_bytes(b"half")
    (tmp_path / "gone.keys").write_bytes(b"orphan")
    cache.drop_unserved()
    assert len(cache.entries()) == 1
    assert not (tmp_path / "x.npy.partial").exists() and not (tmp_path / "gone.keys").exists()


def test_progress_is_logged_for_a_long_backbone_pass(caplog):
    progress = LoggedProgress(logging.getLogger("t"), what="training data", total=10, every_s=0)
    with caplog.at_level(logging.INFO, logger="t"):
        progress.update(4)
    assert "training data: backbones ran on 4 of 10 samples" in caplog.text
