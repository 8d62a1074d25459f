"""Train a small GPT with PyTorch's SDPA and with attngen, from the same weights on the same batches, and compare.

    python examples/train_gpt.py                  # a GPU: 500 steps per run (under 10 s of training each on an H100)
    python examples/train_gpt.py --compile        # the same under torch.compile(fullgraph=True)
    python examples/train_gpt.py --compile --compile-mode reduce-overhead   # ... with CUDA graphs (no host time per call)
    python examples/train_gpt.py --smoke          # the CPU: 2 steps of a tiny model, kernels in Triton's interpreter
    torchrun --nproc-per-node 2 examples/train_gpt.py --context-parallel 2 [--method ring|ulysses|hybrid]
                                                  # each sequence split over 2 GPUs, the model sharded by FSDP2

The runs (each starts from the same initial weights and sees the same batches in the same order):

    sdpa            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    attngen         specs/causal.attn: the same attention through attngen's kernels; its loss curve should
                    match sdpa's within bf16 noise
    window_softcap  examples/window_softcap.attn: causal within 256 tokens, scores softcapped at 30
                    (Gemma-2's attention, which SDPA's fused kernels cannot run): a different model, whose curve
                    only shows that it learns

The corpus needs no download: the source text of CPython's standard library (its top-level modules, sorted by
name, the first --corpus-mb megabytes), one token per byte (a vocabulary of 256); the last 10% is held out.
The model is GPT-2's (pre-norm blocks, learned positions, tied embeddings) with heads of 128 dimensions, trained
in bf16 autocast with AdamW. Written: OUT.json (per run: the loss at every step, held-out losses, tokens per
second) and, where matplotlib is installed, OUT.png (the loss curves).

--context-parallel N (under torchrun, N processes; gloo on the CPU, NCCL on GPUs): every rank takes the same batch
and keeps its N-th of each sequence's tokens (the contiguous layout); attngen's attention is
attngen.distributed.context_parallel over the ranks (--method: the ring, Ulysses' all-to-all over heads, or both),
the model is sharded over the same ranks by FSDP2 (torch.distributed.fsdp.fully_shard), and each rank's loss is
its tokens' mean, so the gradients FSDP averages are those of the whole batch's loss. The printed losses are the
ranks' mean: the run's losses should match a one-process run's within bf16 noise. SDPA has no such form: its run
is skipped.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--steps", type=int, default=500)
ap.add_argument("--layers", type=int, default=6)
ap.add_argument("--heads", type=int, default=None, help="attention heads of 128 dimensions each (default 4; 1 with --smoke)")
ap.add_argument("--context", type=int, default=1024, help="tokens per sequence")
ap.add_argument("--batch", type=int, default=16, help="sequences per step")
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--runs", nargs="+", default=["sdpa", "attngen", "window_softcap"], choices=["sdpa", "attngen", "window_softcap"])
ap.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True) for every run")
ap.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune"],
                help="torch.compile's mode (reduce-overhead: CUDA graphs, which take the host's time per call away)")
ap.add_argument("--corpus-mb", type=float, default=4.0)
ap.add_argument("--eval-every", type=int, default=100)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--out", default="train_gpt", help="writes OUT.json and OUT.png")
ap.add_argument("--smoke", action="store_true", help="CPU: 2 steps of a 1-layer, 1-head model over 32 tokens (the interpreter)")
ap.add_argument("--context-parallel", type=int, default=1, metavar="N",
                help="split each sequence over N processes (torchrun --nproc-per-node N), the model sharded by FSDP2 over them")
ap.add_argument("--method", default="ring", choices=["ring", "ulysses", "hybrid"], help="context parallelism's method (with --context-parallel)")
ap.add_argument("--ulysses-size", type=int, default=None, help="Ulysses' group size with --method hybrid")
args = ap.parse_args()
if args.smoke:
    args.steps, args.layers, args.context, args.batch, args.eval_every, args.corpus_mb = 2, 1, 32, 2, 2, 0.1
    args.heads = args.heads or 1
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
args.heads = args.heads or 4

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402

HEAD_DIM = 128
SPECS = {"attngen": ROOT / "specs" / "causal.attn", "window_softcap": ROOT / "examples" / "window_softcap.attn"}
DEVICE = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
CP = args.context_parallel
RANK = 0
if CP > 1:  # one process per shard of the sequence (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)
    import torch.distributed as dist  # noqa: E402
    from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
    from torch.distributed.fsdp import fully_shard  # noqa: E402

    import attngen.distributed as cp  # noqa: E402

    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) != CP:
        raise SystemExit(f"--context-parallel {CP} runs under torchrun with {CP} processes: torchrun --nproc-per-node {CP} {sys.argv[0]} ...")
    if args.context % CP:
        raise SystemExit(f"--context {args.context} must be a multiple of --context-parallel {CP} (each rank keeps an equal share)")
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    RANK = dist.get_rank()
    MESH = init_device_mesh(DEVICE, (CP,))
    if "sdpa" in args.runs:
        if RANK == 0:
            print("(SDPA has no context-parallel form: its run is skipped)")
        args.runs = [r for r in args.runs if r != "sdpa"]
SHARD = args.context // CP  # the tokens of each sequence this rank keeps, from RANK * SHARD


def corpus(max_bytes: int) -> torch.Tensor:
    """The bytes of CPython's standard library modules (top level, sorted by name), as token ids."""
    data = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, width: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(), nn.Linear(4 * width, width, bias=False))

    def forward(self, x):
        B, T, C = x.shape
        # q, k, v: (B, heads, T, 128) views of one projection; both attentions take them in bf16
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, HEAD_DIM).to(torch.bfloat16).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v).to(x.dtype)
        x = x + self.proj(o.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, heads: int, context: int, attend):
        super().__init__()
        width = heads * HEAD_DIM
        self.tok, self.pos = nn.Embedding(256, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, attend) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        for name, p in self.named_parameters():  # GPT-2's initialization (residual projections scaled by depth)
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        """The mean loss over idx's tokens: with --context-parallel, this rank's share of each sequence (positions
        from RANK * SHARD)."""
        first = RANK * SHARD
        x = self.tok(idx) + self.pos(torch.arange(first, first + idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()  # tied embeddings
        return F.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))


