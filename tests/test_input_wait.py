"""report()'s input-wait hint: only for a wait that matters, in share and in seconds, and with
a cure that fits the samples (no uint8 or aug_transforms advice for feature rows)."""
import time

import torch
from torch.utils.data import Subset, TensorDataset

import tpu_utility as tu
from tpu_utility.replica import Replica, activate
from tpu_utility.engines.local import Local
from tpu_utility.input_wait import InputWait, Meter, source_of
from tpu_utility.loop import EpochStats, History
from tpu_utility.reporting import XlaReport, hints

REP = XlaReport(3, 1.0, 100, 3, {})


def _history(wait):
    epoch = EpochStats(wait.epoch, 1.0, None, {}, 1e-3, wait.seconds, wait.samples_per_s, 0, 1,
                       input_wait=wait.share)
    return History(epochs=[epoch], lrs=[1e-3] * wait.batches, input=wait)


def _wait_hints(wait):
    return [h for h in hints(REP, _history(wait)) if "waited for its next batch" in h]


def test_the_quick_starts_short_wait_gets_no_hint():
    # The README quick start's third epoch as report() saw it: 22% of a 0.1 s epoch.
    quick = InputWait(2, 0.022, 0.1, 64, 2048, 0, "rows", False)
    assert quick.share > 0.2  # above the share that alone used to be enough
    assert _wait_hints(quick) == []
    # the same share over a 10 s epoch is 2.2 s lost per epoch: hinted
    assert len(_wait_hints(InputWait(2, 2.2, 10.0, 64, 2048, 0, "rows", False))) == 1


def test_a_long_wait_on_images_keeps_its_hint():
    for shape in ((3, 32, 32), (64, 64, 3)):  # channels first or last
        wait = InputWait(2, 6.0, 10.0, 50, 3200, 0, "rows", False, shape, "float32")
        (hint,) = _wait_hints(wait)
        assert hint.startswith("the training loop waited for its next batch 60% of epoch 3")
        assert "upload uint8 images" in hint and "augment=tu.aug_transforms()" in hint
        assert "if they are images" not in hint
    grey = InputWait(2, 6.0, 10.0, 50, 3200, 0, "rows", False, (28, 28), "uint8")
    assert grey.images and "a larger batch" in _wait_hints(grey)[0]  # already uint8: no upload advice
    (hint,) = _wait_hints(InputWait(2, 6.0, 10.0, 50, 3200, 4, "samples", False, (3, 64, 64), "uint8"))
    assert "tu.cache_dataset(ds, path)" in hint and "aug_transforms" in hint


def test_a_long_wait_on_feature_rows_gets_a_cure_for_rows():
    for source, workers in (("rows", 0), ("samples", 4)):
        for shape, dtype in (((20,), "float32"), ((128,), "int64"), ((50, 8), "float32")):
            wait = InputWait(2, 6.0, 10.0, 50, 3200, workers, source, False, shape, dtype)
            assert wait.images is False
            (hint,) = _wait_hints(wait)
            assert "aug_transforms" not in hint and "uint8" not in hint, hint
            assert ("a larger batch" if source == "rows" else "tu.cache_dataset(ds, path)") in hint
    # unknown samples (an older checkpoint): the image advice only as a condition
    unknown = _wait_hints(InputWait(2, 6.0, 10.0, 50, 3200, 0, "rows", False))[0]
    assert "if they are images, upload uint8 images" in unknown


def test_the_meter_records_one_samples_shape_from_the_first_batch():
    from tpu_utility.input_wait import sample_of
    x, y, keys = torch.zeros(8, 3, 16, 16, dtype=torch.uint8), torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    assert sample_of((x, y)) == ((3, 16, 16), "uint8")
    assert sample_of(((x, y), keys)) == ((3, 16, 16), "uint8")  # train batches with augmentation keys
    assert sample_of({"features": torch.zeros(8, 20), "label": y}) == ((20,), "float32")
    assert sample_of((torch.tensor(1.0), torch.zeros(4, 7))) == ((7,), "float32")  # a 0-dim tensor skipped
    assert sample_of(["no", "tensors"]) is None
    meter = Meter()
    for batch in ((torch.zeros(4, 20), y), (x, y)):  # only the first batch counts
        meter.ask()
        meter.got(batch)
    wait = meter.result(0, 4, 0, "rows", False)
    assert (wait.sample_shape, wait.sample_dtype, wait.images) == ((20,), "float32", False)


class _Slow(torch.utils.data.Dataset):
    """Feature rows behind 20 ms of work per sample."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.full((20,), float(i)), i % 4


def test_a_real_loader_records_its_samples_and_gets_a_cure_for_rows():
    import tpu_utility as tu
    with activate(Replica(Local())):  # the cpu engine, in this process: no XLA runtime started
        loader = tu.make_loader(_Slow(), 8, num_workers=0)
        assert sum(1 for _ in loader) == 6
        wait = loader.input_wait
        found = [h for h in hints(REP, waits=[wait]) if "waited for its next batch" in h]
    assert (wait.sample_shape, wait.sample_dtype, wait.images) == ((20,), "float32", False)
    assert wait.waited_s >= 48 * 0.02 * 0.9 and wait.share > 0.5, wait  # it really waited
    assert len(found) == 1 and "aug_transforms" not in found[0] and "uint8" not in found[0], found
    from tpu_utility.compat import runtime_started
    assert not runtime_started()


def test_image_datasets_are_told_apart_by_what_their_class_says(tmp_path):
    """source_of imports no dataset: tu's image datasets say that they decode files
    (`decodes_image_files = True`), found under a Subset, and an epoch of a loader over
    one records it, so report() advises presizing and caching."""
    from PIL import Image
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / label / "a.png")
    images = tu.ImageFolderDataset(tmp_path)
    assert source_of(Subset(images, [1, 0]), False) == "image files"
    assert source_of(images, True) == "rows"  # what draws_no_randomness says comes first
    assert source_of(Subset(TensorDataset(torch.zeros(2)), [0]), False) == "samples"

    class Decoding(TensorDataset):
        decodes_image_files = True
    assert source_of(Decoding(torch.zeros(2)), False) == "image files"
    with activate(Replica(Local())):
        loader = tu.make_loader(Subset(images, [0, 1]), 1, num_workers=0)
        assert sum(1 for _ in loader) == 2 and loader.input_wait.source == "image files"
