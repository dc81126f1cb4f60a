import numpy as np
import pytest
from PIL import Image

from edge_agent.data import DataError, load

CLASSES = ("cat", "dog", "owl")


def test_npz_in_either_layout_and_dtype(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, size=(6, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "a.npz", x=x, y=np.array(["cat", "dog", "owl", "cat", "fox", "dog"]))
    data = load(tmp_path / "a.npz", CLASSES)
    assert data.images.shape == (5, 3, 8, 8) and data.images.dtype == np.float32
    assert data.labels.tolist() == [0, 1, 2, 0, 1]
    assert data.skipped == {"unknown_label": 1}
    np.testing.assert_allclose(data.images[0], x[0].transpose(2, 0, 1) / 255.0)
    np.savez(tmp_path / "b.npz", x=np.zeros((2, 1, 4, 4), np.float32), y=np.array([0, 2]))
    b = load(tmp_path / "b.npz", CLASSES)
    assert b.images.shape == (2, 3, 4, 4) and b.labels.tolist() == [0, 2]


@pytest.mark.parametrize(
    "arrays, message",
    [
        ({"x": np.zeros((2, 4, 4))}, "needs arrays y; has x"),
        ({"x": np.zeros((2, 4, 4)), "y": np.zeros(2)}, "4-D"),
        ({"x": np.full((1, 3, 2, 2), 2.0), "y": np.zeros(1)}, r"\[0, 1\]"),
        ({"x": np.zeros((2, 3, 2, 2)), "y": np.zeros(3)}, "2 images but 3 labels"),
        (
            {"x": np.zeros((2, 3, 2, 2)), "y": np.array([0.5, 9])},
            r"none of its 2 labels is in the fleet's class list; labels are class names "
            r"\('cat', 'dog', 'owl'\) or indices 0-2, and this file holds 0.5, 9.0$",
        ),
        ({"x": np.zeros((0, 3, 2, 2)), "y": np.zeros(0)}, "no samples"),
    ],
)
def test_bad_npz_is_a_clear_error(tmp_path, arrays, message):
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(DataError, match=message):
        load(tmp_path / "bad.npz", CLASSES)


def test_folder_skips_and_counts_corrupt_images(tmp_path):
    for i, name in enumerate(CLASSES[:2]):
        (tmp_path / name).mkdir()
        Image.new("RGB", (20, 10), (i * 100, 0, 0)).save(tmp_path / name / "a.png")
    (tmp_path / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    (tmp_path / "dog" / "notes.txt").write_text("ignored")
    (tmp_path / "zebra").mkdir()
    data = load(tmp_path, CLASSES, size=16)
    assert data.images.shape == (2, 3, 16, 16)
    assert sorted(data.labels.tolist()) == [0, 1]
    assert data.skipped == {"unreadable": 1, "unknown_class_folder": 1}


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load(tmp_path / "nope", CLASSES)
    with pytest.raises(DataError, match="no class subfolders"):
        load(tmp_path, CLASSES)
