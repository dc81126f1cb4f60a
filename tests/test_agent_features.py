import numpy as np
import pytest

from edge_agent.features import FeatureCache, fingerprint
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


def test_cache_with_the_real_runtime(small_zoo, tmp_path):
    runtime = BackboneRuntime(small_zoo)
    images = np.random.default_rng(1).random((12, 3, 32, 32), dtype=np.float32)
    cache = FeatureCache(tmp_path)
    feats = cache.features(runtime.bundle.id, images, runtime.extract, dim=runtime.feature_dim)
    assert feats.shape == (12, runtime.feature_dim) and runtime.samples_processed == 12
    again = cache.features(runtime.bundle.id, images, runtime.extract, dim=runtime.feature_dim)
    assert runtime.samples_processed == 12
    np.testing.assert_allclose(again, runtime.extract(images[:12]), rtol=1e-5, atol=1e-5)
