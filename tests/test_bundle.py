"""Ahead-of-time bundles (attngen build -o DIR / attngen.load): binaries for named GPUs built on this CPU
machine, manifest and digests, and every way a load can refuse or fall back. The GPU half (the binaries
launch with no compilation and give the JIT's outputs) is benchmarks/first_call.py on the H100."""
import importlib.metadata
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

import attngen
import attngen.aot as bundle
from attngen.aot import loader as aot_loader
from attngen.aot import manifest as bundle_manifest
from attngen.aot import record
from attngen.tools.cli import main

ROOT = Path(__file__).parent.parent
EM_CUDA = 190  # ELF e_machine of NVIDIA cubins


# fp16: the interpreter, which runs the fallbacks here, has no bf16 arithmetic (the H100 run uses bf16 specs)
CAUSAL = "attention causal {\n    head_dim = 64\n    dtype = fp16\n    mask = q_idx >= kv_idx\n}\n"


# These tests run the bundle where its device check must refuse it (no GPU: kernels in Triton's interpreter).
# On the GPU the same paths are measured by benchmarks/first_call.py (bundle used, no compilation, reference checks).
NO_GPU = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the CPU interpreter: the premise is that no GPU passes the device check")


# The tests on this fixture are marked slow: it compiles for sm_90 and sm_80 with triton.compile in a process pool.
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A causal spec for the H100 and the A100, compiled once for this module (about 30 s on 2 cores)."""
    root = tmp_path_factory.mktemp("bundle")
    (root / "causal.attn").write_text(CAUSAL)
    out = root / "causal"
    manifest = bundle.build([root / "causal.attn"], ["h100", "a100"], out, jobs=2, progress=False)
    return out, manifest


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "elsewhere" / "bundle"
    shutil.copytree(src, dst)
    return dst


def _run_small(kern):
    """A small forward + backward on CPU (interpreter), checked against the float64 reference."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, kern.spec.head_dim, generator=gen).half().requires_grad_() for _ in range(3))
    o = kern(q, k, v)
    ref = attngen.reference(kern.spec, q.double(), k.double(), v.double())
    assert not torch.isnan(o).any()
    assert (o.double() - ref).abs().max().item() < 4e-3  # fp16 output rounding (2^-11 relative) and fp16 P
    o.sum().backward()
    assert not torch.isnan(q.grad).any()


