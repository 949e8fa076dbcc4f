"""A Kaggle k-fold baseline: a config dict, dict batches, DataLoader(dataset=...), a linear
warmup stepped every batch, gradient clipping, validation inside the epoch, and the fold
loop inline at the top level under `with timer():`.

Written for tpu_utility's tests in the shape of a Kaggle transformer baseline.
"""
import os
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

CFG = {"folds": 3, "epochs": 2, "batch_size": int(os.environ.get("BATCH_SIZE", 64)),
       "lr": 3e-3, "warmup": 2, "max_grad_norm": 1.0, "seed": 42}
DEVICE = "cuda"  # as the notebook had it
if not torch.cuda.is_available():
    DEVICE = "cpu"


@contextmanager
def timer(name="training"):
    t0 = time.time()
    yield
    print(f"[{name}] done in {time.time() - t0:.1f} s")


class TextDataset(Dataset):
    def __init__(self, ids, labels):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": (self.ids[i] > 0).long(),
                "labels": self.labels[i]}


class Model(nn.Module):
    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, 1)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        return self.head(h.sum(1) / attention_mask.sum(1, keepdim=True).clamp(min=1)).squeeze(-1)


def warmup_schedule(optimizer, warmup, total):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.0, (total - step) / total))


rng = np.random.RandomState(CFG["seed"])
ids = torch.from_numpy(rng.randint(0, 50, (192, 12)))
labels = (ids[:, :4].float().mean(1) / 25 - 1).float()
folds = np.arange(192) % CFG["folds"]
torch.manual_seed(CFG["seed"])

oof = np.zeros(192)
with timer():
    for fold in range(CFG["folds"]):
        tr, va = np.where(folds != fold)[0], np.where(folds == fold)[0]
        train_loader = DataLoader(dataset=TextDataset(ids[tr], labels[tr]),
                                  batch_size=CFG["batch_size"], shuffle=True, drop_last=True)
        valid_loader = DataLoader(dataset=TextDataset(ids[va], labels[va]),
                                  batch_size=CFG["batch_size"], shuffle=False)
        model = Model().to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=CFG["lr"], weight_decay=0.01)
        scheduler = warmup_schedule(optimizer, CFG["warmup"], CFG["epochs"] * len(train_loader))
        for epoch in range(CFG["epochs"]):
            model.train()
            for batch in train_loader:
                batch = {k: v.to(DEVICE) for k, v in batch.items()}
                loss = nn.functional.mse_loss(model(batch["input_ids"], batch["attention_mask"]),
                                              batch["labels"])
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["max_grad_norm"])
                optimizer.step()
                scheduler.step()
            model.eval()
            total = torch.zeros((), device=DEVICE)
            with torch.no_grad():
                for batch in valid_loader:
                    batch = {k: v.to(DEVICE) for k, v in batch.items()}
                    pred = model(batch["input_ids"], batch["attention_mask"])
                    total += nn.functional.mse_loss(pred, batch["labels"], reduction="sum")
            print(f"fold {fold} epoch {epoch} VALID {float(total) / len(va):.6f}")
        torch.save(model.state_dict(), f"model_fold{fold}.pt")
