"""bench_training.py's workloads, in plain torch (nothing from tpu_utility): for each, the
model, the synthetic data, the loss, the optimizer and the per-step schedule that the
hand-written and the swapped loops write out.

- `mlp`: benchmarks/workload.py's MLP 128-512-512-10 (kept there: other benchmarks train
  it too), Adam, cross-entropy; one-cycle lr and beta1.
- `cnn`: 3x32x32 images, 10 classes; three Conv3x3-BatchNorm2d-ReLU-MaxPool blocks (8,
  16, 32 channels), Dropout(0.25), a linear head; cross-entropy with label_smoothing=0.1;
  SGD(momentum=0.9, nesterov=True, weight_decay=5e-4); one-cycle lr and momentum. The
  widths are small so that a step on XLA:CPU is not all device time (at 16-32-64 and 32
  images a step ran ~6 ms of host CPU against 16-33 ms of wall time; at 8-16-32 ~5 ms
  against ~15 ms): the benchmark is about the host's cost of tracing a step.
- `cnn-adam`: the same CNN with Adam and plain cross-entropy, as the MLP (one-cycle lr and
  beta1).
- `transformer`: sequences of 32 tokens of 64; token embedding + learned positions, a
  2-layer nn.TransformerEncoder (d_model 64, 4 heads, feed-forward 128, dropout 0.1,
  batch_first, pre-norm), mean over the sequence, a linear head; cross-entropy; AdamW(
  weight_decay=0.01); a LambdaLR stepped every batch (linear warm-up over the first 10% of
  the call's steps, then linear decay) and clip_grad_norm_(1.0) before every step.

Every dataset has a learnable rule (a random linear teacher on a summary of the input), so
the loss falls. The one-cycle schedule is fastai's, written out with the same floating-point
operations as tpu_utility.schedules, so the loops feed the optimizer the very floats that
train_one_cycle feeds it.

Nothing here imports torch at module level: bench_training.py's parent reads only the
names and sizes.
"""
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

CLASSES = 10
IMAGE = (3, 32, 32)
CNN_WIDTHS = (8, 16, 32)  # conv channels of the three blocks
VOCAB, SEQ, D_MODEL, HEADS, FF = 64, 32, 64, 4, 128


@dataclass(frozen=True)
class Workload:
    """What the three variants train. Exactly one of `set_hypers` (called before every
    optimizer step with the position in [0, 1) through the call's steps) and
    `make_schedule` (`make_schedule(opt, total_steps)`: an LR scheduler stepped after
    every optimizer step, made afresh per call) is set; train_one_cycle uses its own
    one-cycle schedule from `max_lr`, either way."""

    name: str
    describe: str
    samples: int  # default; --samples overrides
    batch_size: int  # per core; --batch-size overrides
    max_lr: float
    make_dataset: Callable  # (samples) -> Dataset of (x, y)
    make_model: Callable  # () -> nn.Module on the CPU, the same weights every call
    make_optimizer: Callable  # (params) -> Optimizer
    loss_fn: Callable  # (output, target) -> scalar loss
    set_hypers: Optional[Callable] = None
    make_schedule: Optional[Callable] = None
    clip: Optional[float] = None  # clip_grad_norm_ before every step


# -- the one-cycle schedule (train_one_cycle's defaults), written out -----------------------

def _sched_cos(start, end, pos):
    # tpu_utility.schedules.sched_cos's very operations: the same floats, bit for bit
    return start + (1 + math.cos(math.pi * (1 - pos))) * (end - start) / 2


def one_cycle(pos, max_lr, pct=0.25, div=25.0, div_final=1e5, moms=(0.95, 0.85, 0.95)):
    """(lr, momentum) at `pos` in [0, 1). Never exactly 0.0 or 1.0 here, so no value
    becomes a graph constant (torch_xla's special scalars)."""
    if pos < pct:
        t = pos / pct
        return _sched_cos(max_lr / div, max_lr, t), _sched_cos(moms[0], moms[1], t)
    t = (pos - pct) / (1 - pct)
    return _sched_cos(max_lr, max_lr / div_final, t), _sched_cos(moms[1], moms[2], t)


def set_lr_beta1(opt, pos, max_lr):
    """Adam's: lr and beta1, on every param group (what train_one_cycle writes)."""
    lr, mom = one_cycle(pos, max_lr)
    for group in opt.param_groups:
        group["lr"] = lr
        group["betas"] = (mom, group["betas"][1])


def set_lr_momentum(opt, pos, max_lr):
    """SGD's: lr and momentum, on every param group (what train_one_cycle writes)."""
    lr, mom = one_cycle(pos, max_lr)
    for group in opt.param_groups:
        group["lr"] = lr
        group["momentum"] = mom


# -- mlp: benchmarks/workload.py's ----------------------------------------------------------

def mlp_dataset(n):
    import workload
    return workload.make_dataset(n)


def mlp_model():
    import workload
    return workload.make_model()


def adam(params, lr):
    import torch
    return torch.optim.Adam(params, lr=lr)


