"""A classifier with the whole torch.distributed boilerplate: mp.spawn, init_process_group,
set_device, a DistributedSampler, the DDP wrapper, cudnn.benchmark and a nested device
choice. Without --multiprocessing-distributed (and with --world-size 1) it runs as one
process, on the CPU where there is no GPU.

Written for tpu_utility's tests in the shape of a multi-GPU training script.
"""
import argparse
import random

import torch
import torch.backends.cudnn as cudnn
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description="distributed training boilerplate")
parser.add_argument("--epochs", default=3, type=int)
parser.add_argument("--batch-size", default=64, type=int, help="total over all GPUs")
parser.add_argument("--lr", default=0.1, type=float)
parser.add_argument("--workers", default=0, type=int)
parser.add_argument("--world-size", default=1, type=int, help="number of nodes")
parser.add_argument("--rank", default=0, type=int, help="node rank")
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--dist-backend", default="nccl", type=str)
parser.add_argument("--gpu", default=None, type=int, help="GPU id to use")
parser.add_argument("--seed", default=7, type=int)
parser.add_argument("--multiprocessing-distributed", action="store_true",
                    help="one process per GPU, each with its own DDP replica")


def synthetic(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 5, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x @ w + 0.3 * torch.randn(n, 5, generator=g)).argmax(1))


def main():
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    ngpus_per_node = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if args.multiprocessing_distributed:
        args.world_size = ngpus_per_node * args.world_size
        mp.spawn(main_worker, nprocs=ngpus_per_node, args=(ngpus_per_node, args))
    else:
        main_worker(args.gpu, ngpus_per_node, args)


def main_worker(gpu, ngpus_per_node, args):
    args.gpu = gpu
    if args.distributed:
        if args.multiprocessing_distributed:
            args.rank = args.rank * ngpus_per_node + gpu
        dist.init_process_group(backend=args.dist_backend, init_method=args.dist_url,
                                world_size=args.world_size, rank=args.rank)
    if torch.cuda.is_available():
        if args.gpu is not None:
            torch.cuda.set_device(args.gpu)
            device = torch.device(f"cuda:{args.gpu}")
        else:
            device = torch.device("cuda")
    elif torch.backends.mps.is_available():
        device = torch.device("mps")
    else:
        device = torch.device("cpu")

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 5))
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        print("using CPU, this will be slow")
    elif args.distributed:
        if args.gpu is not None:
            model.cuda(args.gpu)
            args.batch_size = int(args.batch_size / ngpus_per_node)
            model = DistributedDataParallel(model, device_ids=[args.gpu])
        else:
            model.cuda()
            model = DistributedDataParallel(model)
    elif args.gpu is not None and torch.cuda.is_available():
        model = model.cuda(args.gpu)
    elif torch.backends.mps.is_available():
        model = model.to(device)
    else:
        model = nn.DataParallel(model).cuda()
    cudnn.benchmark = True

    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    train_dataset, val_dataset = synthetic(512, 1), synthetic(256, 2)
    train_sampler = DistributedSampler(train_dataset) if args.distributed else None
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True) if args.distributed else None
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=(train_sampler is None),
                              num_workers=args.workers, pin_memory=True, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False,
                            num_workers=args.workers, pin_memory=True, sampler=val_sampler)

    for epoch in range(args.epochs):
        if args.distributed:
            train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, device, args)
        validate(val_loader, model, criterion, device, args)
        scheduler.step()
        if not args.distributed or args.rank % ngpus_per_node == 0:
            to_save = model.module if hasattr(model, "module") else model
            torch.save({"epoch": epoch + 1, "state_dict": to_save.state_dict(),
                        "optimizer": optimizer.state_dict()}, "checkpoint.pth.tar")
    if args.distributed:
        dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, device, args):
    model.train()
    for i, (images, target) in enumerate(train_loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 2 == 0:
            print("Epoch: [%d][%d/%d] LOSS %.6f" % (epoch, i, len(train_loader), loss.item()))


def validate(val_loader, model, criterion, device, args):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for images, target in val_loader:
            images, target = images.to(device), target.to(device)
            output = model(images)
            stats[0] += criterion(output, target) * target.size(0)
            stats[1] += (output.argmax(1) == target).sum()
            stats[2] += target.size(0)
    if args.distributed:
        dist.all_reduce(stats, dist.ReduceOp.SUM)
    print("VAL loss %.6f acc %.4f" % ((stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()))


if __name__ == "__main__":
    main()
