"""A tiny variational autoencoder on synthetic 1x16x16 images whose loops shape tensors by
`args.batch_size` (the datasets' lengths are multiples of it), and whose loaders take
their worker options in a `**kwargs` dict beside a written `shuffle=True`.

Written for tpu_utility's tests in the shape of a VAE example script.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser(description="tiny VAE")
parser.add_argument("--batch-size", type=int, default=32, metavar="N")
parser.add_argument("--epochs", type=int, default=4, metavar="N")
parser.add_argument("--no-cuda", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=1, metavar="S")
parser.add_argument("--log-interval", type=int, default=4, metavar="N")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()
use_cuda = args.cuda

torch.manual_seed(args.seed)
device = torch.device("cuda" if args.cuda else "cpu")
LATENT = 4


def images(n, seed):
    """Blurry strokes: each image mixes two of eight fixed patterns, values in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.zeros(8, 16, 16)
    for k in range(4):
        patterns[k, 2 + 3 * k:4 + 3 * k, :] = 1.0  # horizontal bars
        patterns[4 + k, :, 2 + 3 * k:4 + 3 * k] = 1.0  # vertical bars
    pick = torch.randint(0, 8, (n, 2), generator=g)
    weight = torch.rand(n, 1, 1, generator=g)
    x = weight * patterns[pick[:, 0]] + (1 - weight) * patterns[pick[:, 1]]
    return (0.9 * x + 0.05 + 0.05 * torch.rand(n, 16, 16, generator=g)).clamp(0, 1).unsqueeze(1)


kwargs = {'num_workers': 1, 'pin_memory': True} if use_cuda else {}
train_loader = DataLoader(TensorDataset(images(256, 10)), batch_size=args.batch_size, shuffle=True, **kwargs)
test_loader = DataLoader(TensorDataset(images(256, 11)), batch_size=args.batch_size, shuffle=False, **kwargs)


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 64)
        self.fc21 = nn.Linear(64, LATENT)
        self.fc22 = nn.Linear(64, LATENT)
        self.fc3 = nn.Linear(LATENT, 64)
        self.fc4 = nn.Linear(64, 256)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x, eps=None):
        mu, logvar = self.encode(x)
        z = mu if eps is None else mu + eps * torch.exp(0.5 * logvar)
        return self.decode(z), mu, logvar


model = VAE().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)


def loss_function(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x, reduction='sum')
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def train(epoch):
    model.train()
    train_loss = 0
    for batch_idx, (data,) in enumerate(train_loader):
        data = data.to(device)
        x = data.view(args.batch_size, -1)
        eps = torch.randn(args.batch_size, LATENT).to(device)  # drawn on the host: reproducible
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(x, eps)
        loss = loss_function(recon_batch, x, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print('Train Epoch: {} [{}/{}]\tLoss: {:.6f}'.format(
                epoch, batch_idx * len(data), len(train_loader.dataset), loss.item() / len(data)))
    print('====> Epoch: {} Average loss: {:.6f}'.format(epoch, train_loss / len(train_loader.dataset)))


def test(epoch):
    model.eval()
    test_loss = 0
    with torch.no_grad():
        for i, (data,) in enumerate(test_loader):
            data = data.to(device)
            recon_batch, mu, logvar = model(data.view(args.batch_size, -1))
            test_loss += loss_function(recon_batch, data.view(args.batch_size, -1), mu, logvar).item()
            if i == 0:
                recon = recon_batch.view(args.batch_size, 1, 16, 16)
                rows = [torch.cat([data[j], recon[j]], dim=2) for j in range(args.batch_size)]
                torch.save(torch.cat(rows, dim=1).cpu(), 'reconstruction_' + str(epoch) + '.pt')
    test_loss /= len(test_loader.dataset)
    print('====> Test set loss: {:.6f}'.format(test_loss))


if __name__ == "__main__":
    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test(epoch)
        with torch.no_grad():
            sample = model.decode(torch.randn(16, LATENT).to(device)).cpu()
            torch.save(sample.view(16, 1, 16, 16), 'sample_' + str(epoch) + '.pt')
