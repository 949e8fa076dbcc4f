"""port's rules one at a time: a before/after case per rule id (`assert_ports`, in process,
no XLA), the table in docs/porting.md made from the rules, and the size of port's files.
The corpus tests (test_port_corpus.py) stay the end-to-end guard: there each ported script
runs, and its losses are compared with the CUDA original's."""
import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tpu_utility.port import port_source
from tpu_utility.port.rules import RULES, table

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    rule: str
    before: str
    after: str
    notes: tuple = ()  # the ids of the rules that list something
    script: bool = False  # a whole script (its top-level training is wrapped), not a cell


def assert_ports(before: str, after: str, rule: str, notes=(), script: bool = False):
    """`before` ports to exactly `after`, `rule` made a swap or a note, and the notes come
    from exactly the rules `notes`."""
    result = port_source(textwrap.dedent(before), script=script)
    assert result.text == textwrap.dedent(after)
    fired = {r for _, r in result.swap_rules + result.note_rules}
    assert rule in fired, (rule, fired)
    assert sorted({r for _, r in result.note_rules}) == sorted(notes), result.todo
    assert len(result.swap_rules) == len(result.swaps) and len(result.note_rules) == len(result.todo)


CASES = [
    Case('structure.wrap', '''\
import torch
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.ones(2)).sum().backward()
    opt.step()
''', '''\
import torch
model = torch.nn.Linear(2, 1)


def train_fn():
    global opt, step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.ones(2)).sum().backward()
        tu.optimizer_step(opt)
        tu.sync()


if __name__ == "__main__":
    tu.run(train_fn, cores=8)
''', notes=('steps.sync',), script=True),
    Case('device.no-meaning-line', '''\
def fit(model):
    torch.cuda.empty_cache()
    model.train()
''', '''\
def fit(model):
    model.train()
'''),
    Case('device.top-level-move-line', '''\
model = Net()
model.cuda()
''', '''\
model = Net()
''', notes=('device.top-level-move-line',)),
    Case('device.cpu-fallback', '''\
def main():
    device = "cuda"
    if not torch.cuda.is_available():
        device = "cpu"
''', '''\
def main():
    device = tu.get_device()
'''),
    Case('device.if-choice', '''\
def main(use_cuda):
    if use_cuda:
        device = torch.device("cuda")
    elif use_mps:
        device = torch.device("mps")
    else:
        device = torch.device("cpu")


def worker(args):
    if torch.cuda.is_available():
        if args.gpu is not None:
            device = torch.device(f"cuda:{args.gpu}")
        else:
            device = torch.device("cuda", 0)
    elif torch.backends.mps.is_available():
        device = torch.device("mps")
    else:
        device = torch.device("cpu")
''', '''\
def main(use_cuda):
    device = tu.get_device()


def worker(args):
    device = tu.get_device()
'''),
    Case('device.cuda-name', '''\
def main():
    DEVICE = "cuda"
    return DEVICE
''', '''\
def main():
    DEVICE = tu.get_device()
    return DEVICE
'''),
    Case('device.cuda-expression', '''\
def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
''', '''\
def main():
    device = tu.get_device()
'''),
    Case('device.torch-device', '''\
def main(args, name):
    a = torch.device("cuda:0")
    b = torch.device(args.device)
    c = torch.device(f"cuda:{args.gpu}")
    d = torch.device(name)
''', '''\
def main(args, name):
    a = tu.get_device()
    b = tu.get_device()
    c = tu.get_device()
    d = torch.device(name)
''', notes=('device.torch-device',)),
    Case('device.current-accelerator', '''\
def main():
    device = torch.accelerator.current_accelerator()
''', '''\
def main():
    device = tu.get_device()
'''),
    Case('device.cuda-check', '''\
use_cuda = not args.no_cuda and torch.cuda.is_available()
kwargs = {"num_workers": 1, "pin_memory": True} if use_cuda else {}
''', '''\
use_cuda = not args.no_cuda and tu.has_accelerator()
kwargs = {"num_workers": 1, "pin_memory": True} if use_cuda else {}
'''),
    Case('device.cudnn', '''\
import torch.backends.cudnn as cudnn
cudnn.benchmark = True
torch.backends.cudnn.deterministic = True
if args.seed is not None:
    cudnn.deterministic = True
''', '''\
import torch.backends.cudnn as cudnn
if args.seed is not None:
    pass
'''),
    Case('device.to-cuda', '''\
def main(model, x, args, rank):
    model.cuda()
    y = x.to("cuda", non_blocking=True)
    model.cuda(args.gpu)
    x = x.cuda(args.gpu, non_blocking=True)
    model.to(args.gpu)
    model = model.to(rank)
    z = x.to(f"cuda:{rank}")
''', '''\
def main(model, x, args, rank):
    model.to(tu.get_device())
    y = x.to(tu.get_device(), non_blocking=True)
    model.to(tu.get_device())
    x = x.to(tu.get_device(), non_blocking=True)
    model.to(tu.get_device())
    model = model.to(tu.get_device())
    z = x.to(tu.get_device())
'''),
    Case('device.no-meaning', '''\
def main():
    freed = torch.cuda.empty_cache()
''', '''\
def main():
    freed = None
'''),
    Case('steps.optimizer-step', '''\
def fit(model, opt, closure, trainer):
    for x in data:
        model(x).backward()
        opt.step()
        trainer.step()
opt = torch.optim.LBFGS(params)
''', '''\
def fit(model, opt, closure, trainer):
    for x in data:
        model(x).backward()
        tu.optimizer_step(opt)
        trainer.step()
opt = torch.optim.LBFGS(params)
''', notes=('steps.optimizer-step',)),
    Case('loaders.dataloader', '''\
def main(train_ds, valid_ds):
    train_dl = DataLoader(train_ds, 64, True, num_workers=2)
    valid_dl = DataLoader(valid_ds, batch_size=128)
    other = DataLoader(train_ds, batch_sampler=sampler)
''', '''\
def main(train_ds, valid_ds):
    train_dl = tu.make_loader(train_ds, 64, num_workers=2)
    valid_dl = tu.make_loader(valid_ds, batch_size=128, train=False)
    other = DataLoader(train_ds, batch_sampler=sampler)
''', notes=('loaders.dataloader',)),
    Case('io.save', '''\
def main(model):
    torch.save(model.state_dict(), "model.pt")
''', '''\
def main(model):
    tu.save(model.state_dict(), "model.pt")
'''),
    Case('amp.grad-scaler', '''\
def main():
    scaler = torch.cuda.amp.GradScaler()
''', '''\
def main():
    scaler = tu.GradScaler()
'''),
    Case('amp.autocast', '''\
def main(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        y = model(x)
    with torch.autocast("cpu"):
        z = model(x)
''', '''\
def main(model, x):
    with tu.autocast():
        y = model(x)
    with torch.autocast("cpu"):
        z = model(x)
'''),
    Case('io.synchronize', '''\
def main():
    torch.cuda.synchronize()
''', '''\
def main():
    tu.sync()
'''),
    Case('io.host-read', '''\
def fit(model, opt, loader):
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        total = loss.item()
''', '''\
def fit(model, opt, loader):
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        total = loss.item()
''', notes=('io.host-read',)),
    Case('steps.average-gradients', '''\
def fit(model, loader, lr):
    for x, y in loader:
        model(x, y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
''', '''\
def fit(model, loader, lr):
    for x, y in loader:
        model(x, y).backward()
        with torch.no_grad():
            tu.average_gradients(model.parameters())
            for p in model.parameters():
                p -= lr * p.grad
'''),
    Case('steps.sync', '''\
def fit(model, opt, xs, ys):
    for i in range(0, len(xs), 32):
        model(xs[i:i + 32], ys[i:i + 32]).backward()
        opt.step()
        opt.zero_grad()
opt = torch.optim.SGD(params, lr=0.1)
''', '''\
def fit(model, opt, xs, ys):
    for i in range(0, len(xs), 32):
        model(xs[i:i + 32], ys[i:i + 32]).backward()
        tu.optimizer_step(opt)
        tu.sync()
        opt.zero_grad()
opt = torch.optim.SGD(params, lr=0.1)
''', notes=('steps.sync',)),
    Case('order.move-before-optimizer', '''\
def main():
    model = Net()
    # the optimizer
    opt = torch.optim.Adam(model.parameters())
    model.to(device)
''', '''\
def main():
    model = Net()
    model.to(device)
    # the optimizer
    opt = torch.optim.Adam(model.parameters())
'''),
    Case('structure.top-level-training', '''\
def train(model, loader):
    for x in loader:
        model(x).backward()

train(model, loader)
''', '''\
def train(model, loader):
    for x in loader:
        model(x).backward()

train(model, loader)
''', notes=('structure.top-level-training',)),
    Case('structure.run-call', '''\
def train():
    for x in loader:
        model(x).backward()

if __name__ == "__main__":
    train()
''', '''\
def train():
    for x in loader:
        model(x).backward()

if __name__ == "__main__":
    tu.run(train, cores=8)
'''),
    Case('structure.batch-indexing', '''\
def predict(model, loader, bs):
    for i, x in enumerate(loader):
        preds[i * bs:(i + 1) * bs] = model(x)
''', '''\
def predict(model, loader, bs):
    for i, x in enumerate(loader):
        preds[i * bs:(i + 1) * bs] = model(x)
''', notes=('structure.batch-indexing',)),
    Case('distributed.process-group', '''\
def main_worker(gpu, args):
    dist.init_process_group(backend="nccl", init_method=args.dist_url,
                            world_size=args.world_size, rank=args.rank)
    train(args)
    torch.distributed.barrier()
    dist.destroy_process_group()
''', '''\
def main_worker(gpu, args):
    train(args)
'''),
    Case('distributed.set-epoch', '''\
def main_worker(args, train_ds):
    train_sampler = DistributedSampler(train_ds) if args.distributed else None
    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(epoch)
''', '''\
def main_worker(args, train_ds):
    train_sampler = None
    for epoch in range(args.epochs):
        if args.distributed:
            pass
        train(epoch)
'''),
    Case('distributed.sampler', '''\
def main_worker(args, train_ds, val_ds):
    train_sampler = DistributedSampler(train_ds) if args.distributed else None
    val_sampler = torch.utils.data.distributed.DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size,
                              shuffle=(train_sampler is None), sampler=train_sampler)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler)
    test_loader = DataLoader(val_ds, batch_size=64,
                             sampler=DistributedSampler(val_ds) if args.distributed else None)
''', '''\
def main_worker(args, train_ds, val_ds):
    train_sampler = None
    val_sampler = None
    train_loader = tu.make_loader(train_ds, batch_size=args.batch_size)
    val_loader = tu.make_loader(val_ds, batch_size=args.batch_size, train=False)
    test_loader = tu.make_loader(val_ds, batch_size=64)
'''),
    Case('distributed.wrapper-line', '''\
def main_worker(model, args):
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
    else:
        model = nn.DataParallel(model)
    torch.save(model.module.state_dict(), "model.pt")
''', '''\
def main_worker(model, args):
    if args.distributed:
        pass
    else:
        pass
    tu.save(model.state_dict(), "model.pt")
'''),
    Case('distributed.wrapper', '''\
def main_worker(model):
    model = torch.nn.DataParallel(model).cuda()
    net = DDP(model, find_unused_parameters=True)
''', '''\
def main_worker(model):
    model = model.to(tu.get_device())
    net = model
'''),
    Case('distributed.module', '''\
def build(net):
    net = DDP(net)
    return net

def save(net):
    torch.save(net.module.state_dict(), "net.pt")
''', '''\
def build(net):
    return net

def save(net):
    tu.save(net.state_dict(), "net.pt")
'''),
    Case('distributed.spawn', '''\
import torch.multiprocessing as mp

def main():
    args = parser.parse_args()
    ngpus_per_node = torch.cuda.device_count()
    mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
''', '''\
import torch.multiprocessing as mp

def main():
    args = parser.parse_args()
    ngpus_per_node = tu.world_size()
    main_worker(tu.rank(), ngpus_per_node, args)
'''),
    Case('distributed.rank', '''\
def main():
    local_rank = int(os.environ["LOCAL_RANK"])
    world = int(os.environ.get("WORLD_SIZE", 1))
    if dist.get_rank() == 0:
        print(dist.get_world_size())
''', '''\
def main():
    local_rank = tu.rank()
    world = tu.world_size()
    if tu.rank() == 0:
        print(tu.world_size())
'''),
    Case('distributed.device-count', '''\
def main(args):
    args.batch_size = int(args.batch_size / torch.cuda.device_count())
''', '''\
def main(args):
    args.batch_size = int(args.batch_size / tu.world_size())
'''),
    Case('distributed.all-reduce', '''\
def evaluate(correct, total, loss):
    dist.all_reduce(correct)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    torch.distributed.all_reduce(loss, dist.ReduceOp.AVG)
    dist.all_reduce(loss, op=dist.ReduceOp.MAX)
''', '''\
def evaluate(correct, total, loss):
    tu.all_reduce(correct)
    tu.all_reduce(total)
    tu.all_reduce(loss, op="mean")
    dist.all_reduce(loss, op=dist.ReduceOp.MAX)
''', notes=('distributed.all-reduce',)),
    Case('loaders.batch-shape', '''\
def train(model, args, train_ds):
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True)
    for batch_idx, (data, _) in enumerate(loader):
        flat = data.view(args.batch_size, -1)
        z = torch.randn(args.batch_size, 20)
        for i in range(args.batch_size):
            pass
        first = data[:args.batch_size]
    for data in loader:
        out = data.view(args.batch_size, -1)
    grid = torch.randn(args.batch_size, 20)
''', '''\
def train(model, args, train_ds):
    loader = tu.make_loader(train_ds, batch_size=args.batch_size)
    for batch_idx, (data, _) in enumerate(loader):
        flat = data.view(data.size(0), -1)
        z = torch.randn(data.size(0), 20)
        for i in range(data.size(0)):
            pass
        first = data[:args.batch_size]
    for data in loader:
        out = data.view(args.batch_size, -1)
    grid = torch.randn(args.batch_size, 20)
''', notes=('loaders.batch-shape',)),
    Case('loaders.sampled-batch', '''\
def train(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(10):
        ix = torch.randint(len(data) - 8, (batch_size,))
        loss = model(data[ix])
        loss.backward()
        opt.step()
''', '''\
def train(model, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for it in range(10):
        ix = torch.randint(len(data) - 8, (batch_size,))
        loss = model(data[ix])
        loss.backward()
        tu.optimizer_step(opt)
        tu.sync()
''', notes=('loaders.sampled-batch', 'steps.sync')),
    Case('loaders.batch-size-shape', '''\
def info_nce_loss(self, features):
    labels = torch.cat([torch.arange(self.args.batch_size) for i in range(2)], dim=0)
    return labels.to(features.device)
''', '''\
def info_nce_loss(self, features):
    labels = torch.cat([torch.arange(tu.rows_per_step(self.args.batch_size)) for i in range(2)], dim=0)
    return labels.to(features.device)
'''),
    Case('entry.absl-app-run', '''\
from absl import app


def main(argv):
    for x in loader:
        model(x).backward()


if __name__ == "__main__":
    app.run(main)
''', '''\
import sys
from absl import app


def main(argv):
    for x in loader:
        model(x).backward()


def main_tpu(argv):
    # app.run(main) parsed the flags, then exited with main's result: each
    # replica parses them here (spawn starts it afresh), and the result returns
    return main(app.parse_flags_with_usage(argv))


if __name__ == "__main__":
    tu.run(main_tpu, cores=8, args=(sys.argv,))
''', script=True),
    Case('accelerate.import', '''\
from accelerate import Accelerator
import torch


def main():
    accelerator = Accelerator()
    accelerator.print("hello")
''', '''\
import torch


def main():
    tu.master_print("hello")
'''),
    Case('accelerate.accelerator', '''\
from accelerate import Accelerator


def main(model, optimizer, loader):
    accelerator = Accelerator(gradient_accumulation_steps=4)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
''', '''\
from accelerate import Accelerator


def main(model, optimizer, loader):
    accelerator = Accelerator(gradient_accumulation_steps=4)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
''', notes=('accelerate.accelerator',)),
    Case('accelerate.prepare', '''\
def main():
    accelerator = Accelerator()
    if name:
        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=2)
    else:
        model = AutoModelForSequenceClassification.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    model, optimizer, train_dl, sched = accelerator.prepare(model, optimizer, train_dl, sched)
    for batch in train_dl:
        accelerator.backward(model(**batch).loss / 2)
        optimizer.step()
''', '''\
def main():
    if name:
        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=2)
        model.to(tu.get_device())
    else:
        model = AutoModelForSequenceClassification.from_config(config)
        model.to(tu.get_device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    for batch in train_dl:
        (model(**batch).loss / 2).backward()
        tu.optimizer_step(optimizer)
'''),
    Case('accelerate.gone', '''\
def main(model):
    accelerator = Accelerator(log_with="all")
    accelerator.init_trackers("run")
    accelerator.log({"loss": 1.0}, step=3)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return model
''', '''\
def main(model):
    return model
'''),
    Case('accelerate.call', '''\
def evaluate(model, loader):
    accelerator = Accelerator()
    seen = 0
    for batch in loader:
        with accelerator.autocast():
            logits = model(**batch).logits
        preds, refs = accelerator.gather_for_metrics((logits.argmax(-1), batch["labels"]))
        seen += refs.shape[0]
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    accelerator.save(accelerator.unwrap_model(model).state_dict(), "model.pt")
''', '''\
def evaluate(model, loader):
    seen = 0
    for batch in loader:
        with tu.autocast():
            logits = model(**batch).logits
        preds, refs = (logits.argmax(-1), batch["labels"])
        seen += refs.shape[0]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    tu.save(model.state_dict(), "model.pt")
''', notes=('accelerate.call',)),
    Case('accelerate.attribute', '''\
def main(model):
    accelerator = Accelerator()
    x = torch.zeros(3, device=accelerator.device)
    if accelerator.is_main_process and accelerator.sync_gradients:
        print(accelerator.num_processes, accelerator.process_index)
''', '''\
def main(model):
    x = torch.zeros(3, device=tu.get_device())
    if tu.is_master() and True:
        print(tu.world_size(), tu.rank())
'''),
    Case('accelerate.distributed-type', '''\
from accelerate import Accelerator, DistributedType


def main(model):
    accelerator = Accelerator(mixed_precision="bf16")
    if accelerator.distributed_type == DistributedType.TPU:
        model.tie_weights()
''', '''\
from accelerate import Accelerator, DistributedType


def main(model):
    accelerator = Accelerator(mixed_precision="bf16")
    if accelerator.distributed_type == DistributedType.XLA:
        model.tie_weights()
''', notes=('accelerate.accelerator',)),
    Case('io.save-pretrained', '''\
def main(model, tokenizer, out):
    model.train()
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
''', '''\
def main(model, tokenizer, out):
    model.train()
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True, state_dict=tu.to_cpu(model.state_dict()))
'''),
    Case('conditions.launch-check', '''\
def main():
    ddp = int(os.environ.get("RANK", -1)) != -1
''', '''\
def main():
    ddp = int(os.environ.get("RANK", -1)) != -1
''', notes=('conditions.launch-check',)),
    Case('conditions.string-device', '''\
def main():
    device = "cuda"
    device_type = "cuda" if "cuda" in device else "cpu"
''', '''\
def main():
    device = str(tu.get_device())
    device_type = "cuda" if "cuda" in device else "cpu"
''', notes=('conditions.string-device',)),
    Case('conditions.bfloat-support', '''\
def main():
    bf16 = torch.cuda.is_bf16_supported()
''', '''\
def main():
    bf16 = (not torch.cuda.is_available() or torch.cuda.is_bf16_supported())
'''),
    Case('runtime.cuda-device', '''\
import torch


def main(args, model):
    with torch.cuda.device(args.gpu_index):
        model.fit()
''', '''\
import torch
import contextlib


def main(args, model):
    with contextlib.nullcontext():
        model.fit()
'''),
    Case('runtime.import-contextlib', '''\
def main(model):
    with torch.cuda.device(0), torch.no_grad():
        model.fit()
''', '''\
import contextlib
def main(model):
    with contextlib.nullcontext(), torch.no_grad():
        model.fit()
'''),
    Case('runtime.compile-line', '''\
def main(model):
    model = torch.compile(model)
    return model
''', '''\
def main(model):
    return model
'''),
    Case('runtime.compile', '''\
def main(model):
    fast = torch.compile(model, mode="max-autotune")
''', '''\
def main(model):
    fast = model
'''),
    Case('runtime.compile-decorator', '''\
@torch.compile
def step(x):
    return x * 2
''', '''\
def step(x):
    return x * 2
'''),
    Case('reads.conversion', '''\
def fit(model, opt, loader, writer):
    for step, (x, y) in enumerate(loader):
        loss = model(x, y)
        loss.backward()
        writer.add_scalar("loss", loss, step)
''', '''\
def fit(model, opt, loader, writer):
    for step, (x, y) in enumerate(loader):
        loss = model(x, y)
        loss.backward()
        writer.add_scalar("loss", loss, step)
''', notes=('reads.conversion',)),
    Case('reads.percent-format', '''\
def fit(model, opt, loader):
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        print("%.3f" % loss)
''', '''\
def fit(model, opt, loader):
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        print("%.3f" % loss)
''', notes=('reads.percent-format',)),
    Case('reads.f-string', '''\
def fit(model, opt, loader):
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        print(f"{loss:.3f}")
''', '''\
def fit(model, opt, loader):
    for x, y in loader:
        loss = model(x, y)
        loss.backward()
        print(f"{loss:.3f}")
''', notes=('reads.f-string',)),
    Case('reads.logging-round', '''\
def fit(model, opt, loader, writer):
    for step, (x, y) in enumerate(loader):
        model(x, y).backward()
        if step % 100 == 0:
            for name, value in model.named_parameters():
                writer.add_histogram(name, value.data.cpu().numpy(), step)
''', '''\
def fit(model, opt, loader, writer):
    for step, (x, y) in enumerate(loader):
        model(x, y).backward()
        if step % 100 == 0:
            for name, value in model.named_parameters():
                writer.add_histogram(name, value.data.cpu().numpy(), step)
''', notes=('io.host-read', 'reads.logging-round')),
]


