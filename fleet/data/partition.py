"""Who holds what: the clients of a simulated fleet and their private train/test data.

Three sources, one result (a list of :class:`ClientData`):

- digits-5 (built locally) split as FedPCL A.1 describes: ``feature`` (client i holds
  domain i mod 5, labels drawn uniformly), ``label`` (every client on one domain, labels
  drawn from a per-client Dirichlet(alpha)), ``feature-label`` (both);
- an ``.npz`` holding ``train_x_<i>``, ``train_y_<i>``, ``test_x_<i>``, ``test_y_<i>`` and
  optionally ``domain_<i>`` for clients i = 0..N-1;
- a directory with one image folder per client (``<client>/train/<class>/*``,
  ``<client>/test/<class>/*``), or a multi-domain dataset laid out as
  ``<domain>/<class>/*`` (Digit-5, Office-10, DomainNet), split per domain.

Every split is a pure function of its seed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.data import DataError, load_folder
from fleet.data.digits5 import CLASSES as DIGIT_CLASSES
from fleet.data.digits5 import DOMAINS, domain_data, source
from runtime.cliutil import UsageError
from runtime.npz import NpzError, read_npz

SPLITS = ("feature", "label", "feature-label")
#: 1,797 scikit-learn digits are the stroke source of every digits-5 domain.
SOURCE_SIZE = 1797


@dataclass(frozen=True)
class ClientData:
    """One client's private data: images (N, 3, H, W) uint8, labels (N,) int64."""

    name: str
    domain: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    def save(self, folder: Path) -> tuple[Path, Path]:
        """Write ``train.npz`` and ``test.npz`` for the agent; returns their paths."""
        folder.mkdir(parents=True, exist_ok=True)
        train, test = folder / "train.npz", folder / "test.npz"
        np.savez(train, x=self.train_x, y=self.train_y)
        np.savez(test, x=self.test_x, y=self.test_y)
        return train, test


@dataclass(frozen=True)
class Partition:
    clients: tuple[ClientData, ...]
    classes: tuple[str, ...]
    description: str

    def __post_init__(self) -> None:
        # Checked here, before any process starts: an agent refuses an empty data set at
        # its first round, which in a fleet would be one failure among many processes.
        for c in self.clients:
            for part, y in (("training", c.train_y), ("test", c.test_y)):
                if not len(y):
                    raise UsageError(
                        f"{c.name} ({c.domain}) has no {part} images: every client needs "
                        "both, as it trains on one and is scored on the other"
                    )


