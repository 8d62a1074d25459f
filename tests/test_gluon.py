"""The Gluon generator (sm_90): which specs it takes and why not, its plan, its name translation, that every
spec it takes renders to readable source and compiles to an sm_90 binary on this CPU machine, and, on a GPU
(--device cuda), that its forward matches the float64 reference through attngen.verify with `attngen check`'s
error budget. Gluon does not run in Triton's interpreter: on the CPU a kernel with a Gluon forward runs the
Triton generator's forward, which the rest of the suite checks."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attngen
from attngen import verify
from attngen.check import load_spec
from attngen.cli import main
from attngen.codegen.gluon import choose, plan_gluon, render, unsupported
from attngen.codegen.gluon.lower import Untranslatable, translate
from attngen.errors import PlanError
from attngen.plan import plan
from attngen.spec import Backend, DType

ROOT = Path(__file__).parent.parent
SPECS = {p.stem: p for p in sorted((ROOT / "specs").glob("*.attn"))}
# What the generator takes of the shipped specs, and why not the others (each reason, as plan.py words it)
NOT_TAKEN = {
    "alibi": "declared inputs", "block_sparse_runtime": "runtime block sparsity", "causal_dropout": "dropout",
    "causal_fa1": "loop_order = kv_outer", "dilated": "head_dim 32", "document": "declared inputs", "key_padding": "declared inputs",
    "odd_head_dim": "dtype fp32", "prefix_lm": "declared inputs", "relative_bias": "declared inputs",
}
TAKEN = sorted(set(SPECS) - set(NOT_TAKEN))


def _spec(name, **changes):
    return dataclasses.replace(load_spec(SPECS[name].read_text()), **changes)


def test_what_the_generator_takes_and_why_not():
    assert TAKEN == ["butterfly_blocks", "causal", "causal_bottom_right", "causal_softcap", "dense", "local_global_blocks",
                     "local_window", "sliding_window", "strided_blocks"]
    for name in SPECS:
        spec = _spec(name)
        why = unsupported(spec, plan(spec, "h100"))
        if name in NOT_TAKEN:
            assert any(NOT_TAKEN[name] in w for w in why), (name, why)
        else:
            assert why == [], (name, why)


def test_auto_takes_gluon_where_it_was_measured_faster():
    """auto: Gluon on sm_90 at d=128 without a score modification; Triton elsewhere, with the reason."""
    assert choose(_spec("causal"), plan(_spec("causal"), "h100")).generator == "gluon"
    assert choose(_spec("dense"), plan(_spec("dense"), "h100")).generator == "gluon"
    for spec, why in ((_spec("causal", head_dim=64), "head_dim 64: 0.90-0.93x"), (_spec("causal_softcap"), "a score modification")):
        c = choose(spec, plan(spec, "h100"))
        assert c.generator == "triton" and why in c.reason and c.gluon is None
        assert choose(spec, plan(spec, "h100"), Backend.GLUON).generator == "gluon"  # asked for: taken
    a100 = choose(_spec("causal"), plan(_spec("causal"), "a100"))
    assert a100.generator == "triton" and "the target is sm_80" in a100.reason
    assert choose(_spec("causal"), plan(_spec("causal"), "h100"), Backend.TRITON).generator == "triton"


def test_backend_gluon_for_what_it_cannot_render_is_a_plan_error():
    spec = load_spec("attention t { head_dim = 64 dtype = bf16 dropout = 0.1 backend = gluon }")
    assert spec.backend is Backend.GLUON
    with pytest.raises(PlanError, match="backend = gluon, but the Gluon generator cannot render it: dropout"):
        attngen.compile(spec, "h100")
    with pytest.raises(attngen.InputError, match="backend must be one of auto, triton, gluon; got 'cuda'"):
        attngen.compile("specs/causal.attn", "h100", backend="cuda")
    with pytest.raises(attngen.SpecError, match="backend must be one of: auto, triton, gluon"):
        load_spec("attention t { head_dim = 64 backend = cute }")


def test_plan_sizes_the_ring_from_shared_memory():
    for d, stages in ((128, 3), (64, 4)):
        gp = plan_gluon(plan(_spec("causal", head_dim=d), "h100"))
        smem = plan(_spec("causal"), "h100").target.smem_per_block
        q_bytes, stage_bytes = 2 * 64 * d * 2, 2 * 128 * d * 2
        assert gp.stages == stages == min(4, (smem - 1024 - q_bytes) // stage_bytes)
        assert (gp.block_m, gp.block_n, gp.consumers, gp.load_regs, gp.consumer_regs) == (128, 128, 2, 24, 240)
        # the register budget: 2 consumer warpgroups at 240 and the load warpgroup at 24 fit the 65536 of an SM
        assert 128 * (2 * gp.consumer_regs + gp.load_regs) <= 65536


def test_names_are_translated_from_a_closed_table():
    assert translate("tl.where(a < b, tl.minimum(a, b), tl.math.div_rn(a, 2.0))") == "gl.where(a < b, gl.minimum(a, b), gl.div_rn(a, 2.0))"
    assert translate("x.to(tl.float32)") == "x.to(gl.float32)"
    for code in ("tl.load(p + i)", "tl.sigmoid(x)", "tl.math.tanh(x)", "triton.language.exp(x)"):
        with pytest.raises(Untranslatable):
            translate(code)
    # a spec whose score needs a function Gluon lacks is not rendered: sigmoid is refused by the translation, so
    # the spec stays with the Triton generator (auto) or is a PlanError (backend = gluon)
    spec = load_spec("attention t { head_dim = 128 score = score * sigmoid(score) }")
    with pytest.raises(Untranslatable, match="tl.sigmoid"):
        render(plan_gluon(plan(spec, "h100")))
    with pytest.raises(PlanError, match="backend = gluon, but the Gluon generator cannot render it: tl.sigmoid has no Gluon counterpart"):
        choose(spec, plan(spec, "h100"), Backend.GLUON)
    masked = load_spec("attention t { head_dim = 128 mask = sigmoid(q_idx - kv_idx + 0.0) > 0.3 }")
    c = choose(masked, plan(masked, "h100"))
    assert c.generator == "triton" and "tl.sigmoid has no Gluon counterpart" in c.reason
    assert attngen.compile(masked, "h100").gluon is None


def test_plan_command_says_which_generator_and_why(capsys):
    assert main(["plan", str(SPECS["causal"]), "--target", "h100"]) == 0
    out = capsys.readouterr().out
    assert "generator: gluon forward, triton backward" in out and "ring stages" in out and "consumers get" in out
    assert main(["plan", str(SPECS["document"]), "--target", "h100"]) == 0
    assert "generator: triton forward (the Gluon generator does not take it: declared inputs" in capsys.readouterr().out


@pytest.mark.parametrize("name", TAKEN)
def test_rendered_source_is_readable_and_carries_only_ir_code(name):
    spec = _spec(name)
    src = render(plan_gluon(plan(spec, "h100")))
    compile(src, name, "exec")  # valid Python
    assert "Generated by attngen" in src and "Glossary" in src and "The schedule" in src and spec.name in src
    assert "tl.load" not in src and not re.search(r"\btl\.(?!PropagateNan)", src)  # every Triton name was translated
    for fn in ("_load_partition", "_consumer", "_softmax_step", "_attn_fwd", "attention_forward"):
        assert f"def {fn}(" in src


@pytest.mark.slow  # triton.compile for sm_90 in subprocesses: about 40 s on 2 cores
def test_every_taken_spec_compiles_for_sm90(tmp_path):
    """A Gluon kernel that does not compile would only fail on the GPU: compile each spec's forward for sm_90 here
    (bf16 and fp16; in a process of its own, without the interpreter) and check the schedule made it into the PTX:
    the register budgets (setmaxnreg 24 and 240), the wgmma products, the TMA copies; and the shared memory fits."""
    from attngen.codegen.gluon import build_source

    smem = plan(_spec("causal"), "h100").target.smem_per_block
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for name in TAKEN:
        path = tmp_path / f"{name}_gluon.py"
        path.write_text(build_source(plan_gluon(plan(_spec(name), "h100")))[1])
        run = subprocess.run([sys.executable, "-m", "attngen.codegen.gluon.binaries", str(path), "bf16", "fp16"], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{name}: {run.stderr[-3000:]}"
        lines = [json.loads(line) for line in run.stdout.splitlines()]
        assert [r["dtype"] for r in lines] == ["bf16", "fp16"]
        for r in lines:
            assert {"24", "240"} <= set(r["setmaxnreg"]) and r["wgmma"] and r["tma"], (name, r)
            assert 0 < r["shared"] <= smem and r["cubin_bytes"] > 0, (name, r)


def test_on_the_cpu_a_gluon_kernel_runs_the_triton_forward(device):
    """kernel.gluon is made (it imports without a GPU), but CPU tensors go through the interpreter's Triton kernels."""
    kern = attngen.compile(_spec("causal", dtype=DType.FP16), "h100", backend="gluon")
    assert kern.generator.generator == "gluon" and kern.gluon is not None and "gluon.jit" in kern.gluon_source
    q, k, v = (torch.randn(1, 2, 70, 128, dtype=torch.float16).to(device) for _ in range(3))
    out = kern(q, k, v)
    ref = attngen.reference(kern.spec, q.double(), k.double(), v.double(), dtype=torch.float64)
    assert not torch.isnan(out).any() and torch.allclose(out.double(), ref, atol=2e-3)  # (on a GPU: through Gluon)


@pytest.mark.parametrize("name", TAKEN)
def test_gluon_forward_matches_the_reference(name, device):
    """Through both generators: the forward by Gluon (backward by Triton) within `attngen check`'s budget on every
    CUDA shape (odd lengths, GQA, MQA, q_len != kv_len), bf16 and fp16; reruns bit-identical."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    for dtype in (DType.BF16, DType.FP16):
        kern = attngen.compile(_spec(name, dtype=dtype), backend="gluon")
        results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(verify.CUDA_SHAPES)]
        assert all(r.ok for r in results), verify.format_table(name, results)
        q, k, v = (torch.randn(2, 4, 777, kern.spec.head_dim, device="cuda", dtype=verify._TORCH[kern.spec.dtype.value]) for _ in range(3))
        assert torch.equal(kern(q, k, v), kern(q, k, v))
