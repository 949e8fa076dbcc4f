"""Fine-tune a Hugging Face transformer on text, on all 8 cores: the HF way, tu's swaps.

    python examples/finetune_text.py   # on a TPU VM: the TPU; elsewhere: 8 XLA:CPU devices

1. Generated reviews of 5 to 40 words (so nothing is downloaded): positive when they hold
   more words of praise than of blame. A word-level tokenizer made in memory, and a small
   BERT made from its config (random weights, as `from_pretrained` would give trained ones).
2. The loop HF users write, as it comes: dict batches that hold their `labels`, the
   model's own loss (no loss function given), `DataCollatorWithPadding` padding each
   batch to its longest review. make_loader pads those to a few lengths, so XLA compiles
   a handful of times, not once per batch.
3. lr_find on one core at the global batch, train_one_cycle on 8 cores with its
   suggestion, predict on the held-out reviews.
4. Print the validation accuracy (exit 1 under --min-accuracy) and the XLA summary.
"""
import argparse
import random
import sys
import time

import torch

import tpu_utility as tu

PRAISE = ["great", "superb", "lovely", "excellent", "fine", "charming", "moving", "brilliant"]
BLAME = ["awful", "dull", "poor", "boring", "weak", "clumsy", "tedious", "dreadful"]
FILLER = [f"w{i}" for i in range(48)]  # words that say nothing either way


def make_reviews(n: int, seed: int):
    """(texts, labels): label 1 where praise outnumbers blame (never a tie)."""
    rng = random.Random(seed)
    texts, labels = [], []
    while len(texts) < n:
        words = [rng.choice(FILLER) for _ in range(rng.randint(5, 40))]
        good, bad = rng.randint(0, 4), rng.randint(0, 4)
        if good == bad:
            continue
        for word in [rng.choice(PRAISE) for _ in range(good)] + [rng.choice(BLAME) for _ in range(bad)]:
            words.insert(rng.randrange(len(words) + 1), word)
        texts.append(" ".join(words))
        labels.append(int(good > bad))
    return texts, labels


def make_tokenizer():
    """A word-level fast tokenizer made in memory: [CLS] first, [PAD] is 0."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    words = ["[PAD]", "[UNK]", "[CLS]"] + PRAISE + BLAME + FILLER
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", model_max_length=128)


def make_model(vocab_size: int):
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, num_labels=2, pad_token_id=0))


def encode(tokenizer, texts, labels):
    """Tokenized reviews as HF datasets give them: a dict per sample, ids of any length."""
    ids = tokenizer(texts, truncation=True)["input_ids"]
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


def train_fn(train, valid, lr, epochs, batch_size, seed):
    from transformers import DataCollatorWithPadding
    collate = DataCollatorWithPadding(make_tokenizer())
    torch.manual_seed(seed)  # the initial weights lr_find swept from
    model = make_model(len(make_tokenizer())).to(tu.get_device())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    hist = tu.train_one_cycle(model, tu.make_loader(train, batch_size, collate_fn=collate, seed=seed),
                              opt, epochs,
                              valid_loader=tu.make_loader(valid, batch_size, train=False, collate_fn=collate),
                              metrics=[tu.accuracy])
    logits = tu.predict(model, tu.make_loader(valid, batch_size, train=False, collate_fn=collate))
    return {"history": hist, "logits": logits, "report": tu.report(hist, verbose=False),
            "cores": tu.world_size()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reviews", type=int, default=3000)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="per core")
    p.add_argument("--min-accuracy", type=float, default=0.9, help="exit 1 below this")
    p.add_argument("--lr-find-steps", type=int, default=160,
                   help="lr_find's num_it (at 80 its loss falls too little to trust)")
    p.add_argument("--lr", type=float, default=None, help="max lr (default: lr_find's suggestion; given, no sweep)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and the batches' order")
    args = p.parse_args()
    start = time.perf_counter()
    info = tu.setup_tpu()
    from transformers import DataCollatorWithPadding

    tokenizer = make_tokenizer()
    texts, labels = make_reviews(args.reviews, args.seed)
    n_valid = args.reviews // 5  # the last fifth is held out
    train = encode(tokenizer, texts[:-n_valid], labels[:-n_valid])
    valid = encode(tokenizer, texts[-n_valid:], labels[-n_valid:])

    cores = info.num_devices
    lr = args.lr
    if lr is None:
        torch.manual_seed(args.seed)
        model = make_model(len(tokenizer))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        # lr_find runs on one core: give it the global batch that one step on all cores sees.
        scaled = tu.scale_lr_bs(1e-3, args.batch_size, cores=cores, verbose=False)
        found = tu.lr_find(model, tu.make_loader(train, scaled.global_batch_size, seed=args.seed,
                                                 collate_fn=DataCollatorWithPadding(tokenizer)),
                           opt, start_lr=1e-5, num_it=args.lr_find_steps)  # a short sweep: from 1e-5
        lr = found.suggestion
        print(f"lr_find: suggests {lr:.2e} (one_cycle) at a batch of {scaled.global_batch_size}")
    train_start = time.perf_counter()
    out = tu.run(train_fn, cores=cores, args=(train, valid, lr, args.epochs, args.batch_size, args.seed))
    train_s = time.perf_counter() - train_start

    truth = torch.tensor([s["labels"] for s in valid])
    accuracy = (out["logits"].argmax(1) == truth).float().mean().item()
    hist, rep = out["history"], out["report"]
    print(f"\nvalidation accuracy (predict on the {len(valid)} held-out reviews): {accuracy:.1%} "
          f"(run() with {args.epochs} epochs: {train_s:.0f} s)")
    print(f"XLA on {out['cores']} cores: {rep.compiles} compiles ({rep.compile_s:.1f} s), "
          f"compiles per epoch {[e.compiles for e in hist.epochs]}, host transfers per epoch "
          f"{[e.transfers for e in hist.epochs]}, CPU fallbacks: "
          f"{', '.join(sorted(rep.fallbacks)) if rep.fallbacks else 'none'}")
    for hint in rep.hints:
        print("hint:", hint)
    print(f"finetune_text wall time: {time.perf_counter() - start:.0f} s")
    if accuracy < args.min_accuracy:
        sys.exit(f"accuracy {accuracy:.1%} is under the example's bar of {args.min_accuracy:.0%}")


if __name__ == "__main__":
    main()
