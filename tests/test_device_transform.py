"""`augment=` takes any object with the three DeviceTransform methods, not only what
tu.aug_transforms returns: the loader knows augmentation by `keys` (on the host, as each
training batch loads), `train_batch` and `eval_batch` (on the device). Checked on the cpu
engine in this process, against the same methods applied by hand to the batches of the
same loader without `augment`."""
import pytest
import torch
from torch.utils.data import TensorDataset

import tpu_utility as tu
from tpu_utility.replica import Replica, activate
from tpu_utility.engines.local import Local

N, BATCH, SEED = 12, 4, 5


class Offset:
    """Adds each sample's key to its features in training, doubles them in evaluation; a
    key is a readable function of (seed, epoch, place). Module level: workers pickle it."""

    def keys(self, seed, epoch, places):
        return torch.tensor([seed * 10_000 + epoch * 100 + p for p in places])

    def train_batch(self, batch, keys):
        x, y = batch
        return x + keys.reshape(-1, 1).to(x.dtype), y

    def eval_batch(self, batch):
        x, y = batch
        return x * 2, y


def data():
    return TensorDataset(torch.arange(N * 2, dtype=torch.float32).reshape(N, 2), torch.arange(N))


def epochs(loader, n=2):
    return [list(loader) for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_object_with_the_three_methods_augments_as_by_hand(workers):
    transform = Offset()
    with activate(Replica(Local())):
        got = epochs(tu.make_loader(data(), BATCH, seed=SEED, num_workers=workers, augment=transform))
        raw = epochs(tu.make_loader(data(), BATCH, seed=SEED, num_workers=workers))
        evaluated = epochs(tu.make_loader(data(), BATCH, train=False, num_workers=workers,
                                          augment=transform), 1)
        padded = epochs(tu.make_loader(data(), 5, train=False, pad=True, augment=transform), 1)
    assert len(got) == 2 and len(got[0]) == N // BATCH
    for epoch, (batches, raw_batches) in enumerate(zip(got, raw)):
        for b, (batch, plain) in enumerate(zip(batches, raw_batches)):
            places = range(b * BATCH, (b + 1) * BATCH)  # one replica: the epoch's global order
            want = transform.train_batch(plain, transform.keys(SEED, epoch, places))
            assert all(torch.equal(g, w) for g, w in zip(batch, want)), (epoch, b)
    assert not torch.equal(got[0][0][0] - raw[0][0][0], got[1][0][0] - raw[1][0][0])  # new keys each epoch
    rows = torch.cat([x for x, _ in evaluated[0]])
    assert torch.equal(rows, data().tensors[0] * 2)  # in order, each sample doubled, no keys
    (x, y), valid = padded[0][-1]  # 12 samples in batches of 5: the last has 3 repeats
    assert torch.equal(x, data().tensors[0][[10, 11, 0, 1, 2]] * 2)
    assert valid.tolist() == [True, True, False, False, False]


class NoEval:
    def keys(self, seed, epoch, places):
        return torch.zeros(len(places), dtype=torch.int32)

    def train_batch(self, batch, keys):
        return batch


class NotCallable(NoEval):
    eval_batch = None


@pytest.mark.parametrize("transform, lacks", [(NoEval(), "eval_batch"), (NotCallable(), "eval_batch"),
                                              (object(), "keys, train_batch, eval_batch")])
def test_an_object_without_them_is_refused_with_what_it_lacks(transform, lacks):
    with pytest.raises(TypeError, match=f"augment must be what tu.aug_transforms.*lacks {lacks}\\)$"):
        tu.make_loader(data(), BATCH, augment=transform)
    spec = tu.make_loader(data(), BATCH).spec
    with pytest.raises(TypeError, match="augment must be what tu.aug_transforms"):
        spec.replace(augment=transform)
