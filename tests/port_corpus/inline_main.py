"""Regression trained inline under `if __name__ == "__main__":`, with its settings parsed
there too.

Written for tpu_utility's tests.
"""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.body(x).squeeze(1)


def evaluate(model, loader, device):
    model.eval()
    with torch.no_grad():
        return sum(nn.functional.mse_loss(model(x.to(device)), y.to(device), reduction="sum")
                   for x, y in loader) / len(loader.dataset)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bs", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 6, generator=g)
    y = x @ torch.randn(6, generator=g) + 0.1 * torch.randn(256, generator=g)
    train_ds = TensorDataset(x[:192], y[:192])
    valid_ds = TensorDataset(x[192:], y[192:])
    train_loader = DataLoader(train_ds, batch_size=args.bs, shuffle=False)
    valid_loader = DataLoader(valid_ds, batch_size=args.bs)
    torch.manual_seed(3)
    model = Net(hidden=32).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(args.epochs):
        model.train()
        for xb, yb in train_loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
        print(f"epoch {epoch} VALID {float(evaluate(model, valid_loader, device)):.6f}")