def dirichlet_label_counts(
    n: int, num_classes: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    """How many of ``n`` samples of each class one client holds: multinomial over a
    Dirichlet(alpha) draw. Small alpha concentrates a client on few classes."""
    p = rng.dirichlet(np.full(num_classes, alpha))
    return rng.multinomial(n, p)


def _pick(
    labels: np.ndarray,
    counts: np.ndarray,
    rng: np.random.Generator,
    taken: np.ndarray,
    *,
    exclude: np.ndarray | None = None,
) -> np.ndarray:
    """Indices with ``counts[c]`` samples of each class c: not in ``taken`` when
    avoidable, and not in ``exclude`` (a client's own training digits, when picking its
    test split) unless the class has no other digit."""
    allowed = np.ones(len(labels), bool)
    if exclude is not None:
        allowed[exclude] = False
    chosen = []
    for c, k in enumerate(counts):
        if k == 0:
            continue
        pool = np.flatnonzero((labels == c) & ~taken & allowed)
        if len(pool) < k:  # more asked than fresh samples: reuse (rendered anew per client)
            pool = np.flatnonzero((labels == c) & allowed)
            if len(pool) == 0:
                pool = np.flatnonzero(labels == c)
        chosen.append(rng.choice(pool, size=k, replace=len(pool) < k))
    out = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
    taken[out] = True
    return rng.permutation(out)


def source_plan(
    *, clients: int, split: str, seed: int, train: int, test: int, alpha: float, domain: str
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Per client: its domain and the source digits (indices into the 1,797) of its train
    and test split, before rendering."""
    _, labels = source()
    num_classes = len(DIGIT_CLASSES)
    # Each source digit goes to one client only, whatever the domain (as long as there
    # are enough): the real Digit-5's domains are separate datasets, so no client may
    # test on a digit another client trained on in another style. A global model would
    # otherwise have seen a fifth of every client's test digits.
    taken = np.zeros(SOURCE_SIZE, bool)
    plan = []
    for i in range(clients):
        rng = np.random.default_rng([seed, i])
        dom = DOMAINS[i % len(DOMAINS)] if split != "label" else domain
        if split == "feature":
            # Same label distribution everywhere: uniform draws over the source.
            counts_train = rng.multinomial(train, np.full(num_classes, 1 / num_classes))
        else:
            counts_train = dirichlet_label_counts(train, num_classes, alpha, rng)
        # The test split follows the client's own label distribution (a local test set).
        share = counts_train / counts_train.sum()
        counts_test = rng.multinomial(test, share)
        train_idx = _pick(labels, counts_train, rng, taken)
        test_idx = _pick(labels, counts_test, rng, taken, exclude=train_idx)
        plan.append((dom, train_idx, test_idx))
    return plan


def _check_digits5(
    *, clients: int, split: str, train: int, test: int, alpha: float, domain: str
) -> None:
    if split not in SPLITS:
        raise UsageError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if clients < 1 or train < 2 or test < 1:
        raise UsageError("need at least 1 client, 2 training and 1 test sample per client")
    if alpha <= 0:
        raise UsageError(f"--alpha must be positive, got {alpha}")
    if domain not in DOMAINS:
        raise UsageError(f"--domain must be one of {', '.join(DOMAINS)}, got {domain!r}")


def digits5_name(index: int, domain: str) -> str:
    return f"client-{index:04d}-{domain}"


def digits5_clients(
    *,
    clients: int,
    split: str,
    seed: int,
    train: int,
    test: int,
    alpha: float = 0.5,
    domain: str = "clean",
) -> list[str]:
    """The names of :func:`digits5`'s clients, in seconds rather than the minutes its
    images take to make: what a fleet's announcements weigh is known from them."""
    _check_digits5(clients=clients, split=split, train=train, test=test, alpha=alpha,
                   domain=domain)  # fmt: skip
    plan = source_plan(clients=clients, split=split, seed=seed, train=train, test=test,
                       alpha=alpha, domain=domain)  # fmt: skip
    return [digits5_name(i, dom) for i, (dom, _, _) in enumerate(plan)]


def digits5(
    *,
    clients: int,
    split: str,
    seed: int,
    train: int,
    test: int,
    alpha: float = 0.5,
    domain: str = "clean",
) -> Partition:
    """The paper's non-IID settings on digits-5 (see the module docstring)."""
    _check_digits5(clients=clients, split=split, train=train, test=test, alpha=alpha,
                   domain=domain)  # fmt: skip
    out = []
    for i, (dom, train_idx, test_idx) in enumerate(
        source_plan(clients=clients, split=split, seed=seed, train=train, test=test,
                    alpha=alpha, domain=domain)
    ):  # fmt: skip
        x_train, y_train = domain_data(dom, seed=seed * 1000 + 2 * i, indices=train_idx)
        x_test, y_test = domain_data(dom, seed=seed * 1000 + 2 * i + 1, indices=test_idx)
        out.append(
            ClientData(
                name=digits5_name(i, dom),
                domain=dom,
                train_x=_to_uint8(x_train),
                train_y=y_train,
                test_x=_to_uint8(x_test),
                test_y=y_test,
            )
        )
    desc = f"digits-5, {split} shift, {clients} clients, {train}/{test} images each, seed {seed}"
    if split != "feature":
        desc += f", Dirichlet alpha {alpha}"
    return Partition(tuple(out), DIGIT_CLASSES, desc)


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x * 255), 0, 255).astype(np.uint8)


def _as_nchw_uint8(x: np.ndarray, *, key: str) -> np.ndarray:
    if x.ndim != 4 or x.shape[1] != 3:
        raise UsageError(f"{key} must be (N, 3, H, W), got shape {x.shape}")
    if x.dtype == np.uint8:
        return x
    if np.issubdtype(x.dtype, np.floating):
        if not np.isfinite(x).all() or x.min() < 0 or x.max() > 1:
            raise UsageError(f"{key}: float images must be finite and in [0, 1]")
        return _to_uint8(x)
    raise UsageError(f"{key} must be uint8 or float32, got {x.dtype}")


_CLIENT_KEY = re.compile(r"(train_x|train_y|test_x|test_y|domain)_(\d+)")


