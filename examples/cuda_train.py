"""A functional training script, written the way Kaggle notebooks write them.

examples/cuda_train.py is the CUDA original and examples/tpu_train.py the same script
after the tpu_utility swaps: `diff examples/cuda_train.py examples/tpu_train.py`.
"""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def make_dataset(n=2048, features=20, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return TensorDataset(x, y)


def make_model(features=20, classes=4):
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, classes))


def train_fn(epochs=3, batch_size=64, lr=1e-3):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loader = DataLoader(make_dataset(), batch_size=batch_size, shuffle=True, drop_last=True)
    losses = []
    for epoch in range(epochs):
        total = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.detach()  # stays on the device: no host read per step
        losses.append(total / len(loader))
    return {"losses": torch.stack(losses), "state": model.state_dict()}


if __name__ == "__main__":
    out = train_fn()
    print("mean train loss per epoch:", [round(v, 4) for v in out["losses"].cpu().tolist()])
