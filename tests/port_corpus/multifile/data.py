"""Synthetic token sequences: each class draws half its tokens from a band of the
vocabulary of its own, and sequences have padded tails of random length."""
import torch
from torch.utils.data import Dataset

import config


class SyntheticSequences(Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, config.N_CLASSES, (n,), generator=g)
        band = (config.VOCAB - 1) // config.N_CLASSES
        uniform = torch.randint(1, config.VOCAB, (n, config.SEQ_LEN), generator=g)
        banded = 1 + self.labels[:, None] * band + torch.randint(0, band, (n, config.SEQ_LEN), generator=g)
        use_band = torch.rand(n, config.SEQ_LEN, generator=g) < 0.5
        self.ids = torch.where(use_band, banded, uniform)
        lengths = torch.randint(config.SEQ_LEN // 2, config.SEQ_LEN + 1, (n,), generator=g)
        self.mask = torch.arange(config.SEQ_LEN)[None, :] < lengths[:, None]
        self.ids[~self.mask] = config.PAD

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.ids[i], self.mask[i], self.labels[i]
