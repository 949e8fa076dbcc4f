"""The benchmarks' shared workload, in plain torch (nothing from tpu_utility): the model,
the data and the one-cycle schedule that every variant, ours and hand-written, trains."""
import math

import torch
import torch.nn as nn

FEATURES, HIDDEN, CLASSES = 128, 512, 10
LR = 1e-3


def make_dataset(n: int = 8192) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN),
                         nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def _cosine(a: float, b: float, t: float) -> float:
    return b + (a - b) * (1 + math.cos(math.pi * t)) / 2


def one_cycle(pos: float, max_lr: float = LR, pct: float = 0.25, div: float = 25.0,
              div_final: float = 1e5, moms=(0.95, 0.85, 0.95)):
    """(lr, beta1) at `pos` in [0, 1): fastai's one-cycle, written out (train_one_cycle's
    defaults). Never exactly 0.0 or 1.0 here, so no value becomes a graph constant."""
    if pos < pct:
        t = pos / pct
        return _cosine(max_lr / div, max_lr, t), _cosine(moms[0], moms[1], t)
    t = (pos - pct) / (1 - pct)
    return _cosine(max_lr, max_lr / div_final, t), _cosine(moms[1], moms[2], t)