@pytest.mark.parametrize("case", CASES, ids=[c.rule for c in CASES])
def test_rule(case):
    assert_ports(case.before, case.after, case.rule, case.notes, case.script)


def test_every_rule_has_an_id_a_description_and_a_case():
    ids = [rule.id for rule in RULES]
    assert len(ids) == len(set(ids))
    assert sorted(c.rule for c in CASES) == sorted(ids)
    for rule in RULES:
        assert re.fullmatch(r"[a-z]+\.[a-z-]+", rule.id), rule.id
        assert rule.description and "\n" not in rule.description and "|" not in rule.description


def test_docs_table_is_made_from_the_rules():
    text = (ROOT / "docs" / "porting.md").read_text()
    start = text.index("<!-- rules table")
    start = text.index("\n", start) + 1
    assert text[start:text.index("<!-- end of rules table -->")] == table(), (
        "docs/porting.md's rules table is stale: replace it with "
        "python -c 'from tpu_utility.port.rules import table; print(table())'")


def test_the_notes_of_a_whole_script_each_name_a_rule_of_the_table():
    source = textwrap.dedent("""\
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.to(device)
        for i, (x, y) in enumerate(DataLoader(ds, batch_size=bs, **kw)):
            loss = model(x, y)
            loss.backward()
            opt.step()
            print(loss.item())
        """)
    result = port_source(source, script=True)
    ids = {rule.id for rule in RULES}
    assert result.todo and {r for _, r in result.note_rules} <= ids
    assert [line for line, _ in result.note_rules] == [line for line, _ in result.todo]


