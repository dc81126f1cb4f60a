"""The agent's losses, prototypes and inference against hand-computed values."""

import math

import pytest
import torch
from torch import nn

from edge_agent import losses
from edge_agent.head import ProjectionHead, local_prototypes

Z = torch.tensor([[1.0, 0.0]])
Y = torch.tensor([0])
PROTOS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
ALL = torch.tensor([True, True, True])


def test_contrast_excludes_the_positive_from_the_denominator_by_default():
    # logits [1, 0, -1]: -log(e / (e^0 + e^-1)) = -1 + log(1 + e^-1)
    got = losses.prototype_contrast(Z, Y, PROTOS, ALL, tau=1.0)
    assert got.item() == pytest.approx(-1 + math.log(1 + math.exp(-1)), abs=1e-6)


def test_contrast_standard_softmax_option():
    got = losses.prototype_contrast(Z, Y, PROTOS, ALL, tau=1.0, include_positive=True)
    assert got.item() == pytest.approx(math.log(math.e + 1 + math.exp(-1)) - 1, abs=1e-6)


def test_contrast_temperature_and_absent_classes():
    present = torch.tensor([True, True, False])
    # logits [1/0.5, 0]: -2 + log(e^0)
    got = losses.prototype_contrast(Z, Y, PROTOS, present, tau=0.5)
    assert got.item() == pytest.approx(-2.0, abs=1e-6)
    # a sample whose own class has no prototype contributes nothing
    empty = losses.prototype_contrast(Z, torch.tensor([2]), PROTOS, present, tau=1.0)
    assert empty.item() == 0.0


def test_fedpcl_is_global_term_plus_mean_of_local_terms():
    local_sets = torch.stack([PROTOS, torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])])
    local_present = torch.tensor([[True, True, True], [True, True, False]])
    targets = losses.fedpcl_targets(
        global_protos=PROTOS,
        global_present=ALL,
        local_sets=local_sets,
        local_present=local_present,
        tau=1.0,
    )
    got = losses.fedpcl_loss(Z, Y, targets)
    l_g = -1 + math.log(1 + math.exp(-1))
    l_p = (l_g + 1.0) / 2  # second set: logits [0, 1] -> -0 + log(e^1) = 1
    assert got.item() == pytest.approx(l_g + l_p, abs=1e-6)


def test_fedproto_is_cross_entropy_plus_weighted_distance():
    logits = torch.tensor([[2.0, 0.0]])
    global_protos = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    got = losses.fedproto_loss(
        logits,
        Z,
        Y,
        global_protos=global_protos,
        global_present=torch.tensor([True, True]),
        lam=0.5,
    )
    assert got.item() == pytest.approx(math.log(1 + math.exp(-2)) + 0.5 * 0.8, abs=1e-6)


def test_cpcl_and_upcr_by_hand():
    clusters = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    owners = torch.tensor([0, 0, 1])
    got = losses.cpcl_loss(Z, Y, clusters=clusters, cluster_classes=owners, tau=1.0)
    assert got.item() == pytest.approx(
        math.log(math.e + 1 + math.exp(-1)) - math.log(math.e + 1), abs=1e-6
    )
    unbiased = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    assert losses.upcr_loss(
        Z, Y, unbiased=unbiased, present=torch.tensor([True, True])
    ).item() == pytest.approx(0.8)


