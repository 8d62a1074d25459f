"""Host time per call, by call kind, beside PyTorch's peers and the bare kernel launch; with --profile, where each
microsecond goes.

    python benchmarks/call_overhead.py [--kinds forward train sink decode paged packed fp8 compiled generate] [--calls 2000]
                                       [--profile] [--json results.json]

Each kind is a call whose GPU work is small (so a loop of calls runs at the host's pace): its rows are timed as
the median of 5 interleaved rounds of `--calls` calls after warm-up, microseconds per call; every row of a kind
checks its result against the first peer's before it is timed. The kinds:

- forward: 1 x 16 x 512 x 128 causal, bf16, under no_grad; SDPA (is_causal); FlexAttention (compiled, its block
  mask made once); the Gluon module's launcher alone; one launch of its kernel (outputs allocated once).
- train: the same, forward + backward (torch.autograd.grad of O with a random dO) with SDPA's and Flex's, and a
  Python autograd.Function that allocates its results and launches nothing (the floor of any such function), and
  the same as a torch.library.custom_op with register_autograd.
- decode: B = 1, 32 query heads over 8 key/value heads, d = 128, one query, 4096 cached keys, `kv_lens=`; SDPA
  with enable_gqa; the same attngen call replayed from a CUDA graph; the Triton module's decode launcher alone.
- paged: the same over a paged cache (16-token pages, a block table).
- sink: gpt-oss's windowed layer (64 query heads over 8 key/value heads, d = 64, 512 tokens, a window of 128 keys,
  a learned sink per head), forward + backward with the sinks' gradient; the same spec without the sink; SDPA
  (causal, enable_gqa); transformers-style eager attention with the sink (the check's peer).
- packed: four sequences of 128 tokens (cu_seqlens), 16 heads, d = 128, causal, forward + backward.
- fp8: the forward of `dtype = fp8` (causal, d = 128) on e4m3 inputs with per-head descales, beside the bf16 call.
- compiled: inside torch.compile(fullgraph=True), no grad: the kernel's operator; a `triton_op` launching the
  Triton generator's forward kernel through wrap_triton; SDPA; and forward + backward of the kernel and of SDPA.
- generate: Hugging Face `generate()` of a small random Llama (4 layers, 8 query heads over 2 key/value heads of
  128, bf16), B = 1, 64 prompt tokens, 64 new ones (greedy), eager, through attngen.hf and through SDPA: us per
  new token (calls / 200 calls per round).

--profile: cProfile over 500 calls of attngen's row of each kind, the functions by their own time, per call.
The last thing printed is the table. Needs a CUDA GPU (sm_90 for the Gluon rows).
"""
import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen import fp8  # noqa: E402
from attngen.plan.decode import decode_shape  # noqa: E402

KINDS = ("forward", "train", "sink", "decode", "paged", "packed", "fp8", "compiled", "generate")
GENERATED = 64  # tokens a `generate` call makes
CAUSAL = ROOT / "specs" / "causal.attn"


