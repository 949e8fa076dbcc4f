"""A classifier whose log lines continue with `%` and `!=` at the start of a line, inside
brackets and after a backslash: Python's operators, not IPython magics.

Written for tpu_utility's tests.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

TEMPLATE = """epoch %d
%% done"""


def train(model, device, loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % 2 == 0:
            print("Train Epoch: %d [%d/%d]\tLOSS %.6f"
                  % (epoch, batch_idx * len(data), len(loader.dataset), loss.item()))
    changed = (epoch
               != 0)
    return changed \
        % 2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), args.batch_size, False)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(1, 4):
        train(model, device, loader, optimizer, epoch)
    print(TEMPLATE % 3)


if __name__ == "__main__":
    main()
