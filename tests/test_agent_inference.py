"""The papers' inference rules (edge_agent.inference) on hand-computed vectors."""

import numpy as np
import pytest

from edge_agent import inference as inf
from edge_agent.methods import METHODS

# One unit embedding and two prototypes of unequal norms:
#   class 0: (0.6, 0)   dot 0.6, cosine 1.0, distance 0.4
#   class 1: (0.8, 0.6) dot 0.8, cosine 0.8, distance sqrt(0.04 + 0.36) = 0.632
# The argmax of the dot product picks class 1; cosine similarity (FedPCL) and Euclidean
# distance (FedProto) both pick class 0.
Z = np.array([[1.0, 0.0]])
PROTOS = np.array([[0.6, 0.0], [0.8, 0.6]])
BOTH = np.array([True, True])


def test_the_dot_product_and_the_papers_rules_disagree_by_hand():
    assert int((Z @ PROTOS.T).argmax()) == 1
    cosine = inf.nearest_by_cosine(Z, PROTOS, BOTH)
    assert cosine.classes.tolist() == [0] and cosine.scores == pytest.approx([1.0])
    distance = inf.nearest_by_distance(Z, PROTOS, BOTH)
    assert distance.classes.tolist() == [0] and distance.scores == pytest.approx([-0.4])


def test_cosine_and_distance_are_different_rules_by_hand():
    # class 0: (0.3, 0)   cosine 1.0,   distance 0.7
    # class 1: (0.9, 0.3) cosine 0.949, distance sqrt(0.01 + 0.09) = 0.316
    protos = np.array([[0.3, 0.0], [0.9, 0.3]])
    assert inf.nearest_by_cosine(Z, protos, BOTH).classes.tolist() == [0]
    far = inf.nearest_by_distance(Z, protos, BOTH)
    assert far.classes.tolist() == [1] and far.scores == pytest.approx([-np.sqrt(0.1)])


def test_absent_classes_are_never_predicted():
    z = np.array([[0.0, 1.0], [-1.0, 0.0]])
    protos = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    present = np.array([True, False, True])
    for rule in (inf.nearest_by_cosine, inf.nearest_by_distance):
        # Class 1 would win the first sample but has no prototype here.
        assert rule(z, protos, present).classes.tolist() == [0, 2]


def test_each_method_predicts_by_its_papers_rule():
    logits = np.array([[0.1, 0.9]])
    refs = inf.References(local=PROTOS, local_present=BOTH, global_=PROTOS, global_present=BOTH)
    out = inf.Outputs(z=Z, logits=logits, z_decision=np.array([[2.0, 0.0]]))
    chosen = {m: int(inf.predict(m, out, refs).classes[0]) for m in METHODS}
    # FedPCL (cosine, local), FedProto (distance, global) and FedDBP (distance between
    # normalised decision features and normalised prototypes: (1, 0) vs (1, 0) and
    # (0.8, 0.6), distances 0 and 0.632) take class 0, where a dot product takes 1; the
    # classifier methods follow the logits.
    expected = {"fedpcl": 0, "fedproto": 0, "feddbp": 0, "solo": 1, "fedavg": 1, "fpl": 1}
    # A closed-form head's scores are its logits: lda, ridge and fedcof follow them too.
    assert chosen == expected | {"lda": 1, "ridge": 1, "fedcof": 1}
    assert inf.predict("feddbp", out, refs).scores == pytest.approx([0.0])


def test_a_rule_without_its_prototypes_says_which_are_missing():
    out = inf.Outputs(z=Z, logits=np.zeros((1, 2)))
    local_only = inf.References(local=PROTOS, local_present=BOTH)
    with pytest.raises(inf.MissingReference, match="no global prototypes"):
        inf.predict("fedproto", out, local_only)
    with pytest.raises(inf.MissingReference, match="no local prototypes"):
        inf.check_references("fedpcl", inf.References())
    inf.check_references("solo", inf.References())  # the classifier needs none
    with pytest.raises(ValueError, match="method 'nope' is not supported on the agent"):
        inf.rule_of("nope")
    assert {inf.rule_of(m).rule for m in METHODS} == set(inf.RULES)
