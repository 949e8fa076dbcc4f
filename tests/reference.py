"""Plain CPU torch references, written without tpu_utility: examples/tpu_train.py's loop
and a one-cycle loop whose schedule is the closed form.

Both walk the data in the order make_loader promises: for epoch e, the permutation
torch.randperm(n, seed + e), cut into global batches (per-core batch x cores).
"""
import math

import torch
import torch.nn as nn

from cuda_train import make_dataset, make_model


def reference_train(epochs=3, global_batch=64, lr=1e-3, seed=0, sgd=False):
    """`sgd=True`: plain SGD, whose step is proportional to the gradient, so that a sum of
    the replicas' gradients instead of their mean shows (Adam normalises the scale away)."""
    torch.manual_seed(0)
    model = make_model()
    opt = (torch.optim.SGD if sgd else torch.optim.Adam)(model.parameters(), lr=lr)
    x, y = make_dataset().tensors
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        steps = len(x) // global_batch
        total = 0.0
        for k in range(steps):
            idx = order[k * global_batch:(k + 1) * global_batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        losses.append(total / steps)
    return {"losses": torch.tensor(losses), "state": model.state_dict()}


def max_param_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def cosine(a, b, t):
    """From a (t=0) to b (t=1), half a cosine."""
    return b + (a - b) * (1 + math.cos(math.pi * t)) / 2


def one_cycle_lr(max_lr, pos, pct=0.25, div=25.0, div_final=1e5):
    if pos < pct:
        return cosine(max_lr / div, max_lr, pos / pct)
    return cosine(max_lr, max_lr / div_final, (pos - pct) / (1 - pct))


def one_cycle_mom(pos, pct=0.25, moms=(0.95, 0.85, 0.95)):
    if pos < pct:
        return cosine(moms[0], moms[1], pos / pct)
    return cosine(moms[1], moms[2], (pos - pct) / (1 - pct))


def reference_one_cycle(x, y, xv, yv, epochs, global_batch, max_lr, seed=0):
    """Adam under fastai's one-cycle schedule, then each epoch's validation loss and accuracy."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = len(x) // global_batch
    total, k = epochs * steps, 0
    valid_loss, valid_acc = [], []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        for s in range(steps):
            idx = order[s * global_batch:(s + 1) * global_batch]
            for g in opt.param_groups:
                g["lr"], g["betas"] = one_cycle_lr(max_lr, k / total), (one_cycle_mom(k / total), 0.999)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            k += 1
        with torch.no_grad():
            out = model(xv)
        valid_loss.append(nn.functional.cross_entropy(out, yv).item())
        valid_acc.append((out.argmax(1) == yv).float().mean().item())
    return {"state": model.state_dict(), "valid_loss": valid_loss, "accuracy": valid_acc}
