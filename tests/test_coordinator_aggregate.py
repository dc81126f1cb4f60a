"""The aggregation math against hand-computed vectors."""

import numpy as np
import pytest

from coordinator import aggregate as agg

# Two clients, three classes, 2-d prototypes. Client 0 lacks class 2; client 1 lacks class 0.
PROTOS = np.array(
    [
        [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]],
        [[0.0, 0.0], [1.0, 0.0], [0.6, 0.8]],
    ]
)
COUNTS = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, 4.0]])


def test_count_weighted_mean_by_hand():
    values, has = agg.count_weighted_mean(PROTOS, COUNTS)
    assert has.tolist() == [True, True, True]
    # class 1: (1 * [0, 1] + 3 * [1, 0]) / 4
    np.testing.assert_allclose(values, [[1.0, 0.0], [0.75, 0.25], [0.6, 0.8]])


def test_paper_weighting_divides_by_the_number_of_holders():
    values, _ = agg.count_weighted_mean(PROTOS, COUNTS, weighting="paper")
    # class 1 is held by two clients: Eq. 6 as printed halves it.
    np.testing.assert_allclose(values, [[1.0, 0.0], [0.375, 0.125], [0.6, 0.8]])


def test_weighted_sums_are_associative_across_shards():
    sums, totals = agg.weighted_sums(PROTOS, COUNTS)
    s0, t0 = agg.weighted_sums(PROTOS[:1], COUNTS[:1])
    s1, t1 = agg.weighted_sums(PROTOS[1:], COUNTS[1:])
    np.testing.assert_allclose(sums, s0 + s1)
    np.testing.assert_allclose(totals, t0 + t1)


def test_class_nobody_holds_has_no_global():
    counts = COUNTS.copy()
    counts[:, 2] = 0
    _, has = agg.count_weighted_mean(PROTOS, counts)
    assert has.tolist() == [True, True, False]


