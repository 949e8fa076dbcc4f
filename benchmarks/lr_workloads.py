"""The workloads of bench_lr_rules.py, in plain torch (nothing from tpu_utility): for each,
its data (made from a fixed seed), its model (from the run's seed), its optimizer, loss,
metric and schedule length. Written for this benchmark; none is copied from elsewhere.

`DEVELOP` are the workloads lr_find's default rule was designed on; `HELD_OUT` were only
run once the rule was chosen, to check it on tasks it had never seen. `FINETUNE` (and
`FINETUNE_HELD_OUT`) start from a model trained first on a related task (issue 47): the
fine-tune rule was designed on the first and checked on the second.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class Workload:
    name: str
    describe: str
    data: Callable[[], tuple]  # () -> (train TensorDataset, valid TensorDataset)
    model: Callable[[], nn.Module]
    opt: Callable[[list], torch.optim.Optimizer]  # params -> optimizer (its lr is replaced)
    loss: Callable
    metric: Optional[Callable]  # per-sample, higher is better; None: judge by valid loss
    epochs: int
    batch_size: int
    loader_options: Callable[[], dict] = dict  # more make_loader arguments (augment=)
    grid: Optional[tuple] = None  # its own max_lr grid (the benchmark's when None)
    seeds: Optional[int] = None  # its own number of seeds (the benchmark's when None)
    # A fine-tune: model() -> the model to fine-tune, trained first on another task (plain
    # torch on the CPU, from the seed set just before); None: trained from scratch.
    pretrain: Optional[Callable[[nn.Module], nn.Module]] = None


def _split(x, y, n_valid):
    return TensorDataset(x[:-n_valid], y[:-n_valid]), TensorDataset(x[-n_valid:], y[-n_valid:])


def binary_accuracy(output, target):
    """Per-sample accuracy of one logit against a 0/1 float target."""
    return ((output.reshape(-1) > 0).float() == target.reshape(-1)).float()


def bce(output, target, reduction="mean"):
    return F.binary_cross_entropy_with_logits(output.reshape(-1), target.reshape(-1),
                                              reduction=reduction)


def mse(output, target, reduction="mean"):
    return F.mse_loss(output.reshape(target.shape), target, reduction=reduction)


# -- the data ------------------------------------------------------------------------------

def spiral_data(n=3000, arms=3, noise=0.25):
    """Points on interleaved spiral arms in 2-D; the class is the arm."""
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, arms, (n,), generator=g)
    r = torch.rand(n, generator=g) * 3 + 0.3
    theta = r * 2.2 + y * (2 * math.pi / arms)
    x = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], 1)
    return _split(x + noise * torch.randn(n, 2, generator=g), y, 600)


def strokes_data(n=3600, size=16, seed=2, noise=0.6, contrast=0.8, n_valid=600):
    """One-channel noisy images of a stroke: horizontal, vertical, diagonal, or a cross."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    img = noise * torch.randn(n, 1, size, size, generator=g)
    r = torch.randint(3, size - 3, (n, 2), generator=g)
    length = torch.randint(4, 7, (n,), generator=g)
    ii = torch.arange(size).view(1, size, 1)
    jj = torch.arange(size).view(1, 1, size)
    ci, cj, ln = r[:, 0].view(-1, 1, 1), r[:, 1].view(-1, 1, 1), length.view(-1, 1, 1)
    horiz = ((ii == ci) & ((jj - cj).abs() <= ln // 2)).float()
    vert = ((jj == cj) & ((ii - ci).abs() <= ln // 2)).float()
    diag = (((ii - ci) == (jj - cj)) & ((ii - ci).abs() <= ln // 2)).float()
    shape = torch.where(y.view(-1, 1, 1) == 0, horiz, torch.where(
        y.view(-1, 1, 1) == 1, vert, torch.where(y.view(-1, 1, 1) == 2, diag,
                                                 (horiz + vert).clamp(max=1))))
    contrast = contrast + torch.rand(n, 1, 1, generator=g)
    return _split(img + (shape * contrast).unsqueeze(1), y, n_valid)


def friedman_data(n=5000):
    """Friedman's regression function #1 on 10 uniform features (5 of them noise)."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(n, 10, generator=g)
    y = (10 * torch.sin(math.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2
         + 10 * x[:, 3] + 5 * x[:, 4] + torch.randn(n, generator=g))
    y = (y - 14.4) / 5.0  # about unit scale
    return _split(x, y.unsqueeze(1), 1000)


def order_data(n=5000, length=16, vocab=24):
    """Token sequences that hold a 1 and a 2 once each; the class is whether the 1 comes first."""
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(3, vocab, (n, length), generator=g)
    places = torch.rand(n, length, generator=g).argsort(1)[:, :2]
    seq.scatter_(1, places[:, :1], 1)
    seq.scatter_(1, places[:, 1:], 2)
    y = (places[:, 0] < places[:, 1]).long()
    return _split(seq, y, 1000)


def gratings_data(n=3600, size=16):
    """Three-channel noisy gratings: the class is the orientation (0, 45, 90, 135 degrees)."""
    g = torch.Generator().manual_seed(5)
    y = torch.randint(0, 4, (n,), generator=g)
    angle = y.float() * math.pi / 4 + 0.15 * torch.randn(n, generator=g)
    freq = 0.5 + 0.7 * torch.rand(n, generator=g)
    phase = 2 * math.pi * torch.rand(n, generator=g)
    ii = torch.arange(size).float().view(1, size, 1)
    jj = torch.arange(size).float().view(1, 1, size)
    wave = torch.sin(freq.view(-1, 1, 1) * (torch.cos(angle).view(-1, 1, 1) * jj
                                            + torch.sin(angle).view(-1, 1, 1) * ii)
                     + phase.view(-1, 1, 1))
    colour = torch.rand(n, 3, 1, 1, generator=g)
    img = colour * wave.unsqueeze(1) + 1.2 * torch.randn(n, 3, size, size, generator=g)
    return _split(img, y, 600)


def tabular_data(n=6000):
    """Four categorical columns (cardinalities 10, 50, 7, 100) and six numeric ones; a
    binary target from a hidden model with interactions, 10% of labels flipped."""
    g = torch.Generator().manual_seed(6)
    cards = (10, 50, 7, 100)
    cats = torch.stack([torch.randint(0, c, (n,), generator=g) for c in cards], 1)
    nums = torch.randn(n, 6, generator=g)
    effects = [torch.randn(c, generator=g) for c in cards]
    logit = sum(e[cats[:, i]] for i, e in enumerate(effects)) + nums[:, 0] * nums[:, 1] \
        + torch.sin(2 * nums[:, 2]) + effects[0][cats[:, 0]] * nums[:, 3]
    y = (logit > logit.median()).float()
    flip = torch.rand(n, generator=g) < 0.1
    y = torch.where(flip, 1 - y, y)
    x = torch.cat([cats.float(), nums], 1)  # the model splits them again
    return _split(x, y, 1200)


def waves_data(n=4000, length=64):
    """Noisy one-channel signals: the class is which of 5 frequencies the signal carries."""
    g = torch.Generator().manual_seed(7)
    y = torch.randint(0, 5, (n,), generator=g)
    t = torch.arange(length).float()
    freq = (0.15 + 0.07 * y.float() + 0.01 * torch.randn(n, generator=g)).view(-1, 1)
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    x = torch.sin(freq * t + phase) + 1.0 * torch.randn(n, length, generator=g)
    return _split(x.unsqueeze(1), y, 800)


def manifold_data(n=5000, dim=48):
    """Points near a 4-dimensional curved manifold in 48 dimensions, for an autoencoder."""
    g = torch.Generator().manual_seed(8)
    z = torch.randn(n, 4, generator=g)
    a, b = torch.randn(4, dim, generator=g), torch.randn(4, dim, generator=g)
    x = torch.tanh(z @ a) + 0.5 * torch.sin(z @ b) + 0.05 * torch.randn(n, dim, generator=g)
    return _split(x, x.clone(), 1000)


def teacher_data(n=6000, features=20, classes=5):
    """Features through a random two-layer teacher network; the class is its argmax."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, features, generator=g)
    w1, w2 = torch.randn(features, 32, generator=g), torch.randn(32, classes, generator=g)
    y = (torch.tanh(x @ w1) @ w2 + 0.3 * torch.randn(n, classes, generator=g)).argmax(1)
    return _split(x, y, 1000)


def words_data(n=6000, length=24, vocab=300):
    """Token sequences; each token carries a hidden score, and the class is the sign of
    the sum (a bag-of-words sentiment)."""
    g = torch.Generator().manual_seed(10)
    score = torch.randn(vocab, generator=g) * (torch.rand(vocab, generator=g) < 0.2)
    seq = torch.randint(0, vocab, (n, length), generator=g)
    y = (score[seq].sum(1) > 0).long()
    return _split(seq, y, 1000)


def majority_data(n=5000, length=16, vocab=24):
    """Token sequences holding a few 1s and 2s among others; the class is whether the 1s
    outnumber the 2s (never tied)."""
    g = torch.Generator().manual_seed(11)
    seq = torch.randint(3, vocab, (n, length), generator=g)
    ones = torch.randint(0, 6, (n,), generator=g)
    twos = (ones + torch.randint(1, 5, (n,), generator=g) * (2 * torch.randint(0, 2, (n,), generator=g) - 1)).clamp(0, 9)
    twos = torch.where(twos == ones, ones + 1, twos)
    places = torch.rand(n, length, generator=g).argsort(1)
    for i in range(n):  # small n: a loop is clearest
        seq[i, places[i, :ones[i]]] = 1
        seq[i, places[i, ones[i]:ones[i] + twos[i]]] = 2
    return _split(seq, (ones > twos).long(), 1000)


# -- the models ----------------------------------------------------------------------------

class Encoder(nn.Module):
    """A two-layer transformer encoder with dropout and LayerNorm, mean-pooled."""

    def __init__(self, vocab=24, length=16, d=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(length, d))
        layer = nn.TransformerEncoderLayer(d, 4, 128, dropout=0.1, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 2)

    def forward(self, seq):
        return self.head(self.norm(self.layers(self.embed(seq) + self.pos)).mean(1))


class Bag(nn.Module):
    """Mean of token embeddings, then a small head."""

    def __init__(self, vocab=300, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.head = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, seq):
        return self.head(self.embed(seq).mean(1))


class Tabular(nn.Module):
    """Embeddings for the categorical columns, concatenated with the numeric ones, an MLP."""

    def __init__(self, cards=(10, 50, 7, 100), numeric=6):
        super().__init__()
        self.embeds = nn.ModuleList(nn.Embedding(c, 8) for c in cards)
        self.mlp = nn.Sequential(nn.Linear(8 * len(cards) + numeric, 128), nn.ReLU(),
                                 nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x):
        cats = x[:, :len(self.embeds)].long()
        parts = [e(cats[:, i]) for i, e in enumerate(self.embeds)]
        return self.mlp(torch.cat(parts + [x[:, len(self.embeds):]], 1))


def _cnn_bn():
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                             nn.MaxPool2d(2))
    return nn.Sequential(block(1, 16), block(16, 32), nn.Flatten(), nn.Linear(32 * 16, 4))


def _cnn_plain():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 4))


def _conv1d():
    return nn.Sequential(nn.Conv1d(1, 16, 7, padding=3), nn.GELU(), nn.MaxPool1d(2),
                         nn.Conv1d(16, 32, 5, padding=2), nn.GELU(), nn.MaxPool1d(2),
                         nn.Conv1d(32, 32, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool1d(1),
                         nn.Flatten(), nn.LayerNorm(32), nn.Linear(32, 5))


def _deep_ln():
    layers = [nn.Linear(20, 128)]
    for _ in range(3):
        layers += [nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 128)]
    return nn.Sequential(*layers, nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 5))


def _cnn_gray():
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 16, 4))


