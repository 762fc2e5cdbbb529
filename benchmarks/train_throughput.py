"""Training-step throughput: audioclf's TrainStep (the Trainer's step) versus a bare hand-written loop.

    .venv/bin/python benchmarks/train_throughput.py [--model cnn|conformer] [--steps 30]
    .venv/bin/python benchmarks/train_throughput.py --smoke   # 3 steps once, DDP too: every line

Both loops train the same model (the demo CNN by default, log-mel front end included) on the
same in-memory batches of random audio with the same triplet loss and AdamW, so the ratio is the
overhead of audioclf's loop (autocast context, GradScaler, gradient-norm check, loss bookkeeping,
LR schedule). Target: overhead <= 5 %. Then the same loop under DDP (gloo) with 1 and with 2
processes on CPU, one thread each, reported as global samples/s and their ratio.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from audioclf.config import load_config  # noqa: E402
from audioclf.losses import build_loss  # noqa: E402
from audioclf.models import build_net  # noqa: E402
from audioclf.precision import resolve_precision  # noqa: E402
from audioclf.training.optim import LRSchedule, build_optimizer  # noqa: E402
from audioclf.training.step import NonFiniteGuard, TrainStep  # noqa: E402


def make_config(model: str):
    return load_config(
        Path(__file__).resolve().parents[1] / f"configs/demo_{model}.yaml", ["optim.warmup_steps=0"]
    )


def make_batches(cfg, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = cfg.clips.crop_samples(cfg.features)
    classes = cfg.sampler.batch_size // cfg.sampler.m
    out = []
    for _ in range(steps):
        x = torch.randn(cfg.sampler.batch_size, n, generator=g) * 0.1
        labels = torch.arange(classes).repeat_interleave(cfg.sampler.m)
        out.append((x, torch.full((len(x),), n), labels, torch.arange(len(x))))
    return out


def fresh(cfg):
    torch.manual_seed(0)
    net = build_net(cfg, num_classes=0)
    opt = build_optimizer(net.parameters(), cfg.optim, torch.device("cpu"))
    return net, opt, build_loss(cfg)


def time_bare(cfg, batches) -> float:
    net, opt, loss_core = fresh(cfg)
    net.train()
    start = time.perf_counter()
    for x, lengths, labels, _ in batches:
        embeddings, logits = net(x, lengths)
        loss = loss_core(embeddings, labels, logits)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def time_audioclf(cfg, batches, model=None) -> float:
    net, opt, loss_core = fresh(cfg)
    model = model(net) if model else net
    precision = resolve_precision(cfg.train, torch.device("cpu"))
    schedule = LRSchedule(opt, cfg.optim, cfg.optim.lr, cfg.train.epochs)

    def loss_fn(output, labels, positions=None):
        return loss_core(output[0], labels, output[1])

    step = TrainStep(
        model,
        opt,
        precision,
        loss_fn,
        guard=NonFiniteGuard(10),
        max_grad_norm=cfg.optim.max_grad_norm,
    )
    start = time.perf_counter()
    step.start_epoch()
    for number, batch in enumerate(batches):  # the Trainer's loop, without a loader
        step.micro_batch(batch)
        schedule.apply(number, epoch=0)
        step.update()
    step.sync(False, len(batches))
    step.end_epoch(0.0, stopped=False)
    return time.perf_counter() - start


def _ddp_worker(rank, world, port, model_name, steps, queue):
    import torch.distributed as dist

    from audioclf import distributed

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    cfg = make_config(model_name)
    env = distributed.DistEnv(rank=rank, world_size=world, strategy="ddp", backend="gloo")
    batches = make_batches(cfg, steps, seed=rank)
    wrap = lambda net: distributed.wrap(net, env, sync_bn=False, find_unused_parameters=False)  # noqa: E731
    time_audioclf(cfg, batches[:3], wrap)  # warm-up
    dist.barrier()
    seconds = time_audioclf(cfg, batches, wrap)
    seconds = distributed.all_reduce_sum([seconds]).item() / world
    if rank == 0:
        queue.put(seconds)
    dist.destroy_process_group()


def ddp_samples_per_second(model_name: str, steps: int, world: int) -> float:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_ddp_worker, args=(r, world, port, model_name, steps, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    seconds = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    batch = make_config(model_name).sampler.batch_size
    return steps * batch * world / seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["cnn", "conformer"], default="cnn")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats (best counts)")
    parser.add_argument("--skip-ddp", action="store_true", help="skip the 1 vs 2 process part")
    parser.add_argument(
        "--smoke", action="store_true", help="3 steps, one repeat: every line, in seconds"
    )
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats = 3, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

    cfg = make_config(args.model)
    batches = make_batches(cfg, args.steps)
    time_bare(cfg, batches[:3])
    time_audioclf(cfg, batches[:3])  # warm-up both
    bare, ours = [], []
    for _ in range(args.repeats):  # alternate so drift in machine load hits both
        bare.append(time_bare(cfg, batches))
        ours.append(time_audioclf(cfg, batches))
    samples = args.steps * cfg.sampler.batch_size
    b, o = min(bare), min(ours)
    overhead = o / b - 1
    print(
        f"model {args.model}, batch {cfg.sampler.batch_size}, {args.steps} steps, 1 thread, "
        f"best of {args.repeats}"
    )
    print(f"bare loop        {samples / b:8.1f} samples/s  ({b:.2f} s)")
    print(f"audioclf loop    {samples / o:8.1f} samples/s  ({o:.2f} s)")
    print(f"overhead         {overhead * 100:+.1f} %   (audioclf time / bare time = {o / b:.3f})")
    print(f"{'PASS' if overhead <= 0.05 else 'FAIL'}  overhead <= 5 %")
    if args.skip_ddp:
        return
    one = ddp_samples_per_second(args.model, args.steps, 1)
    two = ddp_samples_per_second(args.model, args.steps, 2)
    print(f"DDP gloo, 1 process   {one:8.1f} samples/s (global)")
    print(f"DDP gloo, 2 processes {two:8.1f} samples/s (global)")
    print(f"2 / 1 process ratio   {two / one:.2f}x  (2 cores; ideal 2.0x)")


if __name__ == "__main__":
    main()