@pytest.mark.slow
def test_build_writes_cubins_for_each_target(built):
    out, manifest = built
    entries = {e["target"]: e for e in manifest["entries"]}
    assert set(entries) == {"h100", "a100"}
    for target, arch in (("h100", 90), ("a100", 80)):
        e = entries[target]
        assert e["arch"] == arch and e["name"] == "causal"
        assert {k["kernel"] for k in e["kernels"]} == {"_attn_fwd", "_attn_bwd_delta", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_decode"}
        for k in e["kernels"]:
            cubin = (out / k["files"][f"{k['kernel']}.cubin"]["path"]).read_bytes()
            assert cubin[:4] == b"\x7fELF"
            assert struct.unpack_from("<H", cubin, 18)[0] == EM_CUDA
            assert struct.unpack_from("<I", cubin, 48)[0] & 0xFF == arch  # e_flags: the SM the code is for
            meta = json.loads((out / k["files"][f"{k['kernel']}.json"]["path"]).read_text())
            assert meta["target"] == {"backend": "cuda", "arch": arch, "warp_size": 32} and meta["name"] == k["kernel"]
            assert meta["num_warps"] == k["num_warps"] and meta["shared"] == k["shared"]
            limit = {"h100": 227 * 1024, "a100": 163 * 1024}[target]
            assert 0 < meta["shared"] <= limit


@pytest.mark.slow
def test_manifest_validates(built, tmp_path):
    """Relative paths, digests that match, a spec that parses back to its hash, a module that is what this
    attngen renders for that spec and target."""
    from attngen.lang.canonical import spec_hash
    from attngen.plan.planner import plan
    from attngen.codegen.triton import build_source

    out, _ = built
    m = bundle.read_manifest(out)
    assert m["format"] == bundle_manifest.FORMAT and m["triton"] == "3.6.0" and m["torch"] == importlib.metadata.version("torch")
    for e in m["entries"]:
        texts, reason = bundle_manifest._verify_files(out, e)
        assert reason is None, reason
        spec = attngen.load_spec(e["spec"], "manifest")
        assert spec_hash(spec) == e["spec_hash"]
        assert build_source(plan(spec, e["target"]))[1] == texts[e["module"]["path"]]
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    m["entries"][0]["module"]["path"] = "../outside.py"
    (bad / bundle_manifest.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match="leaves the bundle directory"):
        bundle.read_manifest(bad)
    (bad / bundle_manifest.MANIFEST).write_text("{not json")
    with pytest.raises(attngen.BundleError, match="unreadable manifest"):
        attngen.load(bad)
    with pytest.raises(attngen.BundleError, match="has no manifest.json"):
        attngen.load(tmp_path)


@pytest.mark.slow
@NO_GPU
def test_a_copied_intact_bundle_checks_out_until_the_device(built, tmp_path):
    """On this CPU machine every check passes except the last (a CUDA device): a warning says so and the spec
    is compiled just in time (the interpreter), giving correct results; strict=True refuses."""
    where = _copy(built[0], tmp_path)
    with pytest.warns(attngen.BundleWarning, match="no CUDA device is visible; compiling just in time"):
        kern = attngen.load(where)
    assert kern.bundle.used is False and "no CUDA device" in kern.bundle.reason
    _run_small(kern)
    with pytest.raises(attngen.BundleError, match=r"cannot be used: no CUDA device is visible \(strict=True\)"):
        attngen.load(where, strict=True)


@pytest.mark.slow
@NO_GPU
def test_tampered_binary_is_caught_by_its_digest(built, tmp_path):
    where = _copy(built[0], tmp_path)
    e = next(e for e in bundle.read_manifest(where)["entries"] if e["target"] == "h100")
    cubin = where / next(f["path"] for k in e["kernels"] for n, f in k["files"].items() if n.endswith(".cubin"))
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x01
    cubin.write_bytes(bytes(data))
    rel = cubin.relative_to(where).as_posix()
    with pytest.raises(attngen.BundleError, match=f"{rel} does not match its sha256"):
        attngen.load(where, target="h100", strict=True)
    with pytest.warns(attngen.BundleWarning, match="does not match its sha256"):
        kern = attngen.load(where, target="h100")
    _run_small(kern)  # the fallback compiles the spec itself, not the bundle's files
    cubin.unlink()
    with pytest.raises(attngen.BundleError, match="is missing or unreadable"):
        attngen.load(where, target="h100", strict=True)


@pytest.mark.slow
def test_version_and_generator_mismatches_fall_back(built, tmp_path):
    where = _copy(built[0], tmp_path)
    path = where / bundle_manifest.MANIFEST
    m = json.loads(path.read_text())
    m["triton"] = "9.9.9"
    path.write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match="built for triton 9.9.9, this is triton 3.6.0"):
        attngen.load(where, strict=True)
    # a module another attngen generated (its digest updated too): the rendering check catches it
    m["triton"] = "3.6.0"
    for e in m["entries"]:
        mod = where / e["module"]["path"]
        text = mod.read_text() + "# edited\n"
        mod.write_text(text)
        e["module"]["sha256"] = bundle_manifest._sha256(text.encode())
    path.write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match="generates a different module for the spec"):
        attngen.load(where, strict=True)


@pytest.mark.slow
@NO_GPU
def test_compile_with_bundle_picks_the_spec_by_content(built, tmp_path):
    where = _copy(built[0], tmp_path)
    with pytest.raises(attngen.BundleError, match="no CUDA device"):  # found (by hash), then the device check
        attngen.compile(CAUSAL, bundle=where, strict=True)
    with pytest.raises(attngen.BundleError, match="no CUDA device"):  # target="auto" picks by the device, as no target
        attngen.compile(CAUSAL, "auto", bundle=where, strict=True)
    with pytest.raises(attngen.BundleError, match=r"has no build of this spec \(sha256 [0-9a-f]{16}\); it holds causal"):
        attngen.compile(ROOT / "specs" / "dense.attn", "h100", bundle=where, strict=True)
    with pytest.warns(attngen.BundleWarning, match="has no build of this spec"):
        kern = attngen.compile(ROOT / "specs" / "dense.attn", "h100", bundle=where)
    assert kern.spec.name == "dense" and kern.bundle.used is False


