"""Hugging Face models made from configs (nothing downloaded) and a bag-of-words text task."""
import torch

VOCAB, LENGTH = 64, 15


def make_texts(n, seed):
    """Token ids and labels: 1 where the text has more tokens from the lower half of the
    vocabulary than from the upper (no ties: an odd length)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (n, LENGTH), generator=g)
    labels = ((ids < (VOCAB + 4) // 2).sum(1) > LENGTH // 2).long()
    return ids, labels


class Texts(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids, self.labels = make_texts(n, seed)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                "labels": self.labels[i]}


def make_bert():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def hf_loop(epochs=3, batch_size=16, n=4096):
    """The loop HF users write, with tu's swaps: dict batches, out.loss, a warmup schedule,
    the epoch's loss read once. Returns per-epoch counts and the trained weights."""
    import tpu_utility as tu
    from tpu_utility.compat import xla_counts
    from transformers import get_linear_schedule_with_warmup
    device = tu.get_device()
    model = make_bert().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = tu.make_loader(Texts(n, 0), batch_size, num_workers=0)
    sched = get_linear_schedule_with_warmup(opt, len(loader) // 4, epochs * len(loader))
    counts, losses = [], []
    for epoch in range(epochs):
        before = xla_counts()
        total = torch.zeros((), device=device)
        for batch in loader:
            out = model(**batch)
            out.loss.backward()
            tu.optimizer_step(opt)
            sched.step()
            opt.zero_grad()
            total += out.loss.detach()
        losses.append(total.item() / len(loader))
        after = xla_counts()
        counts.append({k: after[k] - before[k] for k in ("compiles", "transfers")})
    return {"counts": counts, "losses": losses, "state": model.state_dict()}


def one_cycle_fn(cores_batch=16, epochs=2, n=1024, n_valid=256, split=False):
    """train_one_cycle(model, loader, opt, epochs) on a BERT with no loss function, then
    predict and an lr_find sweep with none either; `split`: its weights split over the
    devices by tu.fsdp (this small BERT's largest hold 2048 elements)."""
    import tpu_utility as tu
    device = tu.get_device()
    model = make_bert().to(device)
    if split:
        tu.fsdp(model, min_elements=2048)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    hist = tu.train_one_cycle(model, tu.make_loader(Texts(n, 0), cores_batch, num_workers=0), opt,
                              epochs, 3e-3, valid_loader=tu.make_loader(Texts(n_valid, 1), cores_batch),
                              metrics=[tu.accuracy], progress=False)
    logits = tu.predict(model, Texts(n_valid, 1), batch_size=cores_batch)
    sweep = tu.lr_find(model, tu.make_loader(Texts(n, 0), cores_batch, num_workers=0), opt, num_it=30)
    return {"valid_loss": [e.valid_loss for e in hist.epochs],
            "accuracy": [e.metrics["accuracy"] for e in hist.epochs],
            "transfers": [e.transfers for e in hist.epochs],
            "logits": logits, "sweep": sweep.raw_losses, "state": model.state_dict()}


def reference_one_cycle(epochs, global_batch, max_lr, n=1024, n_valid=256, seed=0):
    """The same training in plain CPU torch: Adam under the closed-form one-cycle schedule,
    the batches in make_loader's order, the model's own loss."""
    from reference import one_cycle_lr, one_cycle_mom
    ids, labels = make_texts(n, 0)
    vids, vlabels = make_texts(n_valid, 1)
    model = make_bert()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = n // global_batch
    total, k, valid_loss, accuracy = epochs * steps, 0, [], []
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        for s in range(steps):
            idx = order[s * global_batch:(s + 1) * global_batch]
            for g in opt.param_groups:
                g["lr"], g["betas"] = one_cycle_lr(max_lr, k / total), (one_cycle_mom(k / total), 0.999)
            opt.zero_grad()
            model(input_ids=ids[idx], labels=labels[idx]).loss.backward()
            opt.step()
            k += 1
        model.eval()
        with torch.no_grad():
            out = model(input_ids=vids, labels=vlabels)
        valid_loss.append(out.loss.item())
        accuracy.append((out.logits.argmax(1) == vlabels).float().mean().item())
    with torch.no_grad():
        logits = model(input_ids=vids).logits
    return {"valid_loss": valid_loss, "accuracy": accuracy, "logits": logits, "state": model.state_dict()}


# Ragged text: samples of different lengths, padded per batch by DataCollatorWithPadding.
MAX_RAGGED = 44


def make_tokenizer(padding_side="right", model_max_length=40):
    """A word-level fast tokenizer over VOCAB ids, made in memory: [PAD] is 0. None for
    `model_max_length`: no limit (transformers' default, 1e30)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    limit = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
                                   pad_token="[PAD]", unk_token="[UNK]", padding_side=padding_side,
                                   **limit)


class RaggedTexts(torch.utils.data.Dataset):
    """Lists of token ids from 4 to MAX_RAGGED long, most short (u ** 3): a batch's longest
    row varies widely from batch to batch. The label is the bag-of-words rule."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = (4 + (MAX_RAGGED - 3) * torch.rand(n, generator=g) ** 3).long().clamp(max=MAX_RAGGED)
        self.rows = [torch.randint(4, VOCAB, (int(k),), generator=g).tolist() for k in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = self.rows[i]
        low = sum(t < (VOCAB + 4) // 2 for t in ids)
        return {"input_ids": ids, "labels": int(2 * low > len(ids))}


def make_ragged_bert(positions=64):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=positions, num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return BertForSequenceClassification(cfg)


def ragged_loop(epochs=3, batch_size=2, n=256, buckets=None, positions=64, limit=40):
    """The HF loop over ragged text, DataCollatorWithPadding as the collate: per-epoch
    compiles and every step's loss (read once an epoch)."""
    import tpu_utility as tu
    from tpu_utility.compat import xla_counts
    from transformers import DataCollatorWithPadding, get_linear_schedule_with_warmup
    device = tu.get_device()
    model = make_ragged_bert(positions).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = tu.make_loader(RaggedTexts(n, 0), batch_size, num_workers=0, buckets=buckets,
                            collate_fn=DataCollatorWithPadding(make_tokenizer(model_max_length=limit)))
    sched = get_linear_schedule_with_warmup(opt, 4, epochs * len(loader))
    compiles, losses, lengths = [], [], set()
    for epoch in range(epochs):
        before = xla_counts()["compiles"]
        step_losses = []
        for batch in loader:
            lengths.add(batch["input_ids"].shape[1])
            out = model(**batch)
            out.loss.backward()
            tu.optimizer_step(opt)
            sched.step()
            opt.zero_grad()
            step_losses.append(out.loss.detach())
        losses += torch.stack(step_losses).cpu().tolist()
        compiles.append(xla_counts()["compiles"] - before)
    return {"compiles": compiles, "losses": losses, "lengths": sorted(lengths)}


def reference_ragged(epochs=3, global_batch=16, n=256, seed=0, positions=64, limit=40):
    """The same loop in plain CPU torch, each batch padded exactly to its longest row, in
    make_loader's order: per-step losses, and each batch's length."""
    from transformers import DataCollatorWithPadding, get_linear_schedule_with_warmup
    data, collate = RaggedTexts(n, 0), DataCollatorWithPadding(make_tokenizer(model_max_length=limit))
    model = make_ragged_bert(positions)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    steps = n // global_batch
    sched = get_linear_schedule_with_warmup(opt, 4, epochs * steps)
    losses, lengths = [], []
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for s in range(steps):
            batch = collate([data[i] for i in order[s * global_batch:(s + 1) * global_batch]])
            lengths.append(batch["input_ids"].shape[1])
            out = model(**batch)
            out.loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(out.loss.item())
    return {"losses": losses, "lengths": lengths}
