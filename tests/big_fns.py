"""train_fns for models bigger than one chip (issue 46): gradient checkpointing and tu.fsdp,
on Hugging Face models made from configs and on a model of the user's own blocks."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import tpu_utility as tu

VOCAB, SEQ = 512, 32


def bert(dropout=0.1, layers=1):
    """A BERT whose embeddings (512 x 64) and feed-forward weights (64 x 512) have 32768
    elements each: the size tu.fsdp splits from. One layer: each layer costs the tests that
    compile it about 40% more (XLA:CPU, 8 devices)."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=layers,
                     num_attention_heads=4, intermediate_size=512, max_position_embeddings=SEQ,
                     num_labels=2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(cfg)


class Texts(torch.utils.data.Dataset):
    def __init__(self, n=128):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        self.labels = (self.ids[:, :4].sum(1) % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


class Blocks(nn.Module):
    """A user's own model: residual MLP blocks with dropout, each through
    torch.utils.checkpoint.checkpoint when `reentrant` is True or False; "both": the first
    block with use_reentrant=True, the second with False, the third not checkpointed."""

    def __init__(self, reentrant=None, width=64, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 512), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(512, width)) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, input_ids, labels, attention_mask=None):
        x = self.embed(input_ids)
        ways = [True, False, None] if self.reentrant == "both" else [self.reentrant] * len(self.blocks)
        for block, reentrant in zip(self.blocks, ways):
            if reentrant is None:
                x = x + block(x)
            else:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        return F.cross_entropy(self.head(x.mean(1)), labels)


def train(model="bert", *, checkpointing=False, split=False, steps=3, batch=16, bf16=False, save=None,
          layers=1, weights=None, dropout=0.1, shuffle=None, resume_at=None):
    """`steps` AdamW steps through tu.optimizer_step; the losses, final weights, compiled
    peak of this training's step, the memory per device, each parameter's split, report();
    `save`: a path for tu.save(model.state_dict()); `weights="bf16"`: tu.bf16_weights;
    `resume_at`: a path: the model's and optimizer's state dicts saved there after step
    `steps // 2`, then a fresh model and optimizer load them and take the later steps
    again on the same batches ("resumed": its final weights)."""
    import torch_xla
    from tpu_utility import fused_step, memory, step as steps_of
    from tpu_utility.compat import sharded
    device = tu.get_device()
    net = (bert(dropout, layers=layers) if model == "bert" else Blocks(checkpointing if checkpointing != "hf" else None)).to(device)
    if checkpointing == "hf":
        net.gradient_checkpointing_enable()
    def build(net):
        if split:
            tu.fsdp(net)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        if weights == "bf16":
            tu.bf16_weights(net, opt)
        return net, opt

    def step(net, opt, b):
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=bf16):
            out = net(**b)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        tu.optimizer_step(opt)
        opt.zero_grad()
        tu.sync()
        return loss.detach()

    net, opt = build(net)
    loader = tu.make_loader(Texts(steps * batch * tu.world_size()), batch, num_workers=0, shuffle=shuffle)
    torch_xla.manual_seed(7)
    peaks_before = len(memory.compiled_peaks())
    losses, later = [], []
    for i, b in enumerate(loader):
        losses.append(step(net, opt, b))
        if resume_at and i + 1 == steps // 2:
            tu.save({"model": net.state_dict(), "opt": opt.state_dict()}, resume_at)
        elif resume_at and i + 1 > steps // 2:
            later.append(b)
    peaks = memory.compiled_peaks()[peaks_before:]
    if save:
        tu.save(net.state_dict(), save)
    result = {"report": str(tu.report(verbose=False)),"losses": [float(x) for x in tu.to_cpu(losses)],
            "state": tu.to_cpu(net.state_dict()),
            "peak": max(peaks) if peaks else None,
            "memory": vars(steps_of.of().memory).copy() if steps_of.of().memory else None,
            "split": {n: sharded(p) for n, p in net.named_parameters()},
            "numel": {n: p.numel() for n, p in net.named_parameters()},
            "state_split": [sharded(v) for s in opt.state.values() for v in s.values()
                            if getattr(v, "dim", lambda: 0)() > 0]}
    if resume_at:
        again, again_opt = build(bert(dropout, layers=layers).to(device))
        saved = torch.load(resume_at, weights_only=True)
        again.load_state_dict(saved["model"])
        again_opt.load_state_dict(saved["opt"])
        for b in later:
            step(again, again_opt, b)
        result["resumed"] = tu.to_cpu(again.state_dict())
        result["masters_split"] = [sharded(m) for g in again_opt.param_groups for m in g["params"]]
    # The fused step (issue 39) on split tensors: it must step aside (False) for torch's.
    out = net(**b)
    (out.loss if hasattr(out, "loss") else out).backward()
    result["fused_took_it"] = fused_step.step(opt, device)
    return result
