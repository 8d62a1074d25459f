"""Context parallelism: one attention over the ranks of a torch.distributed process group: ring attention
(ring.py), head-parallel Ulysses and the two combined (ulysses.py; method="ring" | "ulysses" | "hybrid").

    import attngen, attngen.distributed as cp
    kern = attngen.compile("specs/causal.attn")
    q, k, v = (cp.shard(t, layout="zigzag") for t in (q_full, k_full, v_full))   # or each rank's own shard
    o = cp.context_parallel(kern, q, k, v, layout="zigzag")                    # this rank's shard of O
    o_full = cp.unshard(o, layout="zigzag")

NCCL on GPUs, gloo on CPUs (the kernels then run in Triton's interpreter); torch.distributed only."""
from .layout import LAYOUTS, shard, unshard
from .ring import context_parallel
from .ulysses import METHODS

__all__ = ["LAYOUTS", "METHODS", "context_parallel", "shard", "unshard"]
