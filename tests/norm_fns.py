"""Train functions for tests/test_spmd.py's BatchNorm cases (issue 47): each runs on the
run's device (tu.get_device(): 1 XLA device, 8 SPMD devices) or, given `cpu=True`, on CPU
torch, from the same initial weights and data, and returns what it trained."""
import torch
import torch.nn as nn

import tpu_utility as tu


def _device(cpu):
    return torch.device("cpu") if cpu else tu.get_device()


def _step(opt, cpu):
    opt.step() if cpu else tu.optimizer_step(opt)


def bn_sgd(cpu=False):
    """A BatchNorm1d at 8 rows and a BatchNorm CNN, 4 SGD steps each: weights and running
    statistics (torch keeps the unbiased variance in running_var)."""
    device = _device(cpu)
    out = {}
    g = torch.Generator().manual_seed(0)
    for name, make, shape in (
            ("bn1d", lambda: nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)), (8, 6)),
            ("cnn", lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                          nn.Flatten(), nn.Linear(4 * 36, 3)), (8, 3, 8, 8))):
        torch.manual_seed(0)
        model = make().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(4):
            x = torch.randn(*shape, generator=g).to(device)
            y = torch.randint(0, 3, (shape[0],), generator=g).to(device)
            nn.functional.cross_entropy(model(x), y).backward()
            _step(opt, cpu)
            opt.zero_grad()
        out[name] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return out


def bn_bf16(cpu=False):
    """A bfloat16 BatchNorm model, 2 SGD steps: its weights and bf16 running statistics."""
    device = _device(cpu)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 36, 3)).to(torch.bfloat16).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(16, 3, 8, 8, generator=g).to(torch.bfloat16).to(device)
        y = torch.randint(0, 3, (16,), generator=g).to(device)
        nn.functional.cross_entropy(model(x).float(), y).backward()
        _step(opt, cpu)
        opt.zero_grad()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def bn_penalty(cpu=False):
    """A gradient penalty through BatchNorm (a WGAN-GP critic's): the weights' gradients of
    loss + (|d out / d x|^2).sum(), a double backward."""
    device = _device(cpu)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 36, 1)).to(device)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 3, 8, 8, generator=g).to(device).requires_grad_()
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.mean() + (gx ** 2).sum()).backward()
    return {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
