"""train_fns for tests/test_plan.py: steps planned for a TPU by its own compiler."""
import json

import torch

import tpu_utility as tu

IN, HIDDEN, OUT = 1024, 2048, 16


def mlp(rows_per_core=128, steps=4, split=False, log=None):
    """A 2-layer MLP, AdamW, make_loader's batches; `log`: a file the losses the loop read
    are written to, one JSON list per step."""
    device = tu.get_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN, OUT)).to(device)
    if split:
        tu.fsdp(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = rows_per_core * tu.world_size() * steps
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, IN, generator=g),
                                          torch.randint(0, OUT, (n,), generator=g))
    read = []
    for x, y in tu.make_loader(data, rows_per_core, num_workers=0):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        tu.optimizer_step(opt)
        opt.zero_grad()
        read.append(loss.item())  # the loop's own read, after the step
        if log:
            with open(log, "w") as f:
                json.dump(read, f)
    return read


class Wide(torch.nn.Module):
    """A step whose activations need far more than a chip's HBM (and far more than this
    host's memory, were it run here): each of its rows is repeated `copies` times."""

    def __init__(self, copies):
        super().__init__()
        self.copies = copies
        self.a, self.b = torch.nn.Linear(256, 8192), torch.nn.Linear(8192, 1)

    def forward(self, x):
        h = torch.relu(self.a(x.repeat(self.copies, 1)))
        return self.b(h).mean()


def too_big(copies=65536):
    device = tu.get_device()
    model = Wide(copies).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 256).to(device)).backward()  # batches moved by the user's loop
        tu.optimizer_step(opt)
        opt.zero_grad()
    return "trained"


def bert(seq=2048, rows=64, steps=4, checkpointing=False, layers=2, bf16=False):
    """A small config-made BERT whose attention at `seq` tokens outgrows a chip unless
    gradient checkpointing recomputes it; `bf16`: with tu.bf16_weights."""
    from transformers import BertConfig, BertForSequenceClassification
    device = tu.get_device()
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=512, hidden_size=128, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=256, max_position_embeddings=seq, num_labels=2,
                     attn_implementation="eager")
    model = BertForSequenceClassification(cfg).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if bf16:
        tu.bf16_weights(model, opt)
    g = torch.Generator().manual_seed(1)
    n = rows * tu.world_size() * steps
    data = [{"input_ids": i, "labels": y} for i, y in
            zip(torch.randint(5, 512, (n, seq), generator=g), torch.randint(0, 2, (n,), generator=g))]
    for batch in tu.make_loader(data, rows, num_workers=0):
        model(**batch).loss.backward()
        tu.optimizer_step(opt)
        opt.zero_grad()
    return "trained"


def two_models(rows_per_core=128, steps=4):
    """A loop of two optimizers, as a GAN's: each iteration steps the first model, then the
    second (IN-HIDDEN-OUT and IN-HIDDEN/2-OUT MLPs, AdamW each)."""
    device = tu.get_device()
    torch.manual_seed(0)
    first = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)).to(device)
    second = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN // 2), torch.nn.ReLU(),
                                 torch.nn.Linear(HIDDEN // 2, OUT)).to(device)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (first, second)]
    n = rows_per_core * tu.world_size() * steps
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, IN, generator=g),
                                          torch.randint(0, OUT, (n,), generator=g))
    for x, y in tu.make_loader(data, rows_per_core, num_workers=0):
        for model, opt in zip((first, second), opts):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            tu.optimizer_step(opt)
            opt.zero_grad()
    return "trained"


def wide_on_device(width=16384, rows_per_core=8, steps=3):
    """Two width x width layers (537M parameters: 8.6 GB of weights, gradients and AdamW
    moments) made on the device, as a model too big for the host is: their initial values
    are a computation a plan never runs."""
    device = tu.get_device()
    model = torch.nn.Sequential(torch.nn.Linear(width, width, device=device), torch.nn.ReLU(),
                                torch.nn.Linear(width, width, device=device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n = rows_per_core * tu.world_size() * steps
    data = torch.utils.data.TensorDataset(torch.randn(n, width))
    for x, in tu.make_loader(data, rows_per_core, num_workers=0):
        model(x).pow(2).mean().backward()
        tu.optimizer_step(opt)
        opt.zero_grad()
    return "planned"