def _sgd_plain(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)


def _accuracy(output, target):
    return (output.argmax(-1) == target).float()


DEVELOP = [
    Workload("spiral MLP", "2-D 3-arm spirals, MLP 2-64-64-3, Adam, batch 32, 5 epochs",
             spiral_data, lambda: nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64),
                                                nn.ReLU(), nn.Linear(64, 3)),
             _adam, F.cross_entropy, _accuracy, 5, 32),
    Workload("strokes CNN+BN", "16x16 noisy strokes, 4 classes, 2 conv+BatchNorm blocks, Adam, "
             "batch 64, 4 epochs", strokes_data, _cnn_bn, _adam, F.cross_entropy, _accuracy, 4, 64),
    Workload("Friedman regression", "Friedman #1, MLP 10-128-128-1, AdamW, MSE, batch 64, 6 epochs",
             friedman_data, lambda: nn.Sequential(nn.Linear(10, 128), nn.ReLU(), nn.Linear(128, 128),
                                                  nn.ReLU(), nn.Linear(128, 1)),
             _adamw, mse, None, 6, 64),
    Workload("teacher deep MLP", "20 features through a random teacher, 5 classes, MLP of 4 "
             "LayerNorm+GELU layers, AdamW, batch 128, 4 epochs", teacher_data, _deep_ln, _adamw,
             F.cross_entropy, _accuracy, 4, 128),
    Workload("strokes CNN, SGD", "16x16 noisy strokes, plain CNN (no BatchNorm), SGD momentum "
             "0.9, batch 64, 5 epochs", strokes_data, _cnn_gray, _sgd_plain, F.cross_entropy,
             _accuracy, 5, 64),
    Workload("words bag", "bag-of-words sentiment over 300 tokens, mean of embeddings + MLP, "
             "Adam, batch 64, 4 epochs", words_data, Bag, _adam, F.cross_entropy, _accuracy, 4, 64),
]

