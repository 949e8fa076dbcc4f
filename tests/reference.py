"""A plain CPU torch reference for examples/tpu_train.py, written without tpu_utility.

It walks the data in the order make_loader promises: for epoch e, the permutation
torch.randperm(n, seed + e), cut into global batches (per-core batch x cores).
"""
import torch
import torch.nn as nn

from cuda_train import make_dataset, make_model


def reference_train(epochs=3, global_batch=64, lr=1e-3, seed=0):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
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
