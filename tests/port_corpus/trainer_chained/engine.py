"""The training loop as a class holding the model and its optimizer, and a fine-tune as a
staticmethod."""
import torch
import torch.nn.functional as F


class Trainer:
    def __init__(self, model, opt, device):
        self.model = model.to(device)
        self.opt = opt
        self.device = device

    def step(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss

    def train(self, loader, epochs):
        for epoch in range(epochs):
            for x, y in loader:
                loss = self.step(x.to(self.device), y.to(self.device))
                print(f"epoch {epoch} LOSS {loss.item():.6f}")


class Finetune:
    @staticmethod
    def run(model, optimizer, loader, device, rounds=2):
        for _ in range(rounds):
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = F.l1_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                print(f"finetune LOSS {loss.item():.6f}")