@pytest.mark.slow
def test_the_bundle_lookup_returns_the_bundles_binary(built, tmp_path):
    """What the H100 does on a first call, minus the launch: Triton's JIT specializes the call and asks its
    kernel's `compile` for a binary; the bundle's lookup answers with the bundle's cubin, and a specialization
    the bundle lacks is refused (strict) naming the argument, or compiled (not strict)."""
    out, _ = built
    m = bundle.read_manifest(out)
    e = next(e for e in m["entries"] if e["target"] == "h100")
    spec = attngen.load_spec(e["spec"], "manifest")
    from attngen.plan.planner import plan

    module = record.import_compiled("test_bundle_lookup", out / e["module"]["path"], (out / e["module"]["path"]).read_text())
    launches = record.record_launches(plan(spec, "h100"), module, 90)
    assert {launch.key for launch in launches} == {k["key"] for k in e["kernels"]}
    from triton.compiler import ASTSource

    stats = bundle.BundleStats()
    for launch in launches:
        k = next(k for k in e["kernels"] if k["key"] == launch.key)
        binaries = {k["key"]: (k["triton_hash"], {n: str(out / f["path"]) for n, f in k["files"].items()})}
        fn = getattr(module, launch.kernel)
        lookup = aot_loader._PrebuiltCompile("test", binaries, True, None, stats)
        compiled = lookup(ASTSource(fn, launch.signature, launch.constexprs, launch.attrs), options=launch.options)
        assert compiled.asm["cubin"] == (out / k["files"][f"{launch.kernel}.cubin"]["path"]).read_bytes()
        # the same kernel called with a row stride not divisible by 16 (e.g. a sliced tensor): another binary
        # (the backward's pre-pass reads O, not Q)
        row = next(name for name in ("stride_qm", "stride_om") if name in launch.signature)
        attrs = {path: a for path, a in launch.attrs.items() if path != (list(launch.signature).index(row),)}
        with pytest.raises(attngen.BundleError, match=rf"no prebuilt binary of _attn_\w+ for this call \(differs in {row}: not known divisible by 16 in this call, "
                                                        r"divisible by 16 in the bundle\); strict=True"):
            lookup(ASTSource(fn, launch.signature, launch.constexprs, attrs), options=launch.options)
        fallback = aot_loader._PrebuiltCompile("test", binaries, False, lambda src, **kw: "jit", stats)
        with pytest.warns(attngen.BundleWarning, match="compiling it just in time"):
            assert fallback(ASTSource(fn, launch.signature, launch.constexprs, attrs), options=launch.options) == "jit"
    assert stats.loaded == len(launches) and stats.compiled == len(launches)


