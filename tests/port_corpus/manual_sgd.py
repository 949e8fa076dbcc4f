"""A word-level language model with no optimizer and no DataLoader: batches are slices of
one long tensor on the device, and the update is written by hand.

Written for tpu_utility's tests in the shape of pytorch/examples' word_language_model/main.py.
"""
import argparse
import math
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description="tiny RNN language model")
parser.add_argument("--lr", type=float, default=2.0, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch_size", type=int, default=16)
parser.add_argument("--bptt", type=int, default=6, help="sequence length")
parser.add_argument("--save", type=str, default="model.pt")
parser.add_argument("--cuda", action="store_true", help="use CUDA")
args = parser.parse_args()

torch.manual_seed(1111)
device = torch.device("cuda" if args.cuda else "cpu")

# a corpus of token ids with some structure to learn
ntokens = 20
stream = (torch.arange(2000) * 7 + torch.randint(0, 3, (2000,))) % ntokens


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 16
train_data = batchify(stream[:1600], args.batch_size)
val_data = batchify(stream[1600:], eval_batch_size)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.RNN(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return nn.functional.log_softmax(self.decoder(output), dim=-1).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        return torch.zeros(1, bsz, self.rnn.hidden_size, device=self.decoder.weight.device)


model = RNNModel(ntokens, 16, 32).to(device)
criterion = nn.NLLLoss()


def repackage_hidden(h):
    return h.detach()


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].reshape(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1 - args.bptt, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    total_loss = 0.
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    # whole sequences of bptt only: the same shapes every step
    for batch, i in enumerate(range(0, train_data.size(0) - 1 - args.bptt, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()

        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)

        total_loss += loss.item()
    print('| epoch {:3d} | lr {:02.2f} | ms/batch {:5.2f} | loss {:5.4f}'.format(
        epoch, lr, (time.time() - start_time) * 1000 / (batch + 1), total_loss / (batch + 1)))


lr = args.lr
best_val_loss = None

try:
    for epoch in range(1, args.epochs + 1):
        train()
        val_loss = evaluate(val_data)
        print('| end of epoch {:3d} | valid loss {:5.4f} | valid ppl {:8.2f}'.format(
            epoch, val_loss, math.exp(val_loss)))
        if not best_val_loss or val_loss < best_val_loss:
            with open(args.save, 'wb') as f:
                torch.save(model, f)
            best_val_loss = val_loss
        else:
            lr /= 4.0
except KeyboardInterrupt:
    print('Exiting from training early')
