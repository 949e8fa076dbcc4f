"""`PaddedDataset`: evaluation's samples repeated up to whole batches on every replica.

A file of its own so that both the pipeline (which pads) and the policy (which sees
through the padding) can import it without importing each other.
"""
from __future__ import annotations


class PaddedDataset:
    """`dataset` repeated up to a multiple of `multiple`; item i is (sample, i < len(dataset)).

    Evaluation on several replicas needs every replica to take the same number of full
    batches. The flag lets metrics and predictions drop the repeats.

    Example:
        >>> from tpu_utility.data import PaddedDataset
        >>> padded = PaddedDataset(["a", "b", "c"], 4)
        >>> len(padded), padded[2], padded[3]
        (4, ('c', True), ('a', False))

    Args:
        dataset: a map-style dataset.
        multiple: the padded length's divisor (the global batch).
    """

    def __init__(self, dataset, multiple: int):
        self.dataset, self.n = dataset, len(dataset)
        self.total = -(-self.n // multiple) * multiple if self.n else 0

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int):
        return self.dataset[i % self.n], i < self.n
