"""A diffusion-like run: a denoiser trained to predict the noise added to samples, an EMA
copy of it, an endless generator over a DataLoader, absl flags and app.run, and the
device chosen at module level.

Written for tpu_utility's tests in the shape of public diffusion training scripts. The
noise and time steps come with the data, so that runs on different devices draw alike.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from absl import app, flags
from torch.utils.data import DataLoader, TensorDataset

from models.denoiser import TinyDenoiser

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 32, "batch size")
flags.DEFINE_integer("total_steps", 6, "training steps")
flags.DEFINE_float("lr", 5e-3, "learning rate")
flags.DEFINE_float("ema_decay", 0.9, "EMA decay")
flags.DEFINE_bool("parallel", False, "multi-GPU training")
flags.DEFINE_integer("T", 10, "diffusion steps")

device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def ema(source, target, decay):
    source_dict = source.state_dict()
    target_dict = target.state_dict()
    for key in source_dict.keys():
        target_dict[key].data.copy_(target_dict[key].data * decay + source_dict[key].data * (1 - decay))


def infiniteloop(dataloader):
    while True:
        for x, noise, t in iter(dataloader):
            yield x, noise, t


class GaussianDiffusionTrainer(nn.Module):
    def __init__(self, model, beta_1, beta_T, T):
        super().__init__()
        self.model = model
        self.register_buffer("betas", torch.linspace(beta_1, beta_T, T).double())
        alphas_bar = torch.cumprod(1.0 - self.betas, dim=0)
        self.register_buffer("sqrt_alphas_bar", torch.sqrt(alphas_bar).float())
        self.register_buffer("sqrt_one_minus_alphas_bar", torch.sqrt(1.0 - alphas_bar).float())

    def forward(self, x_0, noise, t):
        x_t = self.sqrt_alphas_bar[t][:, None] * x_0 + self.sqrt_one_minus_alphas_bar[t][:, None] * noise
        return F.mse_loss(self.model(x_t, t), noise, reduction="none")


def train():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=gen)
    noise = torch.randn(32, 8, generator=gen)
    t = torch.randint(FLAGS.T, (32,), generator=gen)
    # the whole set is one batch: the loss of a step does not depend on the order of rows
    dataloader = DataLoader(TensorDataset(x, noise, t), batch_size=FLAGS.batch_size, shuffle=True,
                            drop_last=True)
    datalooper = infiniteloop(dataloader)

    net_model = TinyDenoiser(steps=FLAGS.T)
    ema_model = copy.deepcopy(net_model)
    optim = torch.optim.Adam(net_model.parameters(), lr=FLAGS.lr)
    trainer = GaussianDiffusionTrainer(net_model, 1e-4, 0.02, FLAGS.T).to(device)
    ema_model.to(device)
    if FLAGS.parallel:
        trainer = nn.DataParallel(trainer)
        ema_model = nn.DataParallel(ema_model)

    for step in range(FLAGS.total_steps):
        optim.zero_grad()
        x_0, eps, steps = next(datalooper)
        x_0, eps, steps = x_0.to(device), eps.to(device), steps.to(device)
        loss = trainer(x_0, eps, steps).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net_model.parameters(), 1.0)
        optim.step()
        ema(net_model, ema_model, FLAGS.ema_decay)
        print("step %d LOSS %.6f" % (step, loss.item()))


def main(argv):
    del argv
    torch.manual_seed(0)
    train()


if __name__ == "__main__":
    app.run(main)
