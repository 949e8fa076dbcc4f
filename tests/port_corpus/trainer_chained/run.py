"""A regression trained by a Trainer made and used in one expression,
`Trainer(model, opt, device).train(loader)`, its `__init__` moving the model after the
optimizer took its parameters; then the head fine-tuned by a staticmethod called on its
class, `Finetune.run(...)` (issue 60). Both classes live in engine.py.

Written for tpu_utility's tests in the shape of public trainer-class scripts.
"""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from engine import Finetune, Trainer

parser = argparse.ArgumentParser(description="chained trainer")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.05)


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x = torch.randn(32, 6)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(32, 1)
    # the whole set is one batch: the loss of a step does not depend on the order of rows
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True,
                        drop_last=True)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    Trainer(model, opt, device).train(loader, args.epochs)
    optimizer = torch.optim.Adam(model.head.parameters(), lr=args.lr / 5)
    Finetune.run(model, optimizer, loader, device)


if __name__ == "__main__":
    main()