HELD_OUT = [
    Workload("order transformer", "token order (does 1 come before 2), 2-layer encoder with "
             "dropout and LayerNorm, AdamW, batch 64, 6 epochs", order_data, Encoder, _adamw,
             F.cross_entropy, _accuracy, 6, 64),
    Workload("gratings CNN, SGD", "3-channel 16x16 gratings, 4 orientations, plain CNN, SGD "
             "momentum 0.9 nesterov, batch 64, 5 epochs", gratings_data, _cnn_plain, _sgd,
             F.cross_entropy, _accuracy, 5, 64),
    Workload("tabular embeddings", "4 categorical + 6 numeric columns, embeddings + MLP with "
             "dropout, BCE, Adam, batch 128, 5 epochs", tabular_data, Tabular, _adam, bce,
             binary_accuracy, 5, 128),
    Workload("waves conv1d", "64-step noisy signals, 5 frequencies, 1-D CNN with GELU and "
             "LayerNorm, AdamW, batch 32, 4 epochs", waves_data, _conv1d, _adamw, F.cross_entropy,
             _accuracy, 4, 32),
    Workload("majority transformer", "token counts (more 1s than 2s?), the same 2-layer encoder, "
             "AdamW, batch 64, 4 epochs; written after the default was chosen",
             majority_data, Encoder, _adamw, F.cross_entropy, _accuracy, 4, 64),
    Workload("manifold autoencoder", "48-D points near a 4-D manifold, MLP autoencoder "
             "48-64-8-64-48, Adam, MSE, batch 64, 8 epochs", manifold_data,
             lambda: nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 8), nn.ReLU(),
                                   nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 48)),
             _adam, mse, None, 8, 64),
]


