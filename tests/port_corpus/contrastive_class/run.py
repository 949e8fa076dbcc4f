"""A two-view contrastive run: the settings and the data here, the training loop a method
of a class in simclr.py, run under `with torch.cuda.device(args.gpu_index):`.

Written for tpu_utility's tests in the shape of public contrastive-learning scripts.
"""
import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from simclr import SimCLR, Encoder

parser = argparse.ArgumentParser(description="contrastive")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--temperature", type=float, default=0.5)
parser.add_argument("--n-views", type=int, default=2)
parser.add_argument("--fp16-precision", action="store_true")
parser.add_argument("--gpu-index", type=int, default=0)


def main():
    args = parser.parse_args()
    if torch.cuda.is_available():
        args.device = torch.device("cuda")
    else:
        args.device = torch.device("cpu")
        args.gpu_index = -1
    torch.manual_seed(0)
    base = torch.randn(32, 8)
    view_1 = base + 0.1 * torch.randn(32, 8)
    view_2 = base + 0.1 * torch.randn(32, 8)
    # the whole set is one batch: the loss of a step does not depend on the order of rows
    train_loader = DataLoader(TensorDataset(view_1, view_2), batch_size=args.batch_size,
                              shuffle=True, drop_last=True)
    model = Encoder()
    optimizer = torch.optim.Adam(model.parameters(), args.lr, weight_decay=1e-4)
    with torch.cuda.device(args.gpu_index):
        simclr = SimCLR(model=model, optimizer=optimizer, args=args)
        simclr.train(train_loader)


if __name__ == "__main__":
    main()
