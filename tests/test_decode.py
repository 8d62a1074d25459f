"""Decoding (attngen/plan/decode.py, templates/triton/decode.py.jinja): a few queries per sequence against a key/value
cache, contiguous with per-sequence lengths or paged through a block table. Every result is checked against the
float64 reference within attngen.verify's budget (twice the error of same-precision naive attention, plus a
floor), with NaN written into every part of the cache a sequence does not own; splits, pages and grouped-query
packing are checked against each other bit for bit where they compute the same tiles in the same order; bad
lengths and block tables are refused before any kernel runs."""
from pathlib import Path

import pytest
import torch

import attngen
from attngen.plan import decode
from attngen import kvcache
from attngen.tools import verify
from attngen.lang.check import load_spec
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.errors import InputError, SpecError
from attngen.tools.verify import _bound

ROOT = Path(__file__).parent.parent
HQ, HKV = 8, 2
# per-sequence key lengths: 0, 1, a decode tile (64 keys) - 1 and + 1, longer, the whole cache
LENS = [0, 1, 63, 65, 129, 200]
CAPACITY = 200


def _spec(body: str, dtype: str = "fp32", d: int = 64):
    return load_spec(f"attention t {{\n head_dim = {d}\n dtype = {dtype}\n{body}\n}}")


BOTTOM_RIGHT = "mask = q_idx + kv_len - q_len >= kv_idx"  # causal for new tokens at the end of each sequence
WINDOW_SOFTCAP = "mask = q_idx + kv_len - q_len >= kv_idx and q_idx + kv_len - q_len - kv_idx < 48\n score = 20.0 * tanh(score / 20.0)"


