"""Where a simulated fleet's clients come from: digits-5 in its non-IID settings, an .npz,
image folders, and the rendered glyphs-5."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fleet.cli.main import build_parser
from fleet.data import glyphs
from fleet.data import partition as part
from runtime.cliutil import UsageError


def test_dirichlet_counts_sum_and_concentrate() -> None:
    rng = np.random.default_rng(0)
    counts = part.dirichlet_label_counts(100, 10, 0.1, rng)
    assert counts.sum() == 100 and counts.shape == (10,)
    top_share = lambda alpha: np.mean(  # noqa: E731
        [part.dirichlet_label_counts(100, 10, alpha, rng).max() / 100 for _ in range(200)]
    )
    # Small alpha: most of a client's data in one class; large alpha: close to 1/10 each.
    assert top_share(0.1) > 0.5 > 0.2 > top_share(100.0)


def test_digits5_splits_are_deterministic_and_shaped_as_asked() -> None:
    a = part.digits5(clients=6, split="feature", seed=3, train=30, test=10)
    b = part.digits5(clients=6, split="feature", seed=3, train=30, test=10)
    c = part.digits5(clients=6, split="feature", seed=4, train=30, test=10)
    assert [x.domain for x in a.clients] == [*part.DOMAINS, part.DOMAINS[0]]
    for x, y in zip(a.clients, b.clients, strict=True):
        np.testing.assert_array_equal(x.train_x, y.train_x)
        np.testing.assert_array_equal(x.test_y, y.test_y)
    assert not np.array_equal(a.clients[0].train_x, c.clients[0].train_x)
    first = a.clients[0]
    assert first.train_x.shape == (30, 3, 32, 32) and first.train_x.dtype == np.uint8
    assert len(first.test_y) == 10

    label = part.digits5(clients=4, split="label", seed=0, train=60, test=20, alpha=0.1)
    assert {x.domain for x in label.clients} == {"clean"}
    # Dirichlet(0.1): each client's labels concentrate on few classes.
    assert all(np.bincount(x.train_y, minlength=10).max() >= 20 for x in label.clients)
    both = part.digits5(clients=5, split="feature-label", seed=0, train=60, test=20, alpha=0.1)
    assert [x.domain for x in both.clients] == list(part.DOMAINS)


def test_digits5_clients_never_share_a_source_digit() -> None:
    # The real Digit-5's domains are separate datasets: no client may test on a digit
    # that another client (in another style) or itself trained on.
    def sources(clients: int, split: str) -> list[tuple[set[int], set[int]]]:
        plan = part.source_plan(
            clients=clients, split=split, seed=0, train=100, test=100, alpha=0.5, domain="clean"
        )
        return [(set(a.tolist()), set(b.tolist())) for _, a, b in plan]

    seen: set[int] = set()
    for train, test in sources(5, "feature"):
        assert len(train) == 100 and len(test) == 100 and not (train | test) & seen
        seen |= train | test
    # Skewed labels or 40 clients can ask for more digits of a class than there are:
    # those are reused across clients, but a client's test digits are never its own
    # training digits.
    for clients, split in [(40, "feature"), (5, "label"), (5, "feature-label")]:
        assert all(not train & test for train, test in sources(clients, split)), split


def test_digits5_rejects_bad_arguments() -> None:
    with pytest.raises(UsageError, match="--split"):
        part.digits5(clients=2, split="iid", seed=0, train=10, test=5)
    with pytest.raises(UsageError, match="--alpha"):
        part.digits5(clients=2, split="label", seed=0, train=10, test=5, alpha=0)


def test_clients_from_an_npz(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for i in range(2):
        arrays[f"train_x_{i}"] = rng.integers(0, 255, (8, 3, 16, 16), dtype=np.uint8)
        arrays[f"train_y_{i}"] = np.arange(8) % 3
        arrays[f"test_x_{i}"] = rng.random((4, 3, 16, 16), dtype=np.float32)
        arrays[f"test_y_{i}"] = np.arange(4) % 3
    arrays["domain_1"] = np.array("sketch")
    np.savez(tmp_path / "fleet.npz", **arrays)  # type: ignore[arg-type]
    got = part.from_npz(tmp_path / "fleet.npz")
    assert [c.domain for c in got.clients] == ["client-0", "sketch"]
    assert got.classes == ("0", "1", "2")
    assert got.clients[1].test_x.dtype == np.uint8

    del arrays["test_y_1"]
    np.savez(tmp_path / "broken.npz", **arrays)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="client 1 lacks test_y_1"):
        part.from_npz(tmp_path / "broken.npz")

    # Client 2 past a missing client 1 would be silently left out.
    gap = {k: v for k, v in arrays.items() if not k.endswith("_1")}
    gap |= {k[:-1] + "2": v for k, v in arrays.items() if k.endswith("_0")}
    np.savez(tmp_path / "gap.npz", **gap)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="no train_x_1 but holds arrays of client 2"):
        part.from_npz(tmp_path / "gap.npz")

    # A client with nothing to train on (or to be scored on) is refused before any run.
    arrays["test_y_1"] = arrays["test_y_0"]
    arrays["train_x_1"], arrays["train_y_1"] = arrays["train_x_1"][:0], arrays["train_y_1"][:0]
    np.savez(tmp_path / "empty.npz", **arrays)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"client-0001 \(sketch\) has no training images"):
        part.from_npz(tmp_path / "empty.npz")


def test_clients_from_folders(tmp_path: Path) -> None:
    def image(path: Path, value: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((20, 20, 3), value, np.uint8)).save(path)

    per_client = tmp_path / "clients"
    for client in ("a", "b"):
        for split in ("train", "test"):
            for cls in ("cat", "dog"):
                image(per_client / client / split / cls / "1.png", 10)
    (per_client / "a" / "train" / "cat" / "broken.png").write_bytes(b"not a png")
    got = part.from_directory(per_client, image_size=8)
    assert got.classes == ("cat", "dog") and len(got.clients) == 2
    assert got.clients[0].train_x.shape == (2, 3, 8, 8)
    assert "1 unreadable images skipped" in got.description

    domains = tmp_path / "office"
    for dom in ("amazon", "webcam"):
        for cls in ("mug", "pen"):
            for k in range(5):
                image(domains / dom / cls / f"{k}.png", 20 * k)
    got = part.from_directory(domains, image_size=8, test_share=0.3)
    assert [c.domain for c in got.clients] == ["amazon", "webcam"]
    assert len(got.clients[0].train_y) == 7 and len(got.clients[0].test_y) == 3

    # One image in a domain: after the split it has nothing left to test on.
    image(domains / "tiny" / "mug" / "0.png", 0)
    with pytest.raises(UsageError, match=r"\(tiny\) has no test images"):
        part.from_directory(domains, image_size=8, test_share=0.3)


def test_glyphs5_is_deterministic_balanced_and_reads_back_as_clients(tmp_path: Path) -> None:
    a = glyphs.make(seed=3, train=20, test=10)
    b = glyphs.make(seed=3, train=20, test=10)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["train_x_0"], glyphs.make(seed=4, train=20, test=10)["train_x_0"])
    for i, domain in enumerate(glyphs.DOMAINS):
        assert a[f"train_x_{i}"].shape == (20, 3, 32, 32) and a[f"train_x_{i}"].dtype == np.uint8
        assert np.bincount(a[f"train_y_{i}"], minlength=10).tolist() == [2] * 10
        assert str(a[f"domain_{i}"]) == domain
    # The domains look different: mean colours per domain are far apart.
    means = [a[f"train_x_{i}"].mean() for i in range(5)]
    assert max(means) - min(means) > 20
    out = tmp_path / "g.npz"
    args = build_parser().parse_args(["glyphs", "--out", str(out), "--train", "20", "--test", "10"])
    assert glyphs.main(args) == 0
    clients = part.from_npz(out).clients
    assert [c.domain for c in clients] == list(glyphs.DOMAINS)
    assert len(clients[0].train_y) == 20 and len(clients[4].test_y) == 10
    with pytest.raises(UsageError, match="train must be at least 10"):
        glyphs.main(argparse.Namespace(out=out, seed=0, train=5, test=1))