def test_padding_fills_missing_classes_with_the_global():
    values, has = agg.count_weighted_mean(PROTOS, COUNTS)
    padded = agg.pad_local_sets(PROTOS, COUNTS, values, has)
    np.testing.assert_allclose(padded[0], [[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    np.testing.assert_allclose(padded[1], [[1.0, 0.0], [1.0, 0.0], [0.6, 0.8]])


def test_unweighted_mean_median_and_trimmed_mean():
    protos = np.array([[[0.0]], [[1.0]], [[2.0]], [[100.0]]])
    counts = np.array([[1.0], [5.0], [1.0], [1.0]])
    mean, _ = agg.combine(protos, counts, rule="mean")
    median, _ = agg.combine(protos, counts, rule="median")
    trimmed, _ = agg.combine(protos, counts, rule="trimmed_mean", trim=0.25)
    assert mean[0, 0] == pytest.approx(103 / 4)
    assert median[0, 0] == pytest.approx(1.5)
    assert trimmed[0, 0] == pytest.approx(1.5)  # drops 0 and 100


def test_count_cap_and_norm_clip():
    np.testing.assert_array_equal(agg.cap_counts(np.array([1.0, 50.0]), 10), [1.0, 10.0])
    clipped = agg.clip_norms(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
    np.testing.assert_allclose(clipped, [[0.6, 0.8], [0.3, 0.4]])
    with pytest.raises(ValueError):
        agg.clip_norms(clipped, 0.0)


def test_finch_finds_known_clusters():
    # Two tight groups of directions and one lone direction that joins its nearest group.
    points = np.array(
        [
            [1.0, 0.0, 0.0],
            [0.99, 0.1, 0.0],
            [0.98, -0.1, 0.0],
            [0.0, 1.0, 0.0],
            [0.1, 0.99, 0.0],
            [0.0, 0.0, 1.0],
        ]
    )
    labels = agg.finch_first_partition(points)
    assert labels[:3].tolist() == [0, 0, 0]
    assert labels[3] == labels[4] != labels[0]
    assert len(set(labels.tolist())) == 2


def test_finch_links_shared_first_neighbours():
    # 0 and 2 both have 1 as first neighbour; 3 and 4 are each other's: two clusters.
    points = np.array([[1.0, 0.2], [1.0, 0.0], [1.0, -0.2], [-1.0, 0.05], [-1.0, -0.05]])
    assert agg.finch_first_partition(points).tolist() == [0, 0, 0, 1, 1]


def test_finch_edge_sizes():
    assert agg.finch_first_partition(np.zeros((0, 3))).tolist() == []
    assert agg.finch_first_partition(np.ones((1, 3))).tolist() == [0]
    assert agg.finch_first_partition(np.array([[1.0, 0], [0, 1.0]])).tolist() == [0, 0]


def test_cluster_means():
    points = np.array([[0.0, 2.0], [2.0, 0.0], [5.0, 5.0]])
    np.testing.assert_allclose(
        agg.cluster_means(points, np.array([0, 0, 1])), [[1.0, 1.0], [5.0, 5.0]]
    )


def test_topk_fusion_by_hand():
    local = np.array([[1.0, 2.0, 3.0, 4.0]])
    global_ = np.array([[0.0, 0.0, 0.0, 0.0]])
    scores = np.array([[0.1, 0.9, 0.5, 0.2]])
    out = agg.topk_fusion(local, global_, scores, k=2, eta=0.5)
    # channels 1 and 2 have the top scores: 0.5 * local there, global elsewhere
    np.testing.assert_allclose(out, [[0.0, 1.0, 1.5, 0.0]])
    np.testing.assert_allclose(agg.topk_fusion(local, global_, scores, k=0, eta=1.0), global_)
    np.testing.assert_allclose(agg.topk_fusion(local, global_, scores, k=10, eta=1.0), local)


# The direction screen (agg.screen_directions). Four holders of class 0, a class 1 held by
# two, 2-d rows. Class 0's coordinate-wise median is [0.8, 0] (x of 0, 0.6, 1, 1; y of -1,
# 0, 0, 0.8), cosines 1, 1, 0.6, 0, lower median 0.6: client 3 (0 < 0.3) is screened.
SCREEN_PROTOS = np.array(
    [
        [[1.0, 0.0], [1.0, 0.0]],
        [[1.0, 0.0], [0.0, 1.0]],
        [[0.6, 0.8], [0.0, 0.0]],
        [[0.0, -1.0], [0.0, 0.0]],
    ]
)
SCREEN_COUNTS = np.array([[4.0, 2.0], [4.0, 3.0], [4.0, 0.0], [4.0, 0.0]])


def test_class_centres_are_coordinate_wise_medians_of_the_holders():
    centres = agg.class_centres(SCREEN_PROTOS, SCREEN_COUNTS)
    # Class 1: the zeros of clients 2 and 3 are absent, not values: median of two = mean.
    np.testing.assert_allclose(centres, [[0.8, 0.0], [0.5, 0.5]])


def test_centre_cosines_by_hand_and_zero_for_a_zero_vector():
    cos = agg.centre_cosines(SCREEN_PROTOS, np.array([[0.8, 0.0], [0.0, 0.0]]))
    np.testing.assert_allclose(cos[:, 0], [1.0, 1.0, 0.6, 0.0])
    np.testing.assert_array_equal(cos[:, 1], [0.0, 0.0, 0.0, 0.0])


def test_screen_directions_drops_the_row_against_the_consensus():
    counts, screened = agg.screen_directions(SCREEN_PROTOS, SCREEN_COUNTS)
    assert screened.tolist() == [[False, False], [False, False], [False, False], [True, False]]
    # Only the screened count becomes 0; class 1 (two holders) is never screened.
    np.testing.assert_array_equal(counts, [[4.0, 2.0], [4.0, 3.0], [4.0, 0.0], [0.0, 0.0]])


def test_screen_directions_fraction_sets_the_bar():
    # At 0.9 the bar is 0.54: client 2's 0.6 still passes; at 0.99 (0.594) too. Raise the
    # median instead: with a fifth holder at [1, 0] the cosines are 1, 1, 0.6, 0, 1 and the
    # lower median 1, so at 0.7 client 2's 0.6 falls below 0.7 as well.
    _, screened = agg.screen_directions(SCREEN_PROTOS, SCREEN_COUNTS, fraction=0.99)
    assert screened[:, 0].tolist() == [False, False, False, True]
    protos = np.concatenate([SCREEN_PROTOS, [[[1.0, 0.0], [0.0, 0.0]]]])
    counts = np.concatenate([SCREEN_COUNTS, [[4.0, 0.0]]])
    _, screened = agg.screen_directions(protos, counts, fraction=0.7)
    assert screened[:, 0].tolist() == [False, False, True, True, False]


def test_screen_directions_is_blind_to_scale():
    # Under noise every row is longer; scaling all of them changes no cosine.
    _, plain = agg.screen_directions(SCREEN_PROTOS, SCREEN_COUNTS)
    _, long = agg.screen_directions(30.0 * SCREEN_PROTOS, SCREEN_COUNTS)
    np.testing.assert_array_equal(plain, long)


def test_screen_directions_leaves_a_class_without_consensus_alone():
    # [1, 0], [-1, 0], [0, 1], [0, -1]: the median is [0, 0], every cosine 0, median 0.
    protos = np.array([[[1.0, 0.0]], [[-1.0, 0.0]], [[0.0, 1.0]], [[0.0, -1.0]]])
    counts, screened = agg.screen_directions(protos, np.ones((4, 1)))
    assert not screened.any()
    np.testing.assert_array_equal(counts, np.ones((4, 1)))


def test_screen_directions_never_screens_one_of_two():
    protos = np.array([[[1.0, 0.0]], [[-0.6, 0.8]]])  # cosines to [0.2, 0.4]: 0.45, 0.89
    _, screened = agg.screen_directions(protos, np.ones((2, 1)))
    assert not screened.any()


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_screen_directions_refuses_a_fraction_outside_0_1(fraction):
    with pytest.raises(ValueError, match="fraction"):
        agg.screen_directions(SCREEN_PROTOS, SCREEN_COUNTS, fraction=fraction)
