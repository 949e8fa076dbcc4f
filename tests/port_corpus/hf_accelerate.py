"""hf_no_trainer.py as transformers' `no_trainer` scripts write it with Hugging Face
Accelerate: `accelerator.prepare` of the model, optimizer, loaders and schedule,
`accelerator.backward`, `gather_for_metrics`, `accelerator.print`, and the model saved by
the main process with `save_pretrained(..., save_function=accelerator.save)`.

Written for tpu_utility's tests in the shape of transformers' text-classification
scripts; the texts are generated so that nothing is downloaded.
"""
import argparse
import os
import random

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import (AutoConfig, AutoModelForSequenceClassification, DataCollatorWithPadding,
                          PreTrainedTokenizerFast, get_linear_schedule_with_warmup)

WORDS = ["good", "great", "fine", "bad", "poor", "awful"] + [f"w{i}" for i in range(40)]


def make_tokenizer():
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(["[PAD]", "[UNK]"] + WORDS)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]")


def make_split(tokenizer, n, seed):
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 30))]
        texts.append(" ".join(words))
        labels.append(int(sum(w in WORDS[:3] for w in words) >= sum(w in WORDS[3:6] for w in words)))
    encoded = tokenizer(texts, truncation=True, max_length=64)
    return [{"input_ids": ids, "attention_mask": mask, "labels": y}
            for ids, mask, y in zip(encoded["input_ids"], encoded["attention_mask"], labels)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=32)
    parser.add_argument("--num_train_epochs", type=int, default=5)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    args = parser.parse_args()
    accelerator = Accelerator()
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    if os.environ.get("MODEL_NAME"):
        model = AutoModelForSequenceClassification.from_pretrained(os.environ["MODEL_NAME"], num_labels=2)
    else:
        config = AutoConfig.for_model("bert", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, intermediate_size=64, num_labels=2,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = AutoModelForSequenceClassification.from_config(config)
    collator = DataCollatorWithPadding(tokenizer=tokenizer)
    train_dataloader = DataLoader(make_split(tokenizer, 128, 0), shuffle=True,
                                  batch_size=args.per_device_train_batch_size, collate_fn=collator)
    eval_dataloader = DataLoader(make_split(tokenizer, 128, 1),
                                 batch_size=args.per_device_train_batch_size, collate_fn=collator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01)
    num_training_steps = args.num_train_epochs * len(train_dataloader)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2,
                                                   num_training_steps=num_training_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = torch.zeros((), device=accelerator.device)
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            total_loss += loss.detach()
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        correct = torch.zeros((), device=accelerator.device)
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references = accelerator.gather_for_metrics(
                (outputs.logits.argmax(dim=-1), batch["labels"]))
            correct += (predictions == references).sum()
        accelerator.print(f"epoch {epoch} LOSS {total_loss.item() / len(train_dataloader):.6f} "
              f"ACC {correct.item() / len(eval_dataloader.dataset):.4f}")
    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        unwrapped_model.save_pretrained("model_out", save_function=accelerator.save)


if __name__ == "__main__":
    main()