def test_no_port_module_over_300_lines_and_no_class_over_150():
    for path in sorted((ROOT / "tpu_utility" / "port").rglob("*.py")):
        text = path.read_text()
        assert text.count("\n") <= 300, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno + 1 <= 150, (path, node.name)
        # no module reaches into another's private names
        assert not re.search(r"^from \.+[\w.]* import .*\b_[a-z]", text, re.M), path


def test_an_item_read_once_an_epoch_is_not_called_a_read_every_step():
    # the epoch loop holds the step loop, so it holds a backward() too: only the loop whose
    # own body steps is the step loop
    result = port_source(textwrap.dedent('''\
        def fit(model, opt, loader, epochs):
            for epoch in range(epochs):
                total = 0.0
                for batch in loader:
                    loss = model(**batch).loss
                    loss.backward()
                    opt.step()
                    total += loss.detach()
                    print(loss.item())
                print(epoch, total.item() / len(loader))
        '''))
    reads = [(line, text) for line, text in result.todo if "every step" in text]
    assert [line for line, _ in reads] == [9], result.todo


def test_a_written_shuffle_decides_beside_kwargs():
    # (issue 34) `**kwargs` hid the loader's use; a shuffle=True written beside them says it
    result = port_source("def f(ds, kwargs):\n    dl = DataLoader(ds, batch_size=8, shuffle=True, **kwargs)\n")
    assert result.text == "def f(ds, kwargs):\n    dl = tu.make_loader(ds, batch_size=8, **kwargs)\n"
    assert result.todo == []