def from_npz(path: Path) -> Partition:
    """Clients from one .npz (``train_x_<i>``, ``train_y_<i>``, ``test_x_<i>``,
    ``test_y_<i>``, optional ``domain_<i>``)."""
    try:
        data = read_npz(path)
    except NpzError as exc:
        raise UsageError(str(exc)) from None
    n = 0
    while f"train_x_{n}" in data:
        n += 1
    if n == 0:
        raise UsageError(f"{path} holds no train_x_0 (see `edge-fleet run --help`)")
    # Clients are read 0, 1, 2, ... up to the first missing number; arrays numbered past
    # a gap would be silently left out.
    stray = sorted({int(m[2]) for k in data if (m := _CLIENT_KEY.fullmatch(k)) and int(m[2]) >= n})
    if stray:
        raise UsageError(
            f"{path}: has no train_x_{n} but holds arrays of client {stray[0]}: clients must "
            f"be numbered 0 to N-1 without gaps"
        )
    clients = []
    top = 0
    for i in range(n):
        keys = [f"train_x_{i}", f"train_y_{i}", f"test_x_{i}", f"test_y_{i}"]
        missing = [k for k in keys if k not in data]
        if missing:
            raise UsageError(f"{path}: client {i} lacks {', '.join(missing)}")
        xs = [_as_nchw_uint8(data[k], key=k) for k in keys[0::2]]
        ys = [np.asarray(data[k]) for k in keys[1::2]]
        for k, x, y in zip(keys[1::2], xs, ys, strict=True):
            if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
                raise UsageError(f"{k} must be integer labels, one per image")
            if len(y) and y.min() < 0:
                raise UsageError(f"{k} holds negative labels")
            top = max(top, int(y.max()) + 1 if len(y) else 0)
        domain = str(data[f"domain_{i}"]) if f"domain_{i}" in data else f"client-{i}"
        clients.append(
            ClientData(
                name=f"client-{i:04d}",
                domain=domain,
                train_x=xs[0],
                train_y=ys[0].astype(np.int64),
                test_x=xs[1],
                test_y=ys[1].astype(np.int64),
            )
        )
    classes = tuple(str(c) for c in range(top))
    return Partition(tuple(clients), classes, f"{path.name}: {n} clients")


def from_directory(
    root: Path, *, image_size: int, test_share: float = 0.3, seed: int = 0
) -> Partition:
    """Clients from folders. ``<client>/train/<class>/*`` + ``<client>/test/<class>/*`` is
    one client per folder; ``<domain>/<class>/*`` (Digit-5, Office-10 and DomainNet as
    usually laid out) is one client per domain, split ``test_share`` for testing."""
    if not root.is_dir():
        raise UsageError(f"--data {root} is neither an .npz nor a directory")
    subdirs = sorted(p for p in root.iterdir() if p.is_dir())
    if not subdirs:
        raise UsageError(f"{root} has no client or domain folders")
    per_client = all((d / "train").is_dir() and (d / "test").is_dir() for d in subdirs)
    class_names: set[str] = set()
    for d in subdirs:
        for part in [d / "train", d / "test"] if per_client else [d]:
            class_names |= {c.name for c in part.iterdir() if c.is_dir()}
    classes = tuple(sorted(class_names))
    clients = []
    skipped = 0
    for i, d in enumerate(subdirs):
        try:
            if per_client:
                tr = load_folder(d / "train", classes, size=image_size)
                te = load_folder(d / "test", classes, size=image_size)
                train_x, train_y, test_x, test_y = tr.images, tr.labels, te.images, te.labels
                skipped += sum(tr.skipped.values()) + sum(te.skipped.values())
            else:
                all_ = load_folder(d, classes, size=image_size)
                skipped += sum(all_.skipped.values())
                order = np.random.default_rng([seed, i]).permutation(len(all_.labels))
                cut = round(len(order) * (1 - test_share))
                train_x, train_y = all_.images[order[:cut]], all_.labels[order[:cut]]
                test_x, test_y = all_.images[order[cut:]], all_.labels[order[cut:]]
        except DataError as exc:
            raise UsageError(str(exc)) from exc
        clients.append(
            ClientData(
                name=f"client-{i:04d}-{_safe(d.name)}",
                domain=d.name,
                train_x=_to_uint8(train_x),
                train_y=train_y,
                test_x=_to_uint8(test_x),
                test_y=test_y,
            )
        )
    layout = "client folders" if per_client else "domain folders"
    desc = f"{root.name}: {len(clients)} {layout}, {len(classes)} classes"
    if skipped:
        desc += f", {skipped} unreadable images skipped"
    return Partition(tuple(clients), classes, desc)


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_.-" else "_" for ch in name)[:40]