def attention(run: str):
    if run == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kern = attngen.compile(SPECS[run], "h100" if DEVICE == "cpu" else None)  # the interpreter runs any target's kernels
    if CP > 1:  # this rank's shard of the whole sequence's attention
        return lambda q, k, v: cp.context_parallel(kern, q, k, v, method=args.method, ulysses_size=args.ulysses_size)
    return lambda q, k, v: kern(q, k, v)


def batches(data: torch.Tensor, seed: int):
    """Random windows of context + 1 tokens: the same sequence of batches for every run with this seed."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=gen)
        rows = torch.stack([data[s:s + args.context + 1] for s in starts.tolist()]).to(DEVICE)
        x, y = rows[:, :-1], rows[:, 1:]
        yield x[:, RANK * SHARD:(RANK + 1) * SHARD], y[:, RANK * SHARD:(RANK + 1) * SHARD]  # (all of it without --context-parallel)


def mean_over_ranks(loss: torch.Tensor) -> float:
    """A loss as a number: with --context-parallel the ranks' mean (each rank's is its tokens' mean, all equal in number)."""
    if CP > 1:
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= CP
    return loss.item()


def autocast():
    return torch.autocast("cuda", dtype=torch.bfloat16) if DEVICE == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor) -> float:
    model.eval()
    losses = []
    for _, (x, y) in zip(range(8), batches(data, args.seed + 1)):
        with autocast():
            losses.append(mean_over_ranks(model(x, y)))
    model.train()
    return sum(losses) / len(losses)


def train(run: str, train_data: torch.Tensor, val_data: torch.Tensor, initial: dict) -> dict:
    model = GPT(args.layers, args.heads, args.context, attention(run)).to(DEVICE)
    model.load_state_dict(initial)
    if CP > 1:  # FSDP2: each block's parameters, then the rest, sharded over the ranks; gradients averaged over them
        for block in model.blocks:
            fully_shard(block, mesh=MESH)
        fully_shard(model, mesh=MESH)
    step_fn = torch.compile(model, fullgraph=True, mode=args.compile_mode) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=DEVICE == "cuda")
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    losses, held_out, timed_steps, timed_s = [], [], 0, 0.0
    data = batches(train_data, args.seed)
    for step in range(args.steps):
        x, y = next(data)
        sync()
        t = time.perf_counter()
        with autocast():
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(mean_over_ranks(loss))  # synchronizes
        if step >= min(20, args.steps // 2):  # after warm-up (compilation, autotuning)
            timed_steps, timed_s = timed_steps + 1, timed_s + time.perf_counter() - t
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            held_out.append((step + 1, held_out_loss(model, val_data)))
            if RANK == 0:
                print(f"  {run:<15} step {step + 1:>5}  loss {losses[-1]:.4f}  held-out {held_out[-1][1]:.4f}", flush=True)
    tokens_per_s = timed_steps * args.batch * args.context / timed_s if timed_s else None  # (every rank's tokens together)
    return {"loss": losses, "held_out": held_out, "tokens_per_s": tokens_per_s}


def main():
    data = corpus(int(args.corpus_mb * 2**20))
    split = int(0.9 * len(data))
    torch.manual_seed(args.seed)
    initial = GPT(args.layers, args.heads, args.context, None).state_dict()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton's interpreter)"
    compiled = f", torch.compile (mode {args.compile_mode or 'default'})" if args.compile else ""
    sharded = f", context parallel over {CP} processes ({args.method}) with FSDP2" if CP > 1 else ""
    if RANK == 0:
        print(f"{name}; torch {torch.__version__}; {len(data)} bytes of corpus; {args.layers} layers x {args.heads} heads x {HEAD_DIM}, "
              f"{args.batch} x {args.context} tokens per step, {args.steps} steps{compiled}{sharded}")
    results = {}
    for run in args.runs:
        results[run] = train(run, data[:split], data[split:], initial)
    if CP > 1:
        # the sharded models (kept alive by reference cycles through FSDP's hooks) freed while the process group lives,
        # then every rank leaves it together: gloo's worker threads must not outlive it holding tensors (at the
        # interpreter's exit that aborts the process)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        if RANK:
            return
    config = {k: v for k, v in vars(args).items() if k != "out"} | {"device": name, "torch": torch.__version__, "corpus_bytes": len(data)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".json.tmp")
    tmp.write_text(json.dumps({"config": config, "runs": results}, indent=1))
    tmp.replace(out.with_name(out.name + ".json"))
    plot(results, out.with_name(out.name + ".png"))
    print(f"\n{'run':<15} {'final loss (mean of last 10%)':>30} {'held-out':>9} {'tokens/s':>10}")
    tail = max(1, args.steps // 10)
    for run, r in results.items():
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        print(f"{run:<15} {sum(r['loss'][-tail:]) / tail:>30.4f} {r['held_out'][-1][1]:>9.4f} {tps:>10}")


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"(matplotlib is not installed: no {path.name})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run, r in results.items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=f"{run} (train)", linewidth=0.8)
        steps, held = zip(*r["held_out"])
        ax.plot(steps, held, "o--", label=f"{run} (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title("examples/train_gpt.py")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
