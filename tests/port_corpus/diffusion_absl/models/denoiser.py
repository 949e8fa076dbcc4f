"""A denoiser small enough for a test: a time embedding added to an MLP's hidden layer."""
import torch
import torch.nn as nn


class TinyDenoiser(nn.Module):
    def __init__(self, dim=8, hidden=16, steps=10):
        super().__init__()
        self.time = nn.Embedding(steps, hidden)
        self.inp = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x, t):
        return self.out(torch.tanh(self.inp(x) + self.time(t)))
