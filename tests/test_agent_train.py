import numpy as np
import pytest
import torch

from edge_agent.head import predict
from edge_agent.train import (
    LOSSES,
    Guidance,
    LocalModel,
    TrainConfig,
    embed,
    loss_for,
    make_optimiser,
    prototypes_of,
    train_round,
)
from tests import factories


def blobs(n: int, seed: int, *, classes: int = 4, dim: int = 20):
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(size=(classes, dim)) * 2
    y = rng.integers(0, classes, size=n)
    return (centres[y] + rng.normal(size=(n, dim))).astype(np.float32), y


@pytest.mark.parametrize("method", sorted(LOSSES))
def test_every_method_learns_separable_features(method):
    torch.manual_seed(0)
    cfg = TrainConfig(out_dim=16, epochs=2)
    x, y = blobs(256, 1)
    xt, yt = blobs(256, 2)
    model = LocalModel(in_dim=20, num_classes=4, cfg=cfg, dual=method == "feddbp")
    opt = make_optimiser(model, cfg)
    guidance = Guidance.empty(4, 16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        metrics = train_round(
            model, opt, x, y, method=method, guidance=guidance, cfg=cfg, generator=gen
        )
        protos, counts = prototypes_of(model, x, y, 4)
        present = torch.from_numpy(counts > 0)
        guidance = Guidance(
            global_protos=torch.from_numpy(protos),
            global_present=present,
            local_sets=torch.from_numpy(protos)[None],
            local_present=present[None],
        )
    assert metrics.samples == 256 and metrics.steps == 2 * 8 and np.isfinite(metrics.loss)
    z, _ = embed(model, xt)
    pred, _ = predict(torch.from_numpy(z), torch.from_numpy(protos), present)
    assert (pred.numpy() == yt).mean() > 0.9


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="no local objective for method 'fedsgd'"):
        loss_for("fedsgd")


def test_guidance_scatters_announced_rows_into_class_slots():
    ann = factories.announcement()  # classes zero, one, two; globals for 0 and 2; dim 4
    g = Guidance.from_announcement(ann, client="jetson-01", dim=4)
    assert g.global_present.tolist() == [True, False, True]
    torch.testing.assert_close(
        g.global_protos[2], torch.from_numpy(ann.global_prototypes[1].astype(np.float32))
    )
    assert g.local_sets.shape == (2, 3, 4) and g.local_present[:, 1].tolist() == [False, False]
    # another head size: ignored rather than crashing training
    assert not Guidance.from_announcement(ann, client="x", dim=8).has_globals


def test_config_is_checked():
    with pytest.raises(ValueError):
        TrainConfig(batch_size=1)