def per_call_us(rows: dict, calls: int) -> dict:
    """Median host us per call of each function in rows {name: fn}, the rounds of every row interleaved (hosts
    drift: rows timed one after another were not comparable)."""
    for fn in rows.values():
        for _ in range(min(500, calls)):
            fn()
    rounds = {name: [] for name in rows}
    for _ in range(5):
        for name, fn in rows.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            rounds[name].append((time.perf_counter() - t) / calls * 1e6)
    return {name: statistics.median(r) for name, r in rounds.items()}


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def randn(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def close(a, b, what: str, atol: float = 2e-2) -> None:
    """The rows of a kind compute the same thing: checked once before timing (bf16 budget; NaN fails)."""
    a, b = (t.float() for t in (a if isinstance(a, (tuple, list)) else (a,))), (t.float() for t in (b if isinstance(b, (tuple, list)) else (b,)))
    for x, y in zip(a, b):
        if not torch.isfinite(x).all() or (x - y).abs().max().item() > atol * max(1.0, y.abs().max().item()):
            raise SystemExit(f"{what}: results differ from the peer's (max error {(x - y).abs().max().item():.3g})")


def flex_causal(n: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, n, n, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: flex(q, k, v, block_mask=mask)


def kind_forward(kern):
    q, k, v = (randn(1, 16, 512, 128) for _ in range(3))
    flex = flex_causal(512)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    rows = {"attngen": no_grad(lambda: kern(q, k, v)), "SDPA": no_grad(sdpa), "FlexAttention": no_grad(lambda: flex(q, k, v))}
    if kern.gluon is not None:
        g = kern.gluon
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
        grid, args = g.grid(512, 1, 16), g.launch_args(q, k, v, o, lse)
        rows["Gluon launcher alone"] = lambda: g.attention_forward(q, k, v)
        rows["one kernel launch"] = lambda: g._FORWARD(grid, *args)
    return rows, sdpa, (q, k, v)


def kind_train(kern):
    q, k, v = (randn(1, 16, 512, 128, grad=True) for _ in range(3))
    do = randn(1, 16, 512, 128)
    flex = flex_causal(512)

    def train(fn):
        return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do)
    sdpa = train(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    rows = {"attngen": train(kern), "SDPA": sdpa, "FlexAttention": train(flex),
            "autograd.Function doing no work": train(lambda q, k, v: Idle.apply(q, k, v)),
            "custom_op + register_autograd doing no work": train(idle_op())}
    return rows, sdpa, None


def kind_sink(_):
    sink = attngen.compile(ROOT / "specs" / "sink_window.attn")
    plain = attngen.compile("attention window_no_sink { head_dim = 64 dtype = bf16 mask = q_idx >= kv_idx and kv_idx > q_idx - 128 }")
    q, k, v = randn(1, 64, 512, 64, grad=True), randn(1, 8, 512, 64, grad=True), randn(1, 8, 512, 64, grad=True)
    sinks = torch.randn(64, device="cuda", requires_grad=True)
    do = randn(1, 64, 512, 64)
    pos = torch.arange(512, device="cuda")
    keep = (pos[:, None] >= pos[None]) & (pos[None] > pos[:, None] - 128)

    def eager():  # gpt-oss's eager attention: the sink as one more logit of each row, dropped after the softmax
        s = q.float() @ k.float().repeat_interleave(8, 1).transpose(-1, -2) / 8.0
        s = torch.cat([s.masked_fill(~keep, float("-inf")), sinks.view(1, 64, 1, 1).expand(1, 64, 512, 1)], -1)
        o = (torch.softmax(s, -1)[..., :-1] @ v.float().repeat_interleave(8, 1)).to(q.dtype)
        return torch.autograd.grad(o, (q, k, v, sinks), do)
    rows = {"attngen": lambda: torch.autograd.grad(sink(q, k, v, sinks=sinks), (q, k, v, sinks), do),
            "attngen, the same without the sink": lambda: torch.autograd.grad(plain(q, k, v), (q, k, v), do),
            "SDPA (causal, enable_gqa)": lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                                                    (q, k, v), do),
            "eager with the sink": eager}
    return rows, eager, 3e-2


def idle_op():
    """The floor of a torch.library.custom_op with an autograd formula (register_autograd): the same work as Idle."""
    @torch.library.custom_op("call_overhead::idle", mutates_args=())
    def idle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q)

    idle.register_fake(lambda q, k, v: torch.empty_like(q))
    torch.library.register_autograd("call_overhead::idle", lambda ctx, do: (torch.empty_like(do),) * 3)
    return idle


