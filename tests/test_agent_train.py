import numpy as np
import pytest
import torch
from opacus import GradSampleModule

from edge_agent.head import InputMajorLinear
from edge_agent.inference import nearest_by_cosine
from edge_agent.privacy.dpsgd import _register_grad_samplers
from edge_agent.train import (
    LOSSES,
    Guidance,
    LocalModel,
    embed,
    loss_for,
    make_optimiser,
    prototypes_of,
    train_round,
)
from edge_agent.train_config import TrainConfig
from tests import factories


def blobs(n: int, seed: int, *, classes: int = 4, dim: int = 20):
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(size=(classes, dim)) * 2
    y = rng.integers(0, classes, size=n)
    return (centres[y] + rng.normal(size=(n, dim))).astype(np.float32), y


@pytest.mark.slow
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
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []  # freed
    z, _ = embed(model, xt)
    assert (nearest_by_cosine(z, protos, counts > 0).classes == yt).mean() > 0.9


def test_bounded_classifier_logits_by_hand():
    # W z = (3, -1, 4): ReLU gives (3, 0, 4), L2 normalisation (0.6, 0, 0.8).
    model = LocalModel(in_dim=4, num_classes=3, cfg=TrainConfig(out_dim=2, classifier="bounded"))
    with torch.no_grad():
        model.classifier.weight.copy_(torch.tensor([[3.0, 0.0], [-1.0, 0.0], [4.0, 0.0]]))
        model.classifier.bias.zero_()
    z = torch.tensor([[1.0, 0.0]])
    assert torch.allclose(model.logits(z), torch.tensor([[0.6, 0.0, 0.8]]))
    linear = LocalModel(in_dim=4, num_classes=3, cfg=TrainConfig(out_dim=2))
    linear.classifier.load_state_dict(model.classifier.state_dict())
    assert torch.allclose(linear.logits(z), torch.tensor([[3.0, -1.0, 4.0]]))
    # The state dict, which FedAvg averages and the state folder keeps, is the Linear's.
    assert set(model.state_dict()) == set(linear.state_dict())


@pytest.mark.parametrize("method", ["solo", "feddbp"])
def test_a_bounded_classifier_still_learns(method):
    torch.manual_seed(0)
    cfg = TrainConfig(out_dim=16, epochs=2, classifier="bounded")
    x, y = blobs(256, 1)
    xt, yt = blobs(256, 2)
    model = LocalModel(in_dim=20, num_classes=4, cfg=cfg, dual=method == "feddbp")
    opt = make_optimiser(model, cfg)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        train_round(
            model, opt, x, y, method=method, guidance=Guidance.empty(4, 16), cfg=cfg,
            generator=gen,
        )  # fmt: skip
    _, logits = embed(model, xt)
    assert (logits.argmax(1) == yt).mean() > 0.9


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


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"batch_size": 1}, "batch_size >= 2"),
        ({"tau": 0.0}, "tau and fpl_tau must be positive"),
        ({"out_dim": 0}, "out_dim must be positive, got 0"),
        ({"weight_decay": -1e-4, "dbp_lambda2": -1.0}, "weight_decay, dbp_lambda2 must not be"),
    ],
)
def test_config_is_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**bad)


def test_input_major_linear_is_nn_linear_with_a_transposed_weight():
    torch.manual_seed(3)
    reference = torch.nn.Linear(6, 4)
    torch.manual_seed(3)
    layer = InputMajorLinear(6, 4)  # the same initialisation from the same seed
    x = torch.randn(5, 6)
    assert torch.equal(layer.state_dict()["weight"], reference.weight.detach())
    assert torch.allclose(layer(x), reference(x), atol=1e-6)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert layer.weight_t.grad is not None and reference.weight.grad is not None
    assert torch.allclose(layer.weight_t.grad.t(), reference.weight.grad, atol=1e-5)
    # The point of the layout: the gradient arrives contiguous in (in, out).
    assert layer.weight_t.grad.shape == (6, 4) and layer.weight_t.grad.is_contiguous()

    other = InputMajorLinear(6, 4)
    other.load_state_dict(reference.state_dict())  # nn.Linear's state dict loads
    assert torch.allclose(other(x), reference(x), atol=1e-6)
    with pytest.raises(RuntimeError, match=r"size mismatch for weight.*\(4, 5\).*\(4, 6\)"):
        other.load_state_dict({"weight": torch.zeros(4, 5), "bias": torch.zeros(4)})
    with pytest.raises(RuntimeError, match=r'Missing key.*"weight"'):
        other.load_state_dict({"bias": torch.zeros(4)})


def test_input_major_linear_per_sample_gradients_match_one_backward_per_sample():
    _register_grad_samplers()
    assert GradSampleModule.GRAD_SAMPLERS.get(InputMajorLinear) is not None  # not vmap's
    torch.manual_seed(0)
    layer = InputMajorLinear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)  # (Opacus's hooks warn on inputs without)
    wrapped = GradSampleModule(layer, loss_reduction="sum", force_functorch=False)
    wrapped(x).tanh().sum().backward()
    # Opacus leaves each parameter's per-sample gradients in its ``grad_sample``.
    per_weight, per_bias = (vars(p)["grad_sample"] for p in (layer.weight_t, layer.bias))
    for i in range(len(x)):
        single = InputMajorLinear(3, 2)
        single.load_state_dict(layer.state_dict())
        single(x[i : i + 1].detach()).tanh().sum().backward()
        assert single.weight_t.grad is not None and single.bias.grad is not None
        assert torch.allclose(per_weight[i], single.weight_t.grad, atol=1e-6)
        assert torch.allclose(per_bias[i], single.bias.grad, atol=1e-6)
