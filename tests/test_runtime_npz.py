"""Reading a user's .npz: every way the file can be wrong is one NpzError naming it."""

from pathlib import Path

import numpy as np
import pytest

from runtime.npz import NpzError, read_npz


def test_reads_every_array(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=np.arange(6).reshape(2, 3), y=np.array([1, 2]))
    got = read_npz(tmp_path / "a.npz", required=("x", "y"))
    assert sorted(got) == ["x", "y"]
    assert got["x"].tolist() == [[0, 1, 2], [3, 4, 5]] and got["y"].tolist() == [1, 2]


def _truncated(path: Path) -> None:
    np.savez_compressed(path, x=np.random.default_rng(0).random((64, 64)))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _npy_renamed(path: Path) -> None:
    with path.open("wb") as handle:
        np.save(handle, np.zeros(3))


def _objects(path: Path) -> None:
    np.savez(path, x=np.array([{"a": 1}], dtype=object))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: None, "file not found"),
        (lambda p: p.write_text("hello"), r"not an \.npz archive$"),
        (_truncated, "not a readable .npz archive"),
        (_npy_renamed, "a single .npy array"),
        (_objects, "array 'x' cannot be read"),
        (lambda p: np.savez(p, y=np.zeros(2)), "needs arrays x; has y"),
    ],
)
def test_bad_files_are_one_clear_error(tmp_path: Path, make, message) -> None:
    path = tmp_path / "bad.npz"
    make(path)
    with pytest.raises(NpzError, match=message):
        read_npz(path, required=("x",))
