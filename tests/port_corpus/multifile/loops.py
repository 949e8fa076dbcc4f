"""The training and evaluation loops: mixed precision with a GradScaler, and a schedule
stepped every batch."""
import torch
import torch.nn.functional as F

import config


def train(model, train_loader, valid_loader, optimizer, scheduler, device, epochs):
    scaler = torch.cuda.amp.GradScaler()
    for epoch in range(epochs):
        model.train()
        for step, (ids, mask, labels) in enumerate(train_loader):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            optimizer.zero_grad()
            logits = model(ids, mask)
            loss = F.cross_entropy(logits.float(), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % config.LOG_EVERY == 0:
                print(f"epoch {epoch} step {step} lr {scheduler.get_last_lr()[0]:.6f} LOSS {loss.item():.6f}")
        valid_loss, accuracy = evaluate(model, valid_loader, device)
        print(f"epoch {epoch} VALID {valid_loss:.6f} ACC {accuracy:.4f}")
    return model


def evaluate(model, loader, device):
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for ids, mask, labels in loader:
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            logits = model(ids, mask).float()
            total_loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(1) == labels).sum().item()
            count += labels.size(0)
    return total_loss / count, correct / count
