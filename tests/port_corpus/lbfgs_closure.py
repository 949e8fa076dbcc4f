"""Curve fitting with LBFGS: the optimizer calls a closure that runs backward() itself.

Written for tpu_utility's tests in the shape of pytorch/examples' time_sequence_prediction.
"""
import sys

import torch
import torch.nn as nn


def make_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(-2, 2, n).unsqueeze(1)
    y = torch.sin(2 * x) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def fit(steps=4):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x, y = make_data(64)
    x, y = x.to(device), y.to(device)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=4)
    for i in range(steps):
        def closure():
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            return loss
        optimizer.step(closure)
        print("STEP %d loss: %.6f" % (i, criterion(model(x), y).item()))
    return model


if __name__ == "__main__":
    fit(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