def test_local_prototypes_and_counts():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.0]])
    protos, counts = local_prototypes(z, torch.tensor([0, 1, 0]), 3)
    torch.testing.assert_close(protos, torch.tensor([[0.75, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(counts, torch.tensor([2.0, 1.0, 0.0]))


def test_head_outputs_unit_norm_embeddings():
    head = ProjectionHead(in_dim=12, out_dim=32).eval()
    z = head(torch.randn(5, 12))
    assert z.shape == (5, 32)
    torch.testing.assert_close(z.norm(dim=1), torch.ones(5))
    with pytest.raises(ValueError):
        ProjectionHead(in_dim=12, out_dim=30, norm="group")


def test_a_fedpcl_step_moves_z_towards_its_prototypes_and_away_from_others():
    torch.manual_seed(0)
    head = ProjectionHead(in_dim=16, out_dim=8)
    r = torch.randn(64, 16)
    y = torch.arange(64) % 4
    protos = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    present = torch.ones(4, dtype=torch.bool)

    def margins() -> tuple[float, float]:
        head.eval()
        with torch.no_grad():
            sims = head(r) @ protos.T
        own = sims.gather(1, y[:, None]).mean().item()
        others = (
            sims.masked_fill(torch.nn.functional.one_hot(y, 4).bool(), 0).sum(1).mean().item() / 3
        )
        return own, others

    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    targets = losses.fedpcl_targets(
        global_protos=protos,
        global_present=present,
        local_sets=protos[None],
        local_present=present[None],
        tau=0.07,
    )

    def step() -> None:
        head.train()
        loss = losses.fedpcl_loss(head(r), y, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()

    own0, other0 = margins()
    step()
    own1, other1 = margins()
    assert own1 > own0 and other1 < other0  # one step already moves every average the right way
    for _ in range(30):
        step()
    own2, other2 = margins()
    assert own2 > own1 and other2 < other1
    assert own2 - other2 > (own0 - other0) + 0.1


def test_feddbp_decision_loss_by_hand():
    # d = [0, sqrt 2]; m = sqrt(2)/2; M = exp(-max(0, m - sqrt 2)) = 1
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    got = losses.feddbp_decision_loss(
        Z, Y, protos=protos, present=torch.tensor([True, True]), tau=1.0
    )
    assert got.item() == pytest.approx(-1.0 / (1.0 + math.exp(-math.sqrt(2)) + 1.0), abs=1e-5)


def test_fisher_scores_by_hand():
    classifier = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        classifier.weight.copy_(torch.eye(2))
    # at z = 0 the softmax is uniform: d log p_0 / dz = [1, 0] - [0.5, 0.5]
    scores = losses.fisher_scores(classifier, torch.zeros(2, 2), torch.tensor([0, 0]), 3)
    torch.testing.assert_close(scores, torch.tensor([[0.25, 0.25], [0.0, 0.0], [0.0, 0.0]]))


def test_prototype_distance_is_shared_by_fedproto_upcr_and_feddbp():
    protos = torch.tensor([[0.6, 0.8], [0.0, 1.0]])
    got = losses.prototype_distance(Z, Y, protos=protos, present=torch.tensor([True, True]))
    assert got.item() == pytest.approx(0.8)
    assert (
        losses.prototype_distance(Z, Y, protos=protos, present=torch.tensor([False, True])).item()
        == 0.0
    )


@pytest.mark.parametrize("include_positive", [False, True])
def test_batched_sets_equal_the_term_written_out_per_sample(include_positive):
    gen = torch.Generator().manual_seed(3)
    z = nn.functional.normalize(torch.randn(6, 4, generator=gen), dim=1)
    y = torch.tensor([0, 1, 2, 2, 3, 0])
    sets = torch.randn(3, 4, 4, generator=gen)
    present = torch.ones(3, 4, dtype=torch.bool)
    present[1, 2] = False  # samples of class 2 do not count in set 1
    present[2, 1:] = False  # set 2 has class 0 only: no negatives for class 0 there
    got = losses.prototype_contrast_sets(
        z, y, sets, present, tau=0.5, include_positive=include_positive
    )
    for s in range(3):
        terms = []
        for b in range(len(y)):
            c = int(y[b])
            others = [a for a in range(4) if present[s, a] and (include_positive or a != c)]
            if not present[s, c] or not others:
                continue
            logits = [float(z[b] @ sets[s, a]) / 0.5 for a in range(4)]
            terms.append(-logits[c] + math.log(sum(math.exp(logits[a]) for a in others)))
        want = sum(terms) / len(terms) if terms else 0.0
        assert got[s].item() == pytest.approx(want, abs=1e-5)


def test_the_weighted_reduction_equals_the_weighted_sum_of_per_set_means():
    gen = torch.Generator().manual_seed(4)
    z = nn.functional.normalize(torch.randn(9, 5, generator=gen), dim=1).requires_grad_()
    y = torch.tensor([0, 1, 2, 2, 3, 0, 1, 1, 3])
    sets = torch.randn(4, 4, 5, generator=gen)
    present = torch.rand(4, 4, generator=gen) > 0.3
    present[3] = False  # a set with no classes: counts for nothing, and stays finite
    weights = torch.tensor([1.0, 0.5, 0.25, 2.0])
    targets = losses.ContrastTargets.build(
        sets, present, tau=0.1, include_positive=False, weights=weights
    )
    got = losses.weighted_contrast(z, y, targets)
    want = (weights * losses.contrast_terms(z, y, targets)).sum()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(got, z)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