def _tensors(spec, device, lens, q_rows, hq=HQ, hkv=HKV, capacity=CAPACITY, seed=0):
    """q (B, hq, q_rows, D) and a contiguous cache k, v (B, hkv, capacity, D) holding NaN past each sequence's length."""
    gen = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[spec.dtype.value]
    q = torch.randn(len(lens), hq, q_rows, spec.head_dim, generator=gen)
    k, v = (torch.randn(len(lens), hkv, capacity, d, generator=gen) for d in (spec.head_dim, spec.dv))
    for b, n in enumerate(lens):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def _lens(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _check_reference(kern, out, lse, q, k, v, terms: float = 0.0, **serving):
    """out and the natural-log lse against the float64 reference (each sequence on its own with its lengths);
    terms: the magnitude of the terms summed into a score, for the error floor (verify._floor)."""
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    inputs = {name: t for name, t in serving.items() if name not in ("kv_lens", "q_lens", "block_table")}
    lengths = {name: t.cpu() for name, t in serving.items() if name in ("kv_lens", "q_lens", "block_table")}
    cpu = [t.detach().cpu() for t in (q, k, v)]
    inputs = {name: t.cpu() for name, t in inputs.items()}
    ref, ref_lse = attngen.reference(kern, *(t.double() for t in cpu), return_lse=True, dtype=torch.float64, **lengths, **inputs)
    naive = attngen.reference(kern, *(t.float() if dtype == torch.bfloat16 else t for t in cpu), dtype=torch.float32 if dtype == torch.bfloat16 else dtype,
                              **lengths, **inputs)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err, _, bound = _bound(out.cpu(), naive.to(out.dtype), ref, 2, terms)
    assert err <= bound, (err, bound)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    if finite.any():
        assert (lse.cpu().double()[finite] - ref_lse[finite]).abs().max() <= 1e-3 * max(1.0, ref_lse[finite].abs().max().item())


@pytest.mark.parametrize("body", [BOTTOM_RIGHT, WINDOW_SOFTCAP, ""], ids=["bottom_right", "window_softcap", "dense"])
def test_per_sequence_lengths_never_read_past_a_sequence(body, device):
    """kv_lens of 0, 1, 63, 65, 129, 200 over a cache of NaN past each length; q_lens cuts some query rows."""
    kern = attngen.compile(_spec(body), "h100")
    q, k, v = _tensors(kern.spec, device, LENS, 3)
    with torch.no_grad():
        out, lse = kern(q, k, v, kv_lens=_lens(LENS, device), return_lse=True)
        _check_reference(kern, out, lse, q, k, v, kv_lens=_lens(LENS, device))
        q_lens = _lens([3, 2, 0, 1, 3, 2], device)
        out, lse = kern(q, k, v, kv_lens=_lens(LENS, device), q_lens=q_lens, return_lse=True)
        _check_reference(kern, out, lse, q, k, v, kv_lens=_lens(LENS, device), q_lens=q_lens)
        assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()  # q_lens 0: every row 0, lse -inf
        assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()  # kv_lens 0: no key


def test_every_split_count_gives_the_unsplit_result(device):
    """The split of the keys changes only rounding: 1 to 7 runs against each other and the reference; a rerun is
    bit-identical (the runs are merged in a fixed order)."""
    kern = attngen.compile(_spec(WINDOW_SOFTCAP), "h100")
    assert kern.module.MAX_SPLITS == decode.MAX_SPLITS  # the most runs the combine kernel merges
    lens = [200, 131, 7]
    q, k, v = _tensors(kern.spec, device, lens, 2)
    kv_lens = _lens(lens, device)
    results = []
    for splits in range(1, 8):
        out, lse = kern.module.attention_decode(q, k, v, kv_lens=kv_lens, block_r=16, num_splits=splits)
        _check_reference(kern, out, lse * 0.6931471805599453, q, k, v, kv_lens=kv_lens)
        again = kern.module.attention_decode(q, k, v, kv_lens=kv_lens, block_r=16, num_splits=splits)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
        results.append(out)
    for other in results[1:]:
        assert (other - results[0]).abs().max() <= 1e-5


def test_the_last_split_to_arrive_merges_every_run(device):
    """Each split counts itself in its row block's counter and the last to arrive merges the partial results: 18
    runs of one key tile each and 40 runs (22 of them empty) against one run and the reference; reruns are
    bit-identical (the merge takes the runs in order, whichever arrived last) and leave the counters at zero."""
    from attngen.runtime.counters import stream_counters
    kern = attngen.compile(_spec(BOTTOM_RIGHT), "h100")
    assert kern.plan.decode_block_n == 64 and not hasattr(kern.module, "_decode_combine")  # one kernel: no combine launch
    lens = [1100, 300, 0]  # 1100 keys: 18 tiles of 64
    q, k, v = _tensors(kern.spec, device, lens, 1, capacity=1152)
    kv_lens = _lens(lens, device)
    one, _ = kern.module.attention_decode(q, k, v, kv_lens=kv_lens, block_r=16, num_splits=1)
    for splits in (18, 40):
        out, lse = kern.module.attention_decode(q, k, v, kv_lens=kv_lens, block_r=16, num_splits=splits)
        _check_reference(kern, out, lse * 0.6931471805599453, q, k, v, kv_lens=kv_lens)
        again = kern.module.attention_decode(q, k, v, kv_lens=kv_lens, block_r=16, num_splits=splits)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
        assert (out.float() - one.float()).abs().max() <= 1e-5
        assert not stream_counters("decode", q.device, 1).any()


def test_a_serving_call_like_one_made_before_replays_and_still_checks_its_lengths(device):
    """A serving call of a signature that passed its checks is kept (Kernel._serving_calls) and replayed: exact
    again with other lengths in the same tensor, while the lengths' values are still checked whenever they
    change (an in-place update to past the cache is refused); a call of another signature is checked afresh."""
    kern = attngen.compile(_spec(BOTTOM_RIGHT), "h100")
    q, k, v = _tensors(kern.spec, device, LENS, 1)
    lens = _lens(LENS, device)
    with torch.no_grad():
        out, lse = kern(q, k, v, kv_lens=lens, return_lse=True)
        _check_reference(kern, out, lse, q, k, v, kv_lens=lens)
        assert len(kern._serving_calls) == 1
        lens.copy_(_lens(LENS[::-1], device))  # other lengths, same tensor: replayed, its values checked again
        q2, k2, v2 = _tensors(kern.spec, device, LENS[::-1], 1, seed=1)
        out, lse = kern(q2, k2, v2, kv_lens=lens, return_lse=True)
        _check_reference(kern, out, lse, q2, k2, v2, kv_lens=lens)
        assert len(kern._serving_calls) == 1
        # without return_lse the replay writes the lse to the stream's scratch memory: O the same, the next lse right
        assert torch.equal(kern(q2, k2, v2, kv_lens=lens), out) and torch.equal(kern(q2, k2, v2, kv_lens=lens), out)
        assert torch.equal(kern(q2, k2, v2, kv_lens=lens, return_lse=True)[1], lse)
        lens[0] = CAPACITY + 1
        with pytest.raises(InputError, match=f"kv_lens of sequence 0 is {CAPACITY + 1}"):
            kern(q2, k2, v2, kv_lens=lens)
        with pytest.raises(InputError, match="kv_lens must be a 1-D int32 tensor"):
            kern(q2, k2, v2, kv_lens=lens.long())


@pytest.mark.parametrize("hkv, q_rows", [(8, 1), (2, 1), (1, 3), (1, 16)], ids=["mha", "gqa", "mqa", "mqa_16_tokens"])
def test_query_heads_share_their_key_value_heads_tile(hkv, q_rows, device):
    """The query heads of a key/value head are rows of one tile: 8 query heads over 8, 2 and 1 key/value heads;
    MQA with 16 new tokens makes 128 rows, two row blocks of 64."""
    kern = attngen.compile(_spec(BOTTOM_RIGHT), "h100")
    lens = [200, 65]
    q, k, v = _tensors(kern.spec, device, lens, q_rows, hkv=hkv)
    shape = decode.decode_shape(kern.plan, 2, HQ, hkv, q_rows, CAPACITY)
    assert shape.rows_per_kv_head == HQ // hkv * q_rows and shape.row_blocks == -(-shape.rows_per_kv_head // shape.block_r)
    with torch.no_grad():
        out, lse = kern(q, k, v, kv_lens=_lens(lens, device), return_lse=True)
    _check_reference(kern, out, lse, q, k, v, kv_lens=_lens(lens, device))


def _paged(k, v, lens, page_size, device, shared_prefix: bool, seed=0):
    """The contiguous caches k, v (B, Hkv, capacity, D) as pages of size page_size in a shuffled order, with spare
    pages of NaN, and the block table; with shared_prefix, sequences 0 and 1 hold the same first page (sequence 1
    reads sequence 0's). Table entries past a sequence's pages hold -1."""
    B, hkv, capacity, d = k.shape
    per_seq = -(-capacity // page_size)
    num_pages = B * per_seq + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = order[:B * per_seq].view(B, per_seq).to(torch.int32)
    if shared_prefix:
        table[1, 0] = table[0, 0]
        k, v = k.clone(), v.clone()
        k[1, :, :page_size], v[1, :, :page_size] = k[0, :, :page_size], v[0, :, :page_size]
    k_cache, v_cache = (torch.full((num_pages, page_size, hkv, x.shape[3]), float("nan"), dtype=k.dtype, device=device) for x in (k, v))
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    for b, n in enumerate(lens):
        if n and not (shared_prefix and b == 1):
            kvcache.append(k_cache, v_cache, k[b:b + 1, :, :n], v[b:b + 1, :, :n], zero, table[b:b + 1].to(device))
        elif n:  # the shared first page is written once, by sequence 0; the rest of sequence 1's keys here
            start = min(n, page_size)
            if n > start:
                kvcache.append(k_cache, v_cache, k[b:b + 1, :, start:n], v[b:b + 1, :, start:n], _lens([start], device), table[b:b + 1].to(device))
    used = [-(-n // page_size) for n in lens]
    for b, u in enumerate(used):
        table[b, u:] = -1
    return k_cache, v_cache, table.to(device), k, v


@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_paged_cache_through_shuffled_and_shared_pages(page_size, device):
    """Pages in a shuffled order, a page shared by two sequences, spare pages of NaN and -1 past each sequence's
    pages in the table: the same bits as the contiguous cache the pages hold (the same tiles in the same order),
    and the reference. Page sizes below, at and above the decode kernel's 64-key tile."""
    spec = _spec(f"{WINDOW_SOFTCAP}\n kv_layout = paged\n page_size = {page_size}")
    kern = attngen.compile(spec, "h100")
    flat = attngen.compile(_spec(WINDOW_SOFTCAP), "h100")
    lens = [200, 77, 1, 0]
    capacity = -(-CAPACITY // page_size) * page_size
    q, k, v = _tensors(spec, device, lens, 2, capacity=capacity)
    k_cache, v_cache, table, k, v = _paged(k, v, lens, page_size, device, shared_prefix=True)
    kv_lens = _lens(lens, device)
    shape = decode.decode_shape(kern.plan, len(lens), HQ, HKV, 2, capacity)
    with torch.no_grad():
        out, lse = kern(q, k_cache, v_cache, block_table=table, kv_lens=kv_lens, return_lse=True)
        # the contiguous kernel with the paged one's tiles and split
        want, want_lse = flat.module.attention_decode(q, k, v, kv_lens=kv_lens, block_r=shape.block_r, num_splits=shape.splits,
                                                      tiles={"decode": kern.plan.tiles()["decode"]})
    assert torch.equal(out, want) and torch.equal(lse, want_lse * 0.6931471805599453)
    _check_reference(kern, out, lse, q, k_cache, v_cache, kv_lens=kv_lens, block_table=table)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_one_kernel_serves_caches_of_every_capacity(layout, device):
    """Calls with caches of other capacities (table widths) reuse the compiled kernel (on the GPU through
    attngen.launch's kept kernels) and each reads all of its keys: the capacity is an argument, not compiled in."""
    body = WINDOW_SOFTCAP.replace("48", "100000") + ("\n kv_layout = paged\n page_size = 16" if layout == "paged" else "")
    kern = attngen.compile(_spec(body), "h100")
    for capacity in (128, 256, 64):
        lens = [capacity, capacity // 2 + 1]
        q, k, v = _tensors(kern.spec, device, lens, 1, capacity=capacity, seed=capacity)
        serving = {"kv_lens": _lens(lens, device)}
        if layout == "paged":
            k, v, serving["block_table"], _, _ = _paged(k, v, lens, 16, device, shared_prefix=False)
        with torch.no_grad():
            out, lse = kern(q, k, v, return_lse=True, **serving)
        _check_reference(kern, out, lse, q, k, v, **serving)


def test_plain_calls_with_few_queries_take_the_decode_kernels(device):
    """Under no_grad, a call with <= 16 queries and >= 1024 keys (one query: >= 256) runs the decode kernels (the
    same bits as the call with full kv_lens); with a gradient to compute, the training forward."""
    kern = attngen.compile(_spec(BOTTOM_RIGHT), "h100")
    q, k, v = _tensors(kern.spec, device, [1030, 1030], 4, capacity=1030)
    assert decode.takes_plain_call(4, 1024) and not decode.takes_plain_call(17, 4096) and not decode.takes_plain_call(4, 1023)
    assert decode.takes_plain_call(1, 256) and not decode.takes_plain_call(1, 255)
    with torch.no_grad():
        plain = kern(q, k, v)
        full = kern(q, k, v, kv_lens=_lens([1030, 1030], device))
    assert torch.equal(plain, full)
    trained = kern(q.requires_grad_(), k, v)
    assert torch.allclose(trained.detach(), plain, atol=1e-5)


# runtime block masks are not read by the decode kernels, nor is a sink yet (tests/test_sink.py: refused)
SHIPPED = sorted(p.stem for p in (ROOT / "specs").glob("*.attn") if p.stem not in ("block_sparse_runtime", "sink_window"))
QUICK = ("causal_bottom_right", "key_padding", "alibi", "paged_decode")


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in SHIPPED])
def test_every_shipped_spec_decodes_over_a_cache(name, target, device):
    """Every shipped spec's mask and score (declared inputs too) over a cache with per-sequence lengths (a paged
    spec through a block table), against the reference (dropout specs with dropout_p=0.0, as at inference)."""
    kern = attngen.compile(ROOT / "specs" / f"{name}.attn", target)
    spec = kern.spec
    lens = [CAPACITY, 65, 1]
    gen = torch.Generator().manual_seed(3)
    q, k, v = _tensors(spec, device, lens, 2, hq=4, capacity=CAPACITY if spec.kv_layout.value == "contiguous" else 256)
    inputs = verify.make_inputs(spec, len(lens), 4, 2, k.shape[2], device, gen)
    serving = {"kv_lens": _lens(lens, device)}
    if spec.kv_layout.value == "paged":
        k, v, serving["block_table"], _, _ = _paged(k, v, lens, spec.page_size, device, shared_prefix=False)
    extra = {"dropout_p": 0.0} if spec.dropout else {}
    with torch.no_grad():
        out, lse = kern(q, k, v, return_lse=True, **serving, **inputs, **extra)
    _check_reference(kern, out, lse, q, k, v, **serving, **inputs)


def test_a_block_pattern_decodes_with_its_pattern(target, device):
    """A block pattern whose training kernels walk lists of its kept blocks (KernelPlan.block_lists): the decode
    kernels, which walk none, still apply it, in every tile (blocks of 16, a pattern that differs by head, causal
    for the new tokens), against the reference."""
    spec = _spec(f"{BOTTOM_RIGHT}\n sparsity = ((q_blk ^ kv_blk) & ((q_blk ^ kv_blk) - 1)) == 0 or (h == 1 and kv_blk == 0)\n"
                 f" sparse_block = 16")
    kern = attngen.compile(spec, target)
    assert kern.plan.block_lists
    lens = [CAPACITY, 129, 65]
    q, k, v = _tensors(spec, device, lens, 3, hq=4)
    with torch.no_grad():
        out, lse = kern(q, k, v, return_lse=True, kv_lens=_lens(lens, device))
    _check_reference(kern, out, lse, q, k, v, kv_lens=_lens(lens, device))


def test_a_decode_step_appends_then_attends(device):
    """kvcache.append writes each sequence's new keys at its own position (contiguous and paged caches), returns
    the new lengths, and the next call sees them."""
    spec = _spec(f"{BOTTOM_RIGHT}\n kv_layout = paged\n page_size = 16")
    kern = attngen.compile(spec, "h100")
    gen = torch.Generator().manual_seed(5)
    B, d = 3, 64
    table = torch.arange(B * 8, dtype=torch.int32).view(B, 8).flip(1).contiguous().to(device)  # pages in reverse order
    k_cache = torch.zeros(B * 8, 16, HKV, d, device=device)
    v_cache = torch.zeros_like(k_cache)
    flat_k = torch.zeros(B, HKV, 128, d, device=device)
    flat_v = torch.zeros_like(flat_k)
    lens = _lens([5, 0, 17], device)
    flat_lens = lens.clone()
    history_k = [[] for _ in range(B)]
    for step, tokens in enumerate((1, 3, 1)):
        k_new, v_new = (torch.randn(B, HKV, tokens, d, generator=gen).to(device) for _ in range(2))
        new_lens = kvcache.append(k_cache, v_cache, k_new, v_new, lens, table)
        assert torch.equal(new_lens, lens + tokens)
        flat_lens = kvcache.append(flat_k, flat_v, k_new, v_new, flat_lens)
        for b in range(B):
            history_k[b].append(k_new[b])
        lens = new_lens
        q = torch.randn(B, HQ, tokens, d, generator=gen).to(device)
        with torch.no_grad():
            out = kern(q, k_cache, v_cache, block_table=table, kv_lens=lens)
            flat = attngen.compile(_spec(BOTTOM_RIGHT), "h100")(q, flat_k, flat_v, kv_lens=flat_lens)
        assert torch.allclose(out, flat, atol=1e-6), step
    for b, start in enumerate((5, 0, 17)):  # what append wrote, read back through the table
        got = kvcache.gather(k_cache, table, 128)[b, :, start:int(lens[b])]
        assert torch.equal(got, torch.cat(history_k[b], dim=1))
    with pytest.raises(InputError, match="kv_lens \\+ the new tokens of sequence 2 is 129; the cache holds 0..128 keys per sequence"):
        kvcache.append(k_cache, v_cache, *(torch.zeros(B, HKV, 107, d, device=device) for _ in range(2)), lens, table)


def _bad_paged_call(device, **changes):
    spec = _spec(f"{BOTTOM_RIGHT}\n kv_layout = paged\n page_size = 16")
    kern = attngen.compile(spec, "h100")
    args = {"q": torch.zeros(2, HQ, 1, 64, device=device), "k": torch.zeros(6, 16, HKV, 64, device=device),
            "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device), "kv_lens": _lens([20, 32], device)}
    args["v"] = args["k"].clone()
    args.update(changes)

    def no_kernel(*a, **kw):
        raise AssertionError("a kernel ran before the call was checked")
    kern.module.attention_decode = no_kernel
    with torch.no_grad():
        return kern(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("changes, message", [
    ({"block_table": torch.tensor([[0, 1], [2, 6]], dtype=torch.int32)}, r"block_table\[1, 1\] = 6 is not a page of the cache \(0..5\); sequence 1 uses its first 2"),
    ({"block_table": torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)}, r"block_table\[0, 1\] = -1 is not a page"),
    ({"block_table": torch.tensor([[0, 1], [2, 3]])}, "block_table must be a 2-D int32 tensor .* got torch.int64"),
    ({"block_table": torch.tensor([[0, 1]], dtype=torch.int32)}, "block_table has 1 rows; the batch has 2 sequences"),
    ({"block_table": None}, "has kv_layout = paged: pass the caches as k and v"),
    ({"kv_lens": _lens([20, 33], "cpu")}, "kv_lens of sequence 1 is 33; the cache holds 0..32 keys per sequence"),
    ({"kv_lens": _lens([-1, 3], "cpu")}, "kv_lens of sequence 0 is -1"),
    ({"kv_lens": torch.tensor([20, 32])}, "kv_lens must be a 1-D int32 tensor of one length per sequence, got torch.int64"),
    ({"kv_lens": _lens([20], "cpu")}, "kv_lens has 1 entries; the batch has 2 sequences"),
    ({"kv_lens": _lens([20, 0, 32, 0], "cpu")[::2]}, r"kv_lens's entries must be contiguous \(stride 1\), got stride 2"),
    ({"q_lens": _lens([1, 2], "cpu")}, "q_lens of sequence 1 is 2; q holds 0..1 queries per sequence"),
    ({"k": torch.zeros(6, 8, HKV, 64)}, r"k has pages of 8 tokens \(dimension 1\); the spec says page_size = 16"),
    ({"k": torch.zeros(6, 16, 3, 64)}, r"k and v must have the same batch, heads and tokens"),
    ({"cu_seqlens_q": _lens([0, 1, 2], "cpu"), "cu_seqlens_k": _lens([0, 1, 2], "cpu")}, "do not go with packed sequences"),
])
def test_bad_lengths_and_block_tables_are_refused_before_any_kernel(changes, message, device):
    changes = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in changes.items()}
    with pytest.raises(InputError, match=message):
        _bad_paged_call(device, **changes)


def test_what_decoding_does_not_do_is_refused(device):
    kern = attngen.compile(_spec(BOTTOM_RIGHT), "h100")
    q, k, v = _tensors(kern.spec, device, [10, 10], 1, capacity=16)
    with pytest.raises(InputError, match="their decode kernels have no backward; call under torch.no_grad"):
        kern(q.requires_grad_(), k, v, kv_lens=_lens([3, 4], device))
    with pytest.raises(InputError, match="block_table given, but the spec 't' has kv_layout = contiguous"):
        kern(q, k, v, kv_lens=_lens([3, 4], device), block_table=torch.zeros(2, 1, dtype=torch.int32, device=device))
    drop = attngen.compile(_spec(f"{BOTTOM_RIGHT}\n dropout = 0.1"), "h100")
    with pytest.raises(InputError, match="for inference, without dropout: pass dropout_p=0.0"):
        with torch.no_grad():
            drop(q.detach(), k, v, kv_lens=_lens([3, 4], device))


def test_paged_layout_in_the_spec_language():
    spec = _spec("kv_layout = paged\n page_size = 64")
    assert spec.kv_layout.value == "paged" and spec.page_size == 64
    assert "kv_layout = paged" in attngen.lang.canonical.format_spec(spec) and "page_size = 64" in attngen.lang.canonical.format_spec(spec)
    assert "kv_layout" not in attngen.lang.canonical.format_spec(_spec(""))  # the hashes of contiguous specs stay what they were
    with pytest.raises(SpecError, match="page_size goes with kv_layout = paged"):
        _spec("page_size = 32")
    with pytest.raises(SpecError, match="page_size = 24 must be a power of two"):
        _spec("kv_layout = paged\n page_size = 24")
    with pytest.raises(SpecError, match="dropout cannot go with kv_layout = paged"):
        _spec("kv_layout = paged\n dropout = 0.1")
    with pytest.raises(SpecError, match="kv_layout must be one of: contiguous, paged; got 'pages'"):
        _spec("kv_layout = pages")


def test_the_split_fills_the_gpu_from_the_shapes_alone():
    """The split depends on the batch, heads and cache capacity, never on the lengths' values (CUDA graphs): few
    (sequence, head) pairs on a long cache are split to fill the SMs; many pairs are not split; each run keeps
    at least MIN_KEYS_PER_SPLIT keys."""
    p = attngen.plan.planner.plan(_spec("", "bf16", 128), "h100")
    sms = p.target.sm_count
    one = decode.decode_shape(p, 1, 32, 8, 1, 131072)
    assert one.splits > 1 and one.programs >= 0.9 * decode.PROGRAMS_PER_SM * sms
    assert decode.decode_shape(p, 64, 32, 8, 1, 131072).splits == 1
    short = decode.decode_shape(p, 1, 32, 8, 1, 512)
    assert short.splits * decode.MIN_KEYS_PER_SPLIT <= 512
    for batch in (1, 2, 3, 8, 16):
        for keys in (256, 4096, 65536):
            s = decode.decode_shape(p, batch, 32, 8, 1, keys)
            assert 1 <= s.splits <= decode.MAX_SPLITS and s.programs == batch * 8 * s.row_blocks * s.splits
    assert decode.block_rows(1) == 16 and decode.block_rows(33) == 64 and decode.block_rows(500) == 64


def test_the_split_divides_the_key_tiles_evenly_over_the_sms():
    """The busiest program reads no more key tiles than all of them spread over the SMs, rounded up: one sequence,
    8 key/value heads on the H100's 132 SMs, 8192 keys in 64-key tiles (1024 tiles: 8 a program, 16 runs; 15 runs
    read 9), 32768 keys (32 a program), a paged cache's 4096 keys in 128-key tiles (256 tiles: 2 a program, runs of
    256 keys)."""
    for spec, keys, tiles_per_program in ((_spec("", "bf16", 128), 8192, 8), (_spec("", "bf16", 128), 32768, 32),
                                          (_spec("kv_layout = paged", "bf16", 128), 4096, 2)):
        p = attngen.plan.planner.plan(spec, "h100")
        s = decode.decode_shape(p, 1, 32, 8, 1, keys)
        assert p.target.sm_count == 132 and s.programs <= 132
        assert -(-keys // p.decode_block_n // s.splits) == tiles_per_program, (keys, s)


def test_a_decode_step_is_captured_in_a_cuda_graph(device):
    """append + attend captured once, replayed with other values in the same tensors (lengths, new keys, queries):
    no host synchronization and no allocation by value in the decode path."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    spec = _spec(f"{BOTTOM_RIGHT}\n kv_layout = paged\n page_size = 16", dtype="bf16", d=128)
    kern = attngen.compile(spec)
    B, pages = 4, 64
    table = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
    k_cache = torch.randn(B * pages, 16, HKV, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lens = _lens([100, 7, 900, 513], "cuda")
    q = torch.randn(B, HQ, 1, 128, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(B, HKV, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def step():
        new = kvcache.append(k_cache, v_cache, k_new, v_new, lens, table)
        lens.copy_(new)
        return kern(q, k_cache, v_cache, block_table=table, kv_lens=lens)

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()  # warm-up: compiles, checks once
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for values in ([5, 300, 1, 1000], [0, 64, 65, 2]):
            lens.copy_(_lens(values, "cuda"))
            q.normal_()
            k_new.normal_()
            before = lens.clone()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(lens, before + 1)
            want, want_lse = kern(q, k_cache, v_cache, block_table=table, kv_lens=lens, return_lse=True)
            assert torch.equal(out, want)
            _check_reference(kern, want, want_lse, q, k_cache, v_cache, kv_lens=lens, block_table=table)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("q_rows", [1, 16], ids=["one_token", "16_tokens"])
def test_serving_sizes_on_the_gpu(dtype, layout, q_rows, device):
    """A serving model's shapes in its element type: head_dim 128, 32 query heads over 8 key/value heads, sequences
    of 8192, 3000 and 1 cached keys (NaN past each), one new token or 16 (speculative decoding), a contiguous cache
    or 16-token pages in a shuffled order; the plan's split and tiles, against the float64 reference."""
    if device != "cuda":
        pytest.skip("serving sizes in bf16/fp16 run on the GPU (their CPU twins: the fp32 tests above)")
    extra = "\n kv_layout = paged\n page_size = 16" if layout == "paged" else ""
    spec = _spec(BOTTOM_RIGHT + extra, dtype=dtype, d=128)
    kern = attngen.compile(spec)
    lens = [8192, 3000, 1]
    q, k, v = _tensors(spec, device, lens, q_rows, hq=32, hkv=8, capacity=8192)
    serving = {"kv_lens": _lens(lens, device)}
    if layout == "paged":
        k, v, serving["block_table"], _, _ = _paged(k, v, lens, 16, device, shared_prefix=False)
    assert decode.decode_shape(kern.plan, len(lens), 32, 8, q_rows, 8192).splits > 1  # the keys split across programs
    with torch.no_grad():
        out, lse = kern(q, k, v, return_lse=True, **serving)
    _check_reference(kern, out, lse, q, k, v, **serving)


# DeepSeek's latent attention decoding in its absorbed form (specs/mla_decode.attn): one paged cache of 576 columns
# a token, V its first 512 (a view of the cache); the decode kernels read K in two parts then, the 512 (V's) and 64
LATENT = (ROOT / "specs" / "mla_decode.attn").read_text()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_latent_attention_reads_v_as_a_view_of_k(dtype, device):
    """V passed as cache[..., :512] gives the bits of V passed as a copy of those columns (which the kernel then
    reads on its own), split or not, over shuffled pages with NaN in every slot no sequence owns; against the
    float64 reference. A view of other columns is a V of its own, read as such."""
    kern = attngen.compile(LATENT.replace("dtype     = bf16", f"dtype = {dtype}"), "h100")
    assert kern.plan.decode_tail == 64 and kern.plan.decode_tail_pad == 64
    lens = [200, 77, 1, 0]
    q, k, _ = _tensors(kern.spec, device, lens, 1, hq=16, hkv=1, capacity=256)
    cache, _, table, _, _ = _paged(k, k[..., :512], lens, 64, device, shared_prefix=False)
    kv_lens = _lens(lens, device)
    with torch.no_grad():
        out, lse = kern(q, cache, cache[..., :512], block_table=table, kv_lens=kv_lens, return_lse=True)
        copy = kern(q, cache, cache[..., :512].clone(), block_table=table, kv_lens=kv_lens, return_lse=True)
        assert torch.equal(out, copy[0]) and torch.equal(lse, copy[1])
        for splits in (1, 3) if device == "cuda" or dtype == "fp32" else ():  # (the interpreter has no bf16 arithmetic)
            split = kern.module.attention_decode(q, cache, cache[..., :512], block_table=table, kv_lens=kv_lens, block_r=16, num_splits=splits)
            assert (split[0].float() - out.float()).abs().max() <= (0.0 if dtype == "fp32" and splits == 1 else 2e-2)
        other = cache[..., 64:]
        shifted, shifted_lse = kern(q, cache, other, block_table=table, kv_lens=kv_lens, return_lse=True)
        assert torch.equal(shifted, kern(q, cache, other.clone(), block_table=table, kv_lens=kv_lens))
    # the floor scales with the 576 products summed into each score (the GPU sums them in another order than the CPU)
    terms = kern.spec.softmax_scale * (q.abs().double().reshape(-1, 576) @ cache.nan_to_num().abs().double().reshape(-1, 576).T).max().item()
    _check_reference(kern, out, lse, q, cache, cache[..., :512], terms, kv_lens=kv_lens, block_table=table)
    _check_reference(kern, shifted, shifted_lse, q, cache, other, terms, kv_lens=kv_lens, block_table=table)


@pytest.mark.parametrize("body, message", [
    ("head_dim = 576\n value_dim = 512", r"head_dim = 576 is out of range; expected 16..256 \(up to 576 with kv_layout = paged"),
    ("head_dim = 576\n value_dim = 256\n kv_layout = paged", "needs a value_dim that is a power of two below it, with at most 256 columns left"),
    ("head_dim = 576\n value_dim = 320\n kv_layout = paged", "needs a value_dim that is a power of two below it"),
    ("head_dim = 576\n kv_layout = paged", "needs a value_dim that is a power of two below it"),
    ("head_dim = 640\n value_dim = 512\n kv_layout = paged", r"head_dim = 640 is out of range; expected 16..576"),
    ("head_dim = 128\n value_dim = 512", r"value_dim = 512 is out of range; expected 16..256 \(up to 512 with kv_layout = paged"),
])
def test_wide_heads_are_for_the_decode_kernels(body, message):
    """Heads above 256 columns go with a paged cache (the decode kernels), K in two parts: a SpecError at the
    setting otherwise."""
    with pytest.raises(SpecError, match=message):
        load_spec(f"attention t {{\n {body}\n}}")