# -- fine-tunes (issue 47) -----------------------------------------------------------------
# Each model is first trained on a source task in plain torch (`pretrain`, a few seconds on
# a CPU, from the run's seed), then fine-tuned on related data: noisy labels, a shifted
# input distribution, new classes on a new head, a shifted regression target. The grid
# reaches down to 1e-6: a fine-tune's best max_lr can sit far below a from-scratch one's.

FINE_GRID = tuple(float(f"{10 ** (e / 4):.2g}") for e in range(-24, 1))  # 1e-6 to 1


def _fit(model, data, opt, loss, epochs, batch):
    """Plain torch training at a constant lr, shuffled by torch's global generator."""
    x, y = data.tensors
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x))
        for i in range(0, len(x), batch):
            idx = perm[i:i + batch]
            opt.zero_grad()
            loss(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


def _blobs(n, seed, scale=2.2, classes=4, dim=10):
    """Gaussian clusters around fixed random centres (the same centres for every seed)."""
    centres = scale * torch.randn(classes, dim, generator=torch.Generator().manual_seed(12))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + torch.randn(n, dim, generator=g), y


def noisy_blobs_data(n=48, wrong=16, n_valid=1000):
    """The issue's fine-tune: 48 labelled points of the source task, a third of the labels
    wrong; validated on clean points."""
    x, y = _blobs(n, seed=13)
    g = torch.Generator().manual_seed(14)
    bad = torch.randperm(n, generator=g)[:wrong]
    y = y.clone()
    y[bad] = (y[bad] + torch.randint(1, 4, (wrong,), generator=g)) % 4
    xv, yv = _blobs(n_valid, seed=15)
    return TensorDataset(x, y), TensorDataset(xv, yv)


def _pretrain_blobs(model):
    x, y = _blobs(3000, seed=16)
    return _fit(model, TensorDataset(x, y), torch.optim.Adam(model.parameters(), lr=1e-3),
                F.cross_entropy, 5, 32)


def shifted_strokes_data():
    """Strokes as strokes_data draws them, but fainter (contrast 0.6-1.6, was 0.8-1.8) in
    more noise (0.8, was 0.6): 400 to fine-tune on."""
    return strokes_data(n=1000, seed=17, noise=0.8, contrast=0.6, n_valid=600)


def _pretrain_strokes(model):
    train, _ = strokes_data()
    return _fit(model, train, torch.optim.Adam(model.parameters(), lr=3e-3), F.cross_entropy, 6, 64)


def new_teacher_data(n=1300, classes=3):
    """teacher_data's inputs and first teacher layer, a new second layer with 3 classes:
    new classes from the same features; 300 to fine-tune on."""
    g = torch.Generator().manual_seed(9)
    torch.randn(6000, 20, generator=g)  # teacher_data's inputs, drawn first
    w1 = torch.randn(20, 32, generator=g)
    g = torch.Generator().manual_seed(18)
    x = torch.randn(n, 20, generator=g)
    w2 = torch.randn(32, classes, generator=g)
    y = (torch.tanh(x @ w1) @ w2 + 0.3 * torch.randn(n, classes, generator=g)).argmax(1)
    return _split(x, y, 1000)


def _pretrain_teacher_new_head(model):
    train, _ = teacher_data()
    _fit(model, train, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
         F.cross_entropy, 4, 128)
    model[-1] = nn.Linear(128, 3)  # a new head for the new classes
    return model


def shifted_friedman_data(n=1300):
    """Friedman #1 with its target shifted: x3's weight 10 -> 13, and x5 (noise before)
    now counts; 300 to fine-tune on."""
    g = torch.Generator().manual_seed(19)
    x = torch.rand(n, 10, generator=g)
    y = (10 * torch.sin(math.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2
         + 13 * x[:, 3] + 5 * x[:, 4] + 3 * x[:, 5] + torch.randn(n, generator=g))
    y = (y - 14.4) / 5.0  # friedman_data's scale
    return _split(x, y.unsqueeze(1), 1000)


def _pretrain_friedman(model):
    train, _ = friedman_data()
    return _fit(model, train, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                mse, 4, 64)


def _mlp(*widths):
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _sgd_ft(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


FINETUNE = [
    Workload("noisy labels MLP", "the issue's: MLP 10-64-64-4 trained on 4 Gaussian blobs "
             "(3000 points, Adam, 5 epochs), fine-tuned on 48 points with a third of the labels wrong, "
             "Adam, batch 8, 8 epochs; clean validation", noisy_blobs_data,
             lambda: _mlp(10, 64, 64, 4), _adam, F.cross_entropy, _accuracy, 8, 8,
             grid=FINE_GRID, pretrain=_pretrain_blobs),
    Workload("shifted strokes CNN+BN, SGD", "the strokes CNN+BN trained on strokes (Adam, 6 "
             "epochs), fine-tuned on 400 fainter, noisier strokes, SGD momentum 0.9, batch 32, "
             "5 epochs", shifted_strokes_data, _cnn_bn, _sgd_ft, F.cross_entropy, _accuracy, 5,
             32, grid=FINE_GRID, pretrain=_pretrain_strokes),
    Workload("teacher new head", "the teacher deep MLP trained on its 5 classes (AdamW, 4 "
             "epochs), a new head for 3 new classes of the same features, 300 points, AdamW, "
             "batch 32, 6 epochs", new_teacher_data, _deep_ln, _adamw, F.cross_entropy,
             _accuracy, 6, 32, grid=FINE_GRID, pretrain=_pretrain_teacher_new_head),
    Workload("shifted Friedman", "the Friedman MLP trained on Friedman #1 (AdamW, 4 epochs), "
             "fine-tuned on 300 points of a shifted target, Adam, MSE, batch 32, 8 epochs",
             shifted_friedman_data, lambda: _mlp(10, 128, 128, 1), _adam, mse, None, 8, 32,
             grid=FINE_GRID, pretrain=_pretrain_friedman),
]



def shifted_words_data(n=1400, length=24, vocab=300):
    """words_data's token scores with 30% of the scoring tokens' signs flipped (a new
    domain's sentiment); 400 to fine-tune on."""
    g = torch.Generator().manual_seed(10)
    score = torch.randn(vocab, generator=g) * (torch.rand(vocab, generator=g) < 0.2)
    g = torch.Generator().manual_seed(20)
    score = torch.where(torch.rand(vocab, generator=g) < 0.3, -score, score)
    seq = torch.randint(0, vocab, (n, length), generator=g)
    return _split(seq, (score[seq].sum(1) > 0).long(), 1000)


def _pretrain_words(model):
    train, _ = words_data()
    return _fit(model, train, torch.optim.Adam(model.parameters(), lr=1e-3), F.cross_entropy, 4, 64)


def new_waves_data(n=1100, length=64):
    """Signals as waves_data makes them, at 3 new frequencies between its 5; 300 to
    fine-tune on."""
    g = torch.Generator().manual_seed(21)
    y = torch.randint(0, 3, (n,), generator=g)
    t = torch.arange(length).float()
    freq = (0.185 + 0.07 * y.float() + 0.01 * torch.randn(n, generator=g)).view(-1, 1)
    phase = 2 * math.pi * torch.rand(n, 1, generator=g)
    x = torch.sin(freq * t + phase) + 1.0 * torch.randn(n, length, generator=g)
    return _split(x.unsqueeze(1), y, 800)


def _pretrain_waves_new_head(model):
    train, _ = waves_data()
    _fit(model, train, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
         F.cross_entropy, 3, 32)
    model[-1] = nn.Linear(32, 3)  # a new head for the new frequencies
    return model


# Written before the rule was chosen, run only after it was fixed.
FINETUNE_HELD_OUT = [
    Workload("shifted words bag", "the words bag trained on its sentiment (Adam, 4 epochs), "
             "fine-tuned on 400 sequences of a domain where 30% of the scoring tokens flip "
             "sign, Adam, batch 32, 5 epochs", shifted_words_data, Bag, _adam, F.cross_entropy,
             _accuracy, 5, 32, grid=FINE_GRID, pretrain=_pretrain_words),
    Workload("waves conv1d new head, SGD", "the waves 1-D CNN trained on its 5 frequencies "
             "(AdamW, 3 epochs), a new head for 3 new frequencies, 300 signals, SGD momentum "
             "0.9 nesterov, batch 32, 6 epochs", new_waves_data, _conv1d, _sgd, F.cross_entropy,
             _accuracy, 6, 32, grid=FINE_GRID, pretrain=_pretrain_waves_new_head),
]
