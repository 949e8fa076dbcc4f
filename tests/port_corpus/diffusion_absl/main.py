"""A diffusion-like run: a denoiser trained to predict the noise added to samples, an EMA
copy of it, an endless generator over a DataLoader, absl flags and app.run, and the
device chosen at module level. The optimizer and its warmup schedule are made before the
model moves inside the trainer made over two lines (issue 60), the trainer and the
sampler in a module of their own.

Written for tpu_utility's tests in the shape of public diffusion training scripts. The
noise and time steps come with the data, so that runs on different devices draw alike.
"""
import copy

import torch
import torch.nn as nn
from absl import app, flags
from torch.utils.data import DataLoader, TensorDataset

from diffusion import GaussianDiffusionSampler, GaussianDiffusionTrainer
from models.denoiser import TinyDenoiser

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 32, "batch size")
flags.DEFINE_integer("total_steps", 6, "training steps")
flags.DEFINE_float("lr", 5e-3, "learning rate")
flags.DEFINE_float("ema_decay", 0.9, "EMA decay")
flags.DEFINE_bool("parallel", False, "multi-GPU training")
flags.DEFINE_integer("T", 10, "diffusion steps")
flags.DEFINE_float("beta_1", 1e-4, "start beta")
flags.DEFINE_float("beta_T", 0.02, "end beta")
flags.DEFINE_integer("warmup", 3, "learning rate warmup")

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


def warmup_lr(step):
    return min(step + 1, FLAGS.warmup) / FLAGS.warmup


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
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda=warmup_lr)
    trainer = GaussianDiffusionTrainer(
        net_model, FLAGS.beta_1, FLAGS.beta_T, FLAGS.T).to(device)
    ema_sampler = GaussianDiffusionSampler(
        ema_model, FLAGS.beta_1, FLAGS.beta_T, FLAGS.T).to(device)
    if FLAGS.parallel:
        trainer = nn.DataParallel(trainer)
        ema_sampler = nn.DataParallel(ema_sampler)

    for step in range(FLAGS.total_steps):
        optim.zero_grad()
        x_0, eps, steps = next(datalooper)
        x_0, eps, steps = x_0.to(device), eps.to(device), steps.to(device)
        loss = trainer(x_0, eps, steps).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net_model.parameters(), 1.0)
        optim.step()
        sched.step()
        ema(net_model, ema_model, FLAGS.ema_decay)
        print("step %d LOSS %.6f" % (step, loss.item()))
    with torch.no_grad():
        x_T = torch.randn(4, 8, generator=gen).to(device)
        print("EMA sample LOSS %.6f" % ema_sampler(x_T).pow(2).mean().item())


def main(argv):
    del argv
    torch.manual_seed(0)
    train()


if __name__ == "__main__":
    app.run(main)