def test_a_scaler_step_is_kept_and_its_note_names_the_scaler_not_the_optimizer():
    # (issue 34) the note said "make it tu.optimizer_step(scaler)": wrong for a GradScaler
    loop = ("    for x, y in loader:\n        scaler.scale(model(x, y)).backward()\n"
            "        scaler.step(optimizer)\n        scaler.update()\n")
    passed = port_source("def train(model, optimizer, scaler, loader):\n" + loop)
    assert passed.text == "def train(model, optimizer, scaler, loader):\n" + loop
    [(line, note)] = passed.todo
    assert line == 4 and "make scaler with tu.GradScaler()" in note and "optimizer_step(scaler" not in note
    made = port_source("def train(model, optimizer, loader):\n    scaler = torch.cuda.amp.GradScaler()\n" + loop)
    assert made.text == "def train(model, optimizer, loader):\n    scaler = tu.GradScaler()\n" + loop
    assert made.todo == []


def test_an_optimizer_goes_down_after_a_move_that_reads_what_is_set_between():
    # (issue 34) a notebook's shape: the device is chosen between the optimizer and the move
    assert_ports('''\
        def main(net):
            criterion = nn.CrossEntropyLoss()
            # SGD with momentum
            optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
            device = pick_device()
            print(device)
            net.to(device)
            return optimizer
        ''', '''\
        def main(net):
            criterion = nn.CrossEntropyLoss()
            device = pick_device()
            print(device)
            net.to(device)
            # SGD with momentum
            optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
            return optimizer
        ''', "order.move-before-optimizer")
    # a statement between that uses the optimizer holds it: listed instead
    kept = port_source("def main(net):\n    opt = SGD(net.parameters())\n    device = pick()\n"
                       "    sched = StepLR(opt)\n    net.to(device)\n")
    assert kept.text.startswith("def main(net):\n    opt = SGD(") and [r for _, r in kept.note_rules] == [
        "order.move-before-optimizer"]


def test_every_note_whose_fix_is_code_compiles_with_its_fix_written_in():
    # (issue 34) a note said "make it tu.optimizer_step(scaler)" for scaler.step(opt):
    # each fix that is code is written into the line it names, and the file must compile
    from tpu_utility.port.edits import apply
    sources = [textwrap.dedent(c.before) for c in CASES if not c.script] + [
        "def f(ds, train):\n    dl = DataLoader(ds, batch_size=8,\n                    shuffle=train)\n",
        "def fit(model, trainer, loader):\n    for x in loader:\n        model(x).backward()\n"
        "        trainer.step()\n",
        "def main(cfg):\n    device = torch.device(cfg['mode'])\n"]
    fixed = set()
    for source in sources:
        result = port_source(source)
        for line, fix in result.note_fixes:
            compile(apply(source, [(*where, code) for where, code in fix]), "fixed", "exec")
            fixed.add(dict(result.note_rules)[line])
    assert fixed == {"loaders.dataloader", "steps.optimizer-step", "device.torch-device"}
