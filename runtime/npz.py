"""Reading a user's .npz archive, with one clear error for every way the file can be wrong.

numpy reports a text file as "pickled data", raises ``zipfile.BadZipFile`` (not a
``ValueError``) for a truncated archive, returns a bare array for an .npy renamed .npz, and
defers some errors to the first access of a member. Every command that takes an .npz from
a user reads it here, all members at once, so none of those reaches the user as a traceback.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


class NpzError(ValueError):
    """The file is missing, is not an .npz archive, or lacks an array the caller needs."""


def read_npz(path: Path, *, required: Sequence[str] = ()) -> dict[str, np.ndarray[Any, Any]]:
    """Every array of the archive at ``path`` by name; ``required`` names must be present."""
    if not path.is_file():
        raise NpzError(f"{path}: file not found")
    try:
        loaded = np.load(path, allow_pickle=False)
    except ValueError:  # neither zip nor .npy: numpy's message speaks of pickles
        raise NpzError(f"{path}: not an .npz archive") from None
    except (OSError, zipfile.BadZipFile) as exc:
        raise NpzError(f"{path}: not a readable .npz archive ({exc})") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise NpzError(f"{path}: a single .npy array, not an .npz archive (save with numpy.savez)")
    with loaded:
        missing = [name for name in required if name not in loaded.files]
        if missing:
            raise NpzError(
                f"{path}: needs arrays {', '.join(missing)}; has {', '.join(loaded.files) or 'none'}"
            )
        arrays = {}
        for name in loaded.files:
            try:
                arrays[name] = loaded[name]
            except ValueError as exc:  # an object array: refused without pickle
                raise NpzError(f"{path}: array {name!r} cannot be read: {exc}") from None
            except (OSError, zipfile.BadZipFile, zlib.error, EOFError) as exc:
                raise NpzError(f"{path}: array {name!r} is corrupt ({exc})") from None
    return arrays
