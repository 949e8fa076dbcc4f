"""A Hugging Face Accelerate fine-tune in the shape of transformers' newer `no_trainer`
scripts: the accelerator made one way or another (`Accelerator(log_with=...) if
args.with_tracking else Accelerator()`), the data prepared under `main_process_first()`,
`accelerator.mixed_precision` read, the training loop iterating `active_dataloader`, the
prepared loader under another name, a schedule made before `prepare` from the loader's
length, and the update under `step % gradient_accumulation_steps == 0`.

Written for tpu_utility's tests (issue 60); a config-made BERT and generated rows, so that
nothing is downloaded. One batch an epoch by default: its losses step by step do not depend
on the order a loader draws.
"""
import argparse
import math
import random

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForSequenceClassification, get_scheduler

LENGTH = 16


def make_rows(n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ids = [rng.randrange(2, 40) for _ in range(LENGTH)]
        rows.append({"input_ids": ids, "attention_mask": [1] * LENGTH, "labels": int(3 in ids[:8])})
    return rows


def collate(rows):
    return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=128)
    parser.add_argument("--num_train_epochs", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--with_tracking", action="store_true")
    args = parser.parse_args()
    accelerator = (
        Accelerator(log_with="all", project_dir="runs") if args.with_tracking else Accelerator()
    )
    torch.manual_seed(0)
    with accelerator.main_process_first():
        train_rows, eval_rows = make_rows(128, 0), make_rows(64, 1)
    config = AutoConfig.for_model("bert", vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = AutoModelForSequenceClassification.from_config(config)
    if accelerator.mixed_precision != "no":
        print("mixed precision", accelerator.mixed_precision)
    train_dataloader = DataLoader(train_rows, shuffle=True, collate_fn=collate,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_rows, collate_fn=collate, batch_size=args.per_device_train_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=2,
                                 num_training_steps=max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    if args.with_tracking:
        accelerator.init_trackers("alias", vars(args))
    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        active_dataloader = train_dataloader
        for step, batch in enumerate(active_dataloader):
            outputs = model(**batch)
            loss = outputs.loss / args.gradient_accumulation_steps
            accelerator.backward(loss)
            if step % args.gradient_accumulation_steps == 0 or step == len(train_dataloader) - 1:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
        model.eval()
        correct = torch.zeros((), device=accelerator.device)
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references = accelerator.gather_for_metrics(
                (outputs.logits.argmax(dim=-1), batch["labels"]))
            correct += (predictions == references).sum()
        accelerator.print(f"epoch {epoch} ACC {correct.item() / len(eval_dataloader.dataset):.4f}")
    accelerator.print(f"STEPS {completed_steps}")
    if args.with_tracking:
        accelerator.end_training()


if __name__ == "__main__":
    main()
