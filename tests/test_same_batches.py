"""The runtime's check that the ranks train on different samples: the digests and the comparison (no ranks)."""

import torch

from nbddp.runtime.same_batches import digest, nothing_to_split, repeated


def test_the_same_batch_digests_alike_and_another_batch_differently():
    x = torch.arange(12.0).reshape(6, 2)
    assert digest(((x,), {})) == digest(((x.clone(),), {}))
    assert digest(((x,), {}))[0] != digest(((x[[1, 0, 2, 3, 4, 5]],), {}))[0]  # the order of rows counts
    assert digest(((), {"input_ids": x}))[0] != digest(((), {"input_ids": x[:3]}))[0]


def test_a_batch_of_one_row_or_of_identical_rows_holds_nothing_to_split():
    assert digest(((torch.ones(1, 4),), {}))[1]
    assert digest(((torch.zeros(5, 4), torch.zeros(5)), {}))[1]
    assert not digest(((torch.zeros(5, 4), torch.arange(5.0)), {}))[1]


def test_two_ranks_with_every_digest_equal_are_named_only_where_the_batches_could_be_split():
    assert repeated([[1.0, 2.0, 3.0, 0.0], [1.0, 2.0, 3.0, 0.0]]) == (0, 1)
    assert repeated([[1.0, 2.0, 3.0, 0.0], [1.0, 2.0, 4.0, 0.0]]) is None  # one batch differs: sharded
    assert repeated([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]) is None  # one distinct row: nothing to split
    assert repeated([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [2.0, 0.0]]) == (1, 3)


def test_batches_of_one_row_each_hold_rows_to_split_where_they_differ():
    one, other = digest(((torch.ones(1, 4),), {})), digest(((torch.zeros(1, 4),), {}))
    assert nothing_to_split([one, one, one])  # a data set of one row
    assert not nothing_to_split([one, other, one])  # batch_size=1 over varying rows


def test_rows_of_equal_sums_or_a_shifted_image_digest_differently():
    """Disjoint shards whose values are alike (normalised rows, one-hot rows, an image shifted along its width)
    must never look like the same batch: the weights by position have no period."""
    image = torch.zeros(28, 28)
    image[10:18, 3:6] = 1.0
    shifted = torch.roll(image, shifts=7, dims=1)  # a period of 7 positions would weigh both alike
    assert digest(((image[None],), {}))[0] != digest(((shifted[None],), {}))[0]
    one_hot = torch.eye(8)
    assert digest(((one_hot[:4],), {}))[0] != digest(((one_hot[4:],), {}))[0]
