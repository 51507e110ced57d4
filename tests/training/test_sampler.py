"""GlobalBatchSampler: deterministic by seed and position, DP shards partition the global batch."""

import pytest

from megatron_dsv.training.data import GlobalBatchSampler


def _flat(micro_batches):
    return [i for mb in micro_batches for i in mb]


def test_same_seed_same_batches_other_seed_differs():
    a = GlobalBatchSampler(50, 2, 8, 0, 1, seed=3)
    b = GlobalBatchSampler(50, 2, 8, 0, 1, seed=3)
    c = GlobalBatchSampler(50, 2, 8, 0, 1, seed=4)
    assert [a.global_batch(p) for p in range(0, 80, 8)] == [b.global_batch(p) for p in range(0, 80, 8)]
    assert a.global_batch(0) != c.global_batch(0)


def test_dp_shards_partition_the_global_batch():
    ref = GlobalBatchSampler(37, 2, 12, 0, 1, seed=1)
    for consumed in (0, 12, 36, 48):  # crosses the epoch boundary at 37
        shards = [_flat(GlobalBatchSampler(37, 2, 12, r, 3, seed=1).local_micro_batches(consumed)) for r in range(3)]
        assert [len(s) for s in shards] == [4, 4, 4]
        assert shards[0] + shards[1] + shards[2] == ref.global_batch(consumed)
    micro = GlobalBatchSampler(37, 2, 12, 1, 3, seed=1).local_micro_batches(0)
    assert [len(mb) for mb in micro] == [2, 2]


def test_epoch_is_a_permutation_and_epochs_differ():
    s = GlobalBatchSampler(20, 5, 5, 0, 1, seed=0)
    epoch0 = [s.index(p) for p in range(20)]
    epoch1 = [s.index(p) for p in range(20, 40)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))
    assert epoch0 != epoch1


def test_resume_continues_with_the_next_batch():
    full = GlobalBatchSampler(30, 2, 4, 1, 2, seed=9)
    it = iter(full)
    uninterrupted = [next(it) for _ in range(10)]
    resumed = iter(GlobalBatchSampler(30, 2, 4, 1, 2, seed=9, consumed_samples=6 * 4))
    assert [next(resumed) for _ in range(4)] == uninterrupted[6:]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=0), "num_samples"),
    (dict(global_batch_size=6), "global_batch_size"),
    (dict(dp_rank=2), "dp_rank"),
    (dict(consumed_samples=-1), "consumed_samples"),
])
def test_bad_sampler_arguments(kwargs, match):
    base = dict(num_samples=10, micro_batch_size=2, global_batch_size=8, dp_rank=0, dp_size=2, seed=0)
    with pytest.raises(ValueError, match=match):
        GlobalBatchSampler(**{**base, **kwargs})
