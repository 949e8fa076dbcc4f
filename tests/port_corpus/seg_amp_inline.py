"""A small segmentation run: a U-shaped net, mixed precision with a GradScaler that
unscales before clipping, a log line per step and a histogram round per epoch, all
inline under the `__main__` guard.

Written for tpu_utility's tests in the shape of public segmentation scripts.
"""
import argparse
import logging
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class TinyUNet(nn.Module):
    def __init__(self, channels=4, classes=3):
        super().__init__()
        self.down = nn.Conv2d(1, channels, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(channels, channels, 3, padding=1)
        self.up = nn.ConvTranspose2d(channels, channels, 2, stride=2)
        self.head = nn.Conv2d(2 * channels, classes, 1)

    def forward(self, x):
        skip = F.relu(self.down(x))
        deep = F.relu(self.mid(self.pool(skip)))
        return self.head(torch.cat([skip, self.up(deep)], dim=1))


def dice_loss(logits, target, classes, eps=1e-6):
    probs = logits.softmax(dim=1)
    onehot = F.one_hot(target, classes).permute(0, 3, 1, 2).float()
    inter = (probs * onehot).sum(dim=(0, 2, 3))
    union = probs.sum(dim=(0, 2, 3)) + onehot.sum(dim=(0, 2, 3))
    return 1 - ((2 * inter + eps) / (union + eps)).mean()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stdout)

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logging.info(f"Using device {device}")
    images = torch.randn(32, 1, 8, 8)
    masks = (images > 0).long()[:, 0] + (images > 1).long()[:, 0]
    # the whole set is one batch: the loss of a step does not depend on the order of rows
    loader = DataLoader(TensorDataset(images, masks), batch_size=args.batch_size, shuffle=True,
                        drop_last=True)
    model = TinyUNet().to(device)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=args.lr, momentum=0.9)
    grad_scaler = torch.cuda.amp.GradScaler(enabled=args.amp)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        model.train()
        for batch_images, batch_masks in loader:
            batch_images = batch_images.to(device=device, dtype=torch.float32)
            batch_masks = batch_masks.to(device=device, dtype=torch.long)
            with torch.cuda.amp.autocast(enabled=args.amp):
                pred = model(batch_images)
                loss = criterion(pred, batch_masks) + dice_loss(pred, batch_masks, 3)
            optimizer.zero_grad(set_to_none=True)
            grad_scaler.scale(loss).backward()
            grad_scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            grad_scaler.step(optimizer)
            grad_scaler.update()
            logging.info(f"epoch {epoch} step done")
            print(f"epoch {epoch} LOSS {loss.item():.6f}")
        histograms = {}
        for tag, value in model.named_parameters():
            tag = tag.replace("/", ".")
            histograms["Weights/" + tag] = value.data.cpu()
            histograms["Gradients/" + tag] = value.grad.data.cpu()
        logging.info(f"epoch {epoch}: {len(histograms)} histograms")
