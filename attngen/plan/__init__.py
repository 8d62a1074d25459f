"""Planning: a Spec and a target GPU to a KernelPlan.

    planner.py   plan(spec, target): tiles, warps and stages derived from the target's on-chip memory, each step
                 of the derivation recorded; the facts every generator renders from (mask, inputs, dropout, ...)
    decode.py    the decode kernels' split of the keys and rows per program
    tune.py      `auto` tiles: measured per shape bucket on the GPU, kept on disk
The GPU table the plan reads is attngen/targets.py.
"""
