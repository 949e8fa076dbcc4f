"""Entry point of a small multi-file project: parses the settings, builds the data, the
model, the optimizer and the schedule, and hands them to loops.train.

Written for tpu_utility's tests in the shape of a multi-file fine-tuning project
(main.py, loops.py, model.py, data.py, config.py).
"""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

import config
import loops
from data import SyntheticSequences
from model import SequenceClassifier


def linear_warmup(optimizer, warmup, total):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.0, (total - step) / total))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=config.BATCH_SIZE)
    parser.add_argument("--epochs", type=int, default=config.EPOCHS)
    parser.add_argument("--lr", type=float, default=config.LR)
    args = parser.parse_args()

    torch.manual_seed(config.SEED)
    train_loader = DataLoader(SyntheticSequences(config.N_TRAIN, seed=1), batch_size=args.batch_size,
                              shuffle=True, drop_last=True)
    valid_loader = DataLoader(SyntheticSequences(config.N_VALID, seed=2), batch_size=args.batch_size)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = SequenceClassifier()
    if torch.cuda.device_count() > 1:
        print(f"using {torch.cuda.device_count()} GPUs")
        model = nn.DataParallel(model)
    if torch.cuda.is_available():
        model = model.cuda()

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = linear_warmup(optimizer, config.WARMUP_STEPS, args.epochs * len(train_loader))
    model = loops.train(model, train_loader, valid_loader, optimizer, scheduler, device, args.epochs)
    torch.save(model.state_dict(), config.CHECKPOINT)


if __name__ == "__main__":
    main()