class Idle(torch.autograd.Function):
    """The floor of a Python autograd.Function: allocates its outputs and gradients, launches nothing."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        return torch.empty_like(do), torch.empty_like(do), torch.empty_like(do)


def kind_decode(kern):
    # the new query sees every cached key
    kern = attngen.compile("attention decode_overhead { head_dim = 128 dtype = bf16 mask = q_idx + kv_len - q_len >= kv_idx }")
    q, k, v = randn(1, 32, 1, 128), randn(1, 8, 4096, 128), randn(1, 8, 4096, 128)
    lens = torch.full((1,), 4096, device="cuda", dtype=torch.int32)
    call = no_grad(lambda: kern(q, k, v, kv_lens=lens))
    sdpa = no_grad(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    rows = {"attngen": call, "SDPA (enable_gqa)": sdpa, "attngen in a CUDA graph": graph_of(call)}
    split = decode_shape(kern.plan, 1, 32, 8, 1, 4096)  # the rows per program and split of the call above
    rows["decode launcher alone"] = lambda: kern.module.attention_decode(q, k, v, kv_lens=lens, block_r=split.block_r, num_splits=split.splits)
    return rows, sdpa, None


def graph_of(call):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def kind_paged(kern):
    q, k, v = randn(1, 32, 1, 128), randn(1, 8, 4096, 128), randn(1, 8, 4096, 128)
    pages = torch.randperm(256, device="cuda", dtype=torch.int32)
    k_cache, v_cache = (torch.empty(256, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for cache, t in ((k_cache, k), (v_cache, v)):  # token j of the sequence in page pages[j // 16], slot j % 16
        cache[pages.long()] = t[0].transpose(0, 1).reshape(256, 16, 8, 128)
    table, lens = pages[None], torch.full((1,), 4096, device="cuda", dtype=torch.int32)
    call = no_grad(lambda: kern(q, k_cache, v_cache, block_table=table, kv_lens=lens))
    sdpa = no_grad(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    return {"attngen": call, "SDPA (enable_gqa, contiguous)": sdpa, "attngen in a CUDA graph": graph_of(call)}, sdpa, None


def kind_packed(kern):
    q, k, v = (randn(512, 16, 128, grad=True) for _ in range(3))
    do = randn(512, 16, 128)
    cu = torch.arange(0, 513, 128, device="cuda", dtype=torch.int32)

    def packed():
        return torch.autograd.grad(kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=128, max_seqlen_k=128), (q, k, v), do)

    def sdpa():  # the same four sequences as a batch
        qb, kb, vb = (t.view(4, 128, 16, 128).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        return torch.autograd.grad(o.transpose(1, 2).reshape(512, 16, 128), (q, k, v), do)
    return {"attngen": packed, "SDPA (the sequences as a batch)": sdpa}, sdpa, None


def kind_fp8(kern):
    bf16 = kern
    f8 = attngen.compile("attention overhead_fp8 { head_dim = 128 dtype = fp8 mask = q_idx >= kv_idx }")
    q, k, v = (randn(1, 16, 512, 128) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t, "head") for t in (q, k, v))
    call = no_grad(lambda: f8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
    sdpa = no_grad(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    return {"attngen fp8": call, "SDPA (bf16)": sdpa, "attngen bf16": no_grad(lambda: bf16(q, k, v))}, sdpa, 8e-2


def kind_compiled(kern):
    import triton
    from torch.library import triton_op, wrap_triton
    plain = attngen.compile(CAUSAL, backend="triton")
    m, config = plain.module, plain.module.TILES["fwd"]

    @triton_op("attngen_call_overhead::causal_forward", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, n, _ = q.shape
        o = torch.empty_like(q)
        lse = torch.empty((batch, heads, n), device=q.device, dtype=torch.float32)
        grid = (triton.cdiv(n, config["BLOCK_M"]), batch * heads)
        wrap_triton(m._attn_fwd)[grid](q, k, v, o, lse, lse, lse, n, *q.stride(), *k.stride(), *v.stride(), *o.stride()[:3],
                                       heads, heads // k.shape[1], n, k.shape[2], VARLEN=False, **config)
        return o

    op = torch.ops.attngen_call_overhead.causal_forward
    q, k, v = (randn(1, 16, 512, 128, grad=True) for _ in range(3))
    do = randn(1, 16, 512, 128)
    fwd = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True)
    fwd_triton_op = torch.compile(lambda q, k, v: op(q, k, v), fullgraph=True)
    fwd_sdpa = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), fullgraph=True)
    sdpa = no_grad(lambda: fwd_sdpa(q, k, v))
    rows = {"attngen custom op": no_grad(lambda: fwd(q, k, v)), "triton_op (Triton kernel)": no_grad(lambda: fwd_triton_op(q, k, v)),
            "SDPA": sdpa,
            "attngen forward + backward": lambda: torch.autograd.grad(fwd(q, k, v), (q, k, v), do),
            "SDPA forward + backward": lambda: torch.autograd.grad(fwd_sdpa(q, k, v), (q, k, v), do)}
    return rows, sdpa, "first three"


def kind_generate(_):
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    import attngen.hf
    attngen.hf.register("attngen")
    cfg = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=4096)
    models = {impl: LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation=impl, torch_dtype=torch.bfloat16).cuda().eval()
              for impl in ("sdpa", "attngen")}
    models["attngen"].load_state_dict(models["sdpa"].state_dict())
    prompt = torch.randint(0, 1024, (1, 64), device="cuda")

    def generate(model):
        return no_grad(lambda: model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=GENERATED,
                                              min_new_tokens=GENERATED, do_sample=False, pad_token_id=0))
    return {"attngen (per token)": generate(models["attngen"]), "SDPA (per token)": generate(models["sdpa"])}, None, None


def profile(fn, calls: int = 500) -> str:
    """fn's functions by their own time over `calls` calls, us per call (the top 30)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    lines = [f"{'own us':>8} {'total us':>9} {'calls':>6}  function"]
    for (file, line, name), (_, ncalls, own, total, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]:
        where = f"{Path(file).name}:{line}" if line else file
        lines.append(f"{own / calls * 1e6:8.2f} {total / calls * 1e6:9.2f} {ncalls / calls:6.1f}  {name} ({where})")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("call_overhead.py times calls on a CUDA GPU")
    torch._dynamo.config.recompile_limit = torch._dynamo.config.cache_size_limit = 64
    torch.manual_seed(0)
    kern = attngen.compile(CAUSAL)
    paged = attngen.compile(ROOT / "specs" / "paged_decode.attn")
    makers = {"forward": kind_forward, "train": kind_train, "sink": kind_sink, "decode": kind_decode, "paged": lambda _: kind_paged(paged),
              "packed": kind_packed, "fp8": kind_fp8, "compiled": kind_compiled, "generate": kind_generate}
    results, profiles = {}, {}
    for kind in args.kinds:
        rows, peer, check = makers[kind](kern)
        first = list(rows)[:3] if check == "first three" else list(rows)[:1]
        if peer is not None:  # (generate: tests/test_hf.py checks the models' logits)
            want = peer()
            for name in first:
                close(rows[name](), want, f"{kind}: {name}", atol=check if isinstance(check, float) else 2e-2)
        if kind == "generate":
            results[kind] = {name: us / GENERATED for name, us in per_call_us(rows, max(1, args.calls // 200)).items()}
        else:
            results[kind] = per_call_us(rows, args.calls)
        if args.profile:
            profiles[kind] = profile(rows[first[0]], 10 if kind == "generate" else 500)
            print(f"\n== {kind}: {first[0]}, cProfile (own time first), us per call\n{profiles[kind]}", flush=True)
    head = (f"host time per call, us · {torch.cuda.get_device_name()} · torch {torch.__version__} · median of 5 interleaved "
            f"rounds of {args.calls} calls")
    if args.json:
        Path(args.json).write_text(json.dumps({"title": head, "results": results, "profiles": profiles}, indent=1))
    print(f"\n{head}")
    for kind, rows in results.items():
        print(f"{kind}:")
        for name, us in rows.items():
            print(f"  {name:<46} {us:8.1f}")


if __name__ == "__main__":
    main()