@pytest.mark.parametrize("spec, flags", [
    ("causal_dropout.attn", {"DROPOUT": {True, False}}),
    ("relative_bias.attn", {"INPUT_GRADS": {True, False}}),
    ("sink_window.attn", {"SINK_GRADS": {True, False}}),
    ("block_sparse_runtime.attn", {}),
    ("document.attn", {}),
])
def test_recording_covers_every_flag_the_spec_implies(spec, flags):
    """The specializations a build compiles (no compiling here): each kernel of the module, and both values of
    the flags the launchers set (dropout on/off, input gradients on/off, the sink's gradients on/off); none depends on the sequence length,
    head count or seed value (they are not specialized), so three sequence lengths give few binaries."""
    from attngen.lang.check import read_spec
    from attngen.plan.planner import plan
    from attngen.codegen.triton import build_source

    p = plan(read_spec(ROOT / "specs" / spec), "h100")
    _, source = build_source(p)
    import tempfile

    path = Path(tempfile.mkdtemp()) / f"{spec}.py"
    path.write_text(source)
    module = record.import_compiled(f"test_record_{path.stem.replace('.', '_')}", path, source)
    launches = record.record_launches(p, module, 90)
    kernels = {launch.kernel for launch in launches}
    assert {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"} <= kernels
    if p.spec.inputs and any(d.dtype.startswith("int") and len(d.dims) > 1 for d in p.spec.inputs):
        assert "_input_bounds" in kernels  # the pre-pass of an input-dependent mask
    for flag, values in flags.items():
        seen = {json.loads(launch.key)["constants"].get(flag) for launch in launches if launch.kernel != "_input_bounds"}
        assert {repr(v) for v in values} <= seen
    for launch in launches:
        sig = launch.signature
        for name in ("q_len", "kv_len", "num_heads", "group_size"):
            assert sig.get(name, "i32") == "i32"
    packed = [launch for launch in launches if json.loads(launch.key)["constants"].get("VARLEN") == "True"]
    assert len([launch for launch in launches if "decode" not in launch.kernel and launch not in packed]) <= 12
    assert len([launch for launch in launches if "decode" in launch.kernel]) <= 7  # test_recording_covers_decoding
    # packed sequences (cu_seqlens) where the spec takes them: the forward and both backward kernels, once per flag
    if record.takes_packed(p.spec):
        assert {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"} <= {launch.kernel for launch in packed} and len(packed) <= 12
        if p.spec.sink is not None:  # the sink's gradients with packed sequences: their pre-pass finds each row's sequence
            assert any(launch.kernel == "_attn_bwd_delta" and json.loads(launch.key)["constants"].get("SINK_GRADS") == "True" for launch in packed)
    else:
        assert not packed


def test_recording_covers_decoding():
    """The decode launcher with per-sequence lengths: programs of 16, 32 and 64 rows, the keys split or not (the
    last split merging the runs then), one specialization each whatever the lengths; a paged spec records nothing else."""
    from attngen.lang.check import read_spec
    from attngen.codegen.triton import build_source
    from attngen.plan.planner import plan

    import tempfile

    for name, others in (("paged_decode", set()), ("causal", {"_attn_fwd", "_attn_bwd_delta", "_attn_bwd_dkdv", "_attn_bwd_dq"})):
        p = plan(read_spec(ROOT / "specs" / f"{name}.attn"), "h100")
        path = Path(tempfile.mkdtemp()) / f"{name}.py"
        source = build_source(p)[1]
        path.write_text(source)
        launches = record.record_launches(p, record.import_compiled(f"test_record_decode_{name}", path, source), 90)
        decode = [json.loads(launch.key)["constants"] for launch in launches if launch.kernel == "_attn_decode"]
        assert sorted((c["BLOCK_R"], c["PARTIAL"]) for c in decode) == sorted((r, s) for r in ("16", "32", "64") for s in ("True", "False"))
        assert all(c["KV_LENS"] == "True" and c["Q_LENS"] == "False" for c in decode)
        assert {launch.kernel for launch in launches} == others | {"_attn_decode"}


def test_gluon_recording_covers_dropout_on_and_off():
    """A Gluon module of a spec with dropout: its forward and backward are recorded with dropout compiled in and
    without (evaluation), one specialization each whatever the seed (its two int32 halves are not specialized)."""
    from attngen.lang.check import load_spec
    from attngen.codegen.gluon import build_source, choose
    from attngen.plan.planner import plan

    spec = load_spec("attention drop {\n head_dim = 128\n dtype = bf16\n mask = q_idx >= kv_idx\n dropout = 0.1\n backend = gluon\n}")
    p = plan(spec, "h100")
    choice = choose(spec, p)
    _, source = build_source(choice.gluon)
    import tempfile

    path = Path(tempfile.mkdtemp()) / "drop_gluon.py"
    path.write_text(source)
    module = record.import_compiled("test_record_drop_gluon", path, source)
    launches = record.record_gluon_launches(p, choice, module, 90)
    flags = {(launch.kernel, json.loads(launch.key)["constants"].get("DROPOUT")) for launch in launches}
    assert {("_attn_fwd", "True"), ("_attn_fwd", "False"), ("_attn_bwd", "True"), ("_attn_bwd", "False")} <= flags, flags
    # one forward each with dropout on and off, for (B, H, N, D) tensors in both forms (a program per tile, and
    # persistent: what calls of few keys take) and for packed sequences (VARLEN)
    forwards = [json.loads(launch.key)["constants"] for launch in launches if launch.kernel == "_attn_fwd"]
    forms = (("False", "False"), ("False", "True"), ("True", "False"))  # (VARLEN, PERSISTENT)
    assert sorted((c.get("DROPOUT"), c.get("VARLEN", "False"), c.get("PERSISTENT", "False")) for c in forwards) == \
        sorted((d, *f) for d in ("True", "False") for f in forms)


def test_recording_an_fp8_spec_takes_its_forward_only():
    """An FP8 spec (forward only): the recorded launches of both generators' modules are the forward and the copy
    of V with its keys contiguous; no backward, no decode kernel."""
    from attngen.lang.check import load_spec
    from attngen.codegen.gluon import build_source as build_gluon, choose
    from attngen.codegen.triton import build_source
    from attngen.plan.planner import plan

    import tempfile

    spec = load_spec("attention f8 {\n head_dim = 128\n dtype = fp8\n mask = q_idx >= kv_idx\n}")
    p = plan(spec, "h100")
    choice = choose(spec, p)
    for label, source, record_of in (("triton", build_source(p)[1], lambda m: record.record_launches(p, m, 90)),
                                     ("gluon", build_gluon(choice.gluon)[1], lambda m: record.record_gluon_launches(p, choice, m, 90))):
        path = Path(tempfile.mkdtemp()) / f"f8_{label}.py"
        path.write_text(source)
        launches = record_of(record.import_compiled(f"test_record_f8_{label}", path, source))
        assert {launch.kernel for launch in launches} == {"_attn_fwd", "_keys_contiguous"}, (label, launches)


def test_build_refuses_what_cannot_run_on_the_target(tmp_path):
    with pytest.raises(attngen.PlanError, match="causal.attn for t4: .*bf16 needs compute capability 8.0"):
        bundle.build([ROOT / "specs" / "causal.attn"], ["t4"], tmp_path / "o", progress=False)
    fp16 = "attention old { head_dim = 64\n dtype = fp16\n mask = q_idx >= kv_idx }"
    with pytest.raises(attngen.PlanError, match=r"for v100: NVIDIA V100 SXM2 \(v100\) is compute capability 7.0 \(sm_70\): Triton 3.6"):
        bundle.build([fp16], ["v100"], tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(attngen.BundleError, match="exists and is not an attngen bundle"):
        bundle.build([ROOT / "specs" / "dense.attn"], ["h100"], tmp_path / "mine", binaries=False, progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
@NO_GPU
def test_building_into_a_bundle_keeps_its_other_entries(built, tmp_path):
    where = _copy(built[0], tmp_path)
    bundle.build([ROOT / "specs" / "dense.attn"], ["h100"], where, binaries=False, progress=False)
    m = bundle.read_manifest(where)
    assert sorted((e["name"], e["target"]) for e in m["entries"]) == [("causal", "a100"), ("causal", "h100"), ("dense", "h100")]
    for e in m["entries"]:
        assert bundle_manifest._verify_files(where, e)[1] is None
    assert not [p for p in where.parent.iterdir() if p.name.startswith(".")]  # no staging or old copies left behind
    with pytest.raises(attngen.BundleError, match="holds several specs"):
        attngen.load(where)
    with pytest.warns(attngen.BundleWarning):
        assert attngen.load(where, "dense").spec.name == "dense"


def test_cli_build_prints_what_it_wrote(tmp_path, capsys):
    assert main(["build", str(ROOT / "specs" / "dense.attn"), "--target", "h100", "-o", str(tmp_path / "b"), "--no-binaries", "-q"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'b' / 'dense_h100.py'}" in out and "no binaries (--no-binaries)" in out
    assert f"wrote {tmp_path / 'b' / 'dense_h100_gluon.py'}  (the Gluon generator's forward and backward) + no binaries" in out
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["dense_h100.py", "dense_h100_gluon.py", "manifest.json"]



# A spec whose forward and backward are both the Gluon generator's on the H100 (backend = gluon, deterministic =
# false); fp16 for the interpreter fallbacks.
GLUON = ("attention causal_gluon {\n    head_dim = 128\n    dtype = fp16\n    mask = q_idx >= kv_idx\n"
         "    backend = gluon\n    deterministic = false\n}\n")


@pytest.fixture(scope="module")
def built_gluon(tmp_path_factory):
    """GLUON for the H100, compiled once for this module (about 40 s on 2 cores)."""
    root = tmp_path_factory.mktemp("bundle_gluon")
    (root / "causal_gluon.attn").write_text(GLUON)
    out = root / "causal_gluon"
    manifest = bundle.build([root / "causal_gluon.attn"], ["h100"], out, jobs=2, progress=False)
    return out, manifest


@pytest.mark.slow
def test_bundles_carry_the_gluon_generators_kernels(built_gluon):
    """The passes the Gluon generator renders for the spec on the target (here both) are in the bundle: its module,
    which this attngen renders byte for byte from the spec, and sm_90 binaries of its kernels (the forward, the
    backward and its pre-pass), beside the Triton module and kernels (the CPU, other GPUs, input gradients)."""
    from attngen.codegen.gluon import build_source, choose
    from attngen.plan.planner import plan

    out, manifest = built_gluon
    (e,) = manifest["entries"]
    g = e["gluon"]
    assert (g["forward"], g["backward"]) == ("gluon", "gluon") and g["module"]["path"] == "causal_gluon_h100_gluon.py"
    assert {k["kernel"] for k in g["kernels"]} == {"_attn_fwd", "_attn_bwd", "_bwd_delta"}
    assert {k["kernel"] for k in e["kernels"]} == {"_attn_fwd", "_attn_bwd_delta", "_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_decode"}
    texts, reason = bundle_manifest._verify_files(out, e)
    assert reason is None and set(texts) == {e["module"]["path"], g["module"]["path"]}
    spec = attngen.load_spec(e["spec"], "manifest")
    assert build_source(choose(spec, plan(spec, "h100")).gluon)[1] == texts[g["module"]["path"]]
    for k in g["kernels"]:
        cubin = (out / k["files"][f"{k['kernel']}.cubin"]["path"]).read_bytes()
        assert cubin[:4] == b"\x7fELF" and struct.unpack_from("<I", cubin, 48)[0] & 0xFF == 90
        assert k["files"][f"{k['kernel']}.cubin"]["path"].startswith("causal_gluon_h100/gluon_")
        meta = json.loads((out / k["files"][f"{k['kernel']}.json"]["path"]).read_text())
        assert meta["name"] == k["kernel"] and meta["shared"] == k["shared"] <= 227 * 1024
    ptx = (out / next(k for k in g["kernels"] if k["kernel"] == "_attn_bwd")["files"]["_attn_bwd.ptx"]["path"]).read_text()
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx


@pytest.mark.slow
def test_the_bundle_lookup_returns_the_gluon_binaries(built_gluon):
    """As for the Triton kernels: the JIT's specialization of a Gluon launch finds the bundle's binary."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from attngen.codegen.gluon import choose
    from attngen.plan.planner import plan

    out, manifest = built_gluon
    (e,) = manifest["entries"]
    g = e["gluon"]
    spec = attngen.load_spec(e["spec"], "manifest")
    p = plan(spec, "h100")
    module = record.import_compiled("test_bundle_gluon_lookup", out / g["module"]["path"], (out / g["module"]["path"]).read_text())
    launches = record.record_gluon_launches(p, choose(spec, p), module, 90)
    assert sorted(launch.key for launch in launches) == sorted(k["key"] for k in g["kernels"])
    stats = bundle.BundleStats()
    for launch in launches:
        k = next(k for k in g["kernels"] if k["key"] == launch.key)
        lookup = aot_loader._PrebuiltCompile("test", {k["key"]: (k["triton_hash"], {n: str(out / f["path"]) for n, f in k["files"].items()})},
                                         True, None, stats)
        compiled = lookup(GluonASTSource(getattr(module, launch.kernel), launch.signature, launch.constexprs, launch.attrs), options=launch.options)
        assert compiled.asm["cubin"] == (out / k["files"][f"{launch.kernel}.cubin"]["path"]).read_bytes()
    assert stats.loaded == 7  # forward (also persistent), backward and its pre-pass, each also for packed sequences (VARLEN)


@pytest.mark.slow
@NO_GPU
def test_a_gluon_bundle_is_checked_like_the_rest(built_gluon, tmp_path):
    """The Gluon module and binaries are digested like the others; a bundle whose choice of generators differs from
    this attngen's, or whose Gluon module this attngen would not render, is not used."""
    where = _copy(built_gluon[0], tmp_path)
    with pytest.warns(attngen.BundleWarning, match="no CUDA device is visible"):  # intact: every check but the device
        kern = attngen.load(where)
    assert kern.bundle.used is False
    path = where / bundle_manifest.MANIFEST
    m = json.loads(path.read_text())
    g = m["entries"][0]["gluon"]
    m["entries"][0]["gluon"]["backward"] = "triton"
    path.write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match="the bundle renders the forward with gluon and the backward with triton; this attngen chooses gluon forward"):
        attngen.load(where, strict=True)
    g["backward"] = "gluon"
    module = where / g["module"]["path"]
    text = module.read_text() + "# edited\n"
    module.write_text(text)
    with pytest.raises(attngen.BundleError, match="causal_gluon_h100_gluon.py does not match its sha256"):
        attngen.load(where, strict=True)
    g["module"]["sha256"] = bundle_manifest._sha256(text.encode())
    path.write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match="generates a different Gluon module for the spec"):
        attngen.load(where, strict=True)
    m["entries"][0]["gluon"] = {"module": "x"}
    path.write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match="malformed 'gluon' section"):
        attngen.load(where)


@pytest.mark.slow
def test_a_gluon_bundle_launches_with_no_compilation(built_gluon, device):
    """On the H100: both passes run the bundle's Gluon binaries (none compiled) and match the float64 reference."""
    if device != "cuda" or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the bundle's Gluon kernels are sm_90 binaries: an H100 is needed to launch them")
    kern = attngen.load(built_gluon[0], strict=True)
    assert kern.bundle.used and kern.gluon is not None and kern.generator.backward == "gluon"
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = kern(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attngen.reference(kern.spec, *wide, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert torch.isfinite(got).all() and (got.double() - want).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item())
    assert kern.bundle.stats.compiled == 0 and kern.bundle.stats.loaded == 3  # _attn_fwd, _bwd_delta, _attn_bwd (Gluon)


def _quick_bundle(tmp_path, name="b", specs=("causal",)):
    out = tmp_path / name
    bundle.build([ROOT / "specs" / f"{s}.attn" for s in specs], ["h100"], out, binaries=False, progress=False)
    return out


@pytest.mark.parametrize("change, message", [
    (lambda m, e: e["module"].pop("path"), r"its module must be \{\"path\""),
    (lambda m, e: e.__setitem__("kernels", "abc"), "its kernels must be a list"),
    (lambda m, e: e.__setitem__("kernels", [{"kernel": "k", "key": "x", "triton_hash": "h"}]), "its kernels must be a list"),
    (lambda m, e: e.__setitem__("name", 5), "must be strings and its arch an integer"),
    (lambda m, e: e.__setitem__("arch", "90"), "must be strings and its arch an integer"),
    (lambda m, e: m.pop("triton"), "versions of attngen and triton"),
    (lambda m, e: e.__setitem__("gluon", {"forward": "gluon", "backward": "gluon", "module": {"path": 1}, "kernels": []}),
     r"\(Gluon\): its module must be"),
], ids=["no_path", "kernels_a_string", "kernel_without_files", "name_a_number", "arch_a_string", "no_triton_version", "gluon_module"])
def test_a_manifest_of_the_wrong_shape_is_refused(change, message, tmp_path):
    """Every field a load reads is checked for its type first: BundleError naming the manifest, not a KeyError or
    TypeError from inside the loader."""
    out = _quick_bundle(tmp_path)
    path = out / bundle_manifest.MANIFEST
    m = json.loads(path.read_text())
    change(m, m["entries"][0])
    path.write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match=message):
        attngen.load(out, "causal")


@NO_GPU
def test_an_edited_spec_in_the_manifest_is_refused_not_compiled(tmp_path):
    """The manifest's spec text edited (its sha256 not): the load raises, where it used to warn and compile the
    edited spec just in time; a spec the caller passes (compile(spec, bundle=)) is found by its own hash."""
    out = _quick_bundle(tmp_path)
    path = out / bundle_manifest.MANIFEST
    m = json.loads(path.read_text())
    m["entries"][0]["spec"] = m["entries"][0]["spec"].replace("q_idx >= kv_idx", "q_idx <= kv_idx")
    path.write_text(json.dumps(m))
    with pytest.raises(attngen.BundleError, match="spec text does not match its spec_hash"):
        attngen.load(out, "causal")
    with pytest.warns(attngen.BundleWarning, match="no CUDA device"):  # the caller's spec, unchanged, is what compiles
        kern = attngen.compile(ROOT / "specs" / "causal.attn", bundle=out)
    assert "q_idx >= kv_idx" in kern.source


def test_a_build_never_deletes_what_is_not_its_own(tmp_path, monkeypatch):
    """A rebuild replaces the bundle's directory, so files its manifest does not list are refused (and kept), and
    so is a bundle whose kept entries' files are damaged (before anything compiles); a path through a file, a
    link to a bundle and `-o .` inside one; the directory's mode follows the umask (mkdtemp's is 0700)."""
    old_mask = os.umask(0o022)
    try:
        out = _quick_bundle(tmp_path)
        assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    finally:
        os.umask(old_mask)
    (out / "NOTES.txt").write_text("mine")
    with pytest.raises(attngen.BundleError, match="holds 'NOTES.txt', which its manifest.json does not list"):
        bundle.build([ROOT / "specs" / "dense.attn"], ["h100"], out, binaries=False, progress=False)
    assert (out / "NOTES.txt").read_text() == "mine"
    (out / "NOTES.txt").unlink()
    (out / "causal_h100.py").unlink()
    with pytest.raises(attngen.BundleError, match="entry causal for h100, which this build would keep, is damaged"):
        bundle.build([ROOT / "specs" / "dense.attn"], ["h100"], out, binaries=False, progress=False)
    bundle.build([ROOT / "specs" / "causal.attn"], ["h100"], out, binaries=False, progress=False)  # rebuilding it mends it
    assert bundle_manifest._verify_files(out, bundle.read_manifest(out)["entries"][0])[1] is None
    (tmp_path / "afile").write_text("x")
    assert main(["build", str(ROOT / "specs" / "dense.attn"), "--target", "h100", "--no-binaries", "-q", "-o", str(tmp_path / "afile" / "sub")]) == 2
    (tmp_path / "link").symlink_to(out)
    bundle.build([ROOT / "specs" / "dense.attn"], ["h100"], tmp_path / "link", binaries=False, progress=False)
    assert (tmp_path / "link").is_symlink() and sorted(e["name"] for e in bundle.read_manifest(out)["entries"]) == ["causal", "dense"]
    monkeypatch.chdir(out)
    assert main(["build", str(ROOT / "specs" / "local_window.attn"), "--target", "h100", "--no-binaries", "-q", "-o", "."]) == 0
    assert sorted(e["name"] for e in bundle.read_manifest(out)["entries"]) == ["causal", "dense", "local_window"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "b", "link"]  # no staging or old copies left


def test_targets_are_named_once_and_never_auto(tmp_path):
    out = tmp_path / "b"
    bundle.build([ROOT / "specs" / "dense.attn"], ["H100", "h100 "], out, binaries=False, progress=False)
    assert [(e["name"], e["target"]) for e in bundle.read_manifest(out)["entries"]] == [("dense", "h100")]
    with pytest.raises(attngen.BundleError, match="built for named GPUs"):
        bundle.build([ROOT / "specs" / "dense.attn"], ["auto"], tmp_path / "c", binaries=False, progress=False)
    assert not (tmp_path / "c").exists()
