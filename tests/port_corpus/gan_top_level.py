"""A GAN trained straight down the file: two nets, two optimizers, no __main__ guard.

Written for tpu_utility's tests in the shape of pytorch/examples' dcgan/main.py.
"""
import argparse
import os
import random

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batchSize", type=int, default=64, help="input batch size")
parser.add_argument("--niter", type=int, default=3, help="number of epochs to train for")
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--outf", default=".", help="folder to output model checkpoints")
parser.add_argument("--cuda", action="store_true", default=torch.cuda.is_available())
opt = parser.parse_args()

random.seed(999)
torch.manual_seed(999)

# "real" samples: points on a ring
angle = torch.rand(256) * 6.2832
dataset = TensorDataset(torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(256, 2))
dataloader = DataLoader(dataset, batch_size=opt.batchSize, shuffle=True)

device = torch.device("cuda:0" if opt.cuda else "cpu")
nz = 8


def weights_init(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, 0.2)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, 32), nn.BatchNorm1d(32), nn.ReLU(True), nn.Linear(32, 2))

    def forward(self, input):
        return self.main(input)


netG = Generator()
netG.apply(weights_init)
netG.to(device)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(32, 1), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


netD = Discriminator()
netD.apply(weights_init)
netD.to(device)

criterion = nn.BCELoss()
real_label, fake_label = 1., 0.

optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(0.5, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(0.5, 0.999))

for epoch in range(opt.niter):
    for i, data in enumerate(dataloader, 0):
        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data[0].to(device)
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype, device=device)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()

        noise = torch.randn(batch_size, nz).to(device)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        optimizerD.step()

        # (2) Update G: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake)
        errG = criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()
        optimizerG.step()

        print('[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f'
              % (epoch, opt.niter, i, len(dataloader),
                 errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))

    # do checkpointing
    torch.save(netG.state_dict(), '%s/netG_epoch_%d.pth' % (opt.outf, epoch))
    torch.save(netD, os.path.join(opt.outf, 'netD.pth'))
