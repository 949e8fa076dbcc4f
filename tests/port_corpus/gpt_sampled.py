"""A tiny GPT trained at the top level of the script: gradient accumulation, torchrun
detected from RANK, batches sampled with torch.randint from one long tensor of tokens, no
DataLoader.

Written for tpu_utility's tests in the shape of public minimal-GPT training scripts.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

batch_size = int(os.environ.get("BATCH_SIZE", 32))
block_size = 8
vocab_size = 16
gradient_accumulation_steps = 2
max_iters = 4
learning_rate = 3e-3
device = "cuda" if torch.cuda.is_available() else "cpu"


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.ln(x)
        mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.block = Block(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        logits = self.head(self.block(self.tok(idx) + self.pos(pos)))
        return F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="nccl")
    ddp_local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{ddp_local_rank}"
    torch.cuda.set_device(device)
    master_process = int(os.environ["RANK"]) == 0
else:
    master_process = True

torch.manual_seed(1337)
data = torch.randint(vocab_size, (4096,))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


model = GPT()
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank])

X, Y = get_batch()
for iter_num in range(max_iters):
    for micro_step in range(gradient_accumulation_steps):
        loss = model(X, Y) / gradient_accumulation_steps
        X, Y = get_batch()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if master_process:
        print(f"iter {iter_num}: LOSS {loss.item() * gradient_accumulation_steps:.6f}")

if ddp:
    destroy_process_group()