def cross_entropy(output, target):
    import torch.nn.functional as F
    return F.cross_entropy(output, target)


# -- cnn --------------------------------------------------------------------------------------

CNN_LR, CNN_ADAM_LR = 0.05, 1e-3


def cnn_dataset(n):
    """Gaussian images; the class from a random linear teacher on their 4x4 average-pooled
    pixels, plus noise."""
    import torch
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *IMAGE, generator=g)
    pooled = F.avg_pool2d(x, 8).flatten(1)  # (n, 3 * 4 * 4)
    teacher = torch.randn(pooled.shape[1], CLASSES, generator=g)
    y = (pooled @ teacher + 0.25 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def cnn_model():
    import torch
    import torch.nn as nn

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]
    torch.manual_seed(0)
    a, b, c = CNN_WIDTHS
    return nn.Sequential(*block(3, a), *block(a, b), *block(b, c), nn.Flatten(),
                         nn.Dropout(0.25), nn.Linear(c * 4 * 4, CLASSES))


def sgd_nesterov(params):
    import torch
    return torch.optim.SGD(params, lr=CNN_LR, momentum=0.9, nesterov=True, weight_decay=5e-4)


def smoothed_cross_entropy(output, target):
    import torch.nn.functional as F
    return F.cross_entropy(output, target, label_smoothing=0.1)


# -- transformer ------------------------------------------------------------------------------

TRANSFORMER_LR = 1e-3


def transformer_dataset(n):
    """Uniform random tokens; the class from a random linear teacher on each sequence's
    token counts, plus noise."""
    import torch
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    counts = torch.zeros(n, VOCAB).scatter_add_(1, tokens, torch.ones(n, SEQ))
    teacher = torch.randn(VOCAB, CLASSES, generator=g)
    y = (counts @ teacher + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(tokens, y)


def transformer_model():
    import torch
    import torch.nn as nn

    class Classifier(nn.Module):
        # Defined here so that importing this module needs no torch (see the docstring).
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Parameter(0.02 * torch.randn(SEQ, D_MODEL))
            layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.1, batch_first=True,
                                               norm_first=True)
            # enable_nested_tensor matters for padded eval batches only, and pre-norm
            # layers refuse it with a warning
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(D_MODEL, CLASSES)

        def forward(self, tokens):
            h = self.encoder(self.embed(tokens) + self.pos)
            return self.head(h.mean(1))
    torch.manual_seed(0)
    return Classifier()


def adamw(params):
    import torch
    return torch.optim.AdamW(params, lr=TRANSFORMER_LR, weight_decay=0.01)


def warmup_then_decay(total, warmup_pct=0.1):
    """LambdaLR's factor at scheduler step s (0 .. total-1 are used): linear warm-up to 1 over
    the first `warmup_pct` of the steps, then linear decay towards 0. It starts at 1/warmup,
    not 0: an lr of 0.0 would be a graph constant, a graph of its own."""
    warmup = max(1, round(warmup_pct * total))

    def factor(s):
        if s < warmup:
            return (s + 1) / warmup
        return max(total - s, 1) / max(total - warmup, 1)
    return factor


def lambda_lr(opt, total):
    import torch
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay(total))


# -- the registry -----------------------------------------------------------------------------

def _mlp():
    lr = 1e-3  # workload.LR, without importing torch here
    return Workload(
        "mlp", "MLP 128-512-512-10 (workload.py), Adam, cross-entropy, one-cycle lr and beta1",
        8192, 64, lr, mlp_dataset, mlp_model, functools.partial(adam, lr=lr), cross_entropy,
        set_hypers=functools.partial(set_lr_beta1, max_lr=lr))


WORKLOADS = {
    "mlp": _mlp(),
    "cnn": Workload(
        "cnn", "CNN 3x32x32 conv-BN-ReLU-pool x3 (8-16-32), dropout 0.25, SGD Nesterov "
        "wd 5e-4, label smoothing 0.1, one-cycle lr and momentum",
        4096, 32, CNN_LR, cnn_dataset, cnn_model, sgd_nesterov, smoothed_cross_entropy,
        set_hypers=functools.partial(set_lr_momentum, max_lr=CNN_LR)),
    "transformer": Workload(
        "transformer", "transformer encoder 2 layers d64 h4 ff128 dropout 0.1, seq 32 vocab 64, "
        "AdamW wd 0.01, LambdaLR warm-up/decay per batch, clip 1.0",
        2048, 32, TRANSFORMER_LR, transformer_dataset, transformer_model, adamw, cross_entropy,
        make_schedule=lambda_lr, clip=1.0),
    "cnn-adam": Workload(
        "cnn-adam", "the CNN with Adam, cross-entropy, one-cycle lr and beta1",
        4096, 32, CNN_ADAM_LR, cnn_dataset, cnn_model, functools.partial(adam, lr=CNN_ADAM_LR),
        cross_entropy, set_hypers=functools.partial(set_lr_beta1, max_lr=CNN_ADAM_LR)),
}
DEFAULT = ("mlp", "cnn", "transformer")
