"""The command line: build, plan, targets, check; spec errors print file:line:col and exit 2, writing nothing."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import attngen
from attngen.tools import verify
from attngen.tools.cli import main

ROOT = Path(__file__).parent.parent


def test_build_writes_one_module_per_spec_and_target(tmp_path, capsys):
    # --no-binaries: the modules and the manifest only (tests/test_bundle.py compiles binaries)
    assert main(["build", str(ROOT / "specs" / "causal.attn"), str(ROOT / "specs" / "document.attn"), "--target", "h100", "--target", "a100",
                 "-o", str(tmp_path), "--no-binaries"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    # on the H100 the Gluon generator renders causal's passes: its module too (not document's: at head_dim 64 auto
    # takes the Triton generator for document masks, measured faster)
    assert names == ["causal_a100.py", "causal_h100.py", "causal_h100_gluon.py", "document_a100.py", "document_h100.py", "manifest.json"]
    assert "wrote" in capsys.readouterr().out
    compile((tmp_path / "causal_h100.py").read_text(), "causal_h100.py", "exec")
    compile((tmp_path / "causal_h100_gluon.py").read_text(), "causal_h100_gluon.py", "exec")


def test_spec_error_exits_2_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.attn"
    bad.write_text("attention bad {\n    head_dim = 64\n    mask = q_idx >= kv_idx +\n}\n")
    out = tmp_path / "out"
    code = main(["build", str(ROOT / "specs" / "causal.attn"), str(bad), "--target", "h100", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{bad}:4:1: syntax error: unexpected '}}'" in err and "^" in err
    assert not out.exists()  # the good spec was not written either


def test_plan_error_exits_2(tmp_path, capsys):
    """A spec that cannot run on the target: every command names the spec's file."""
    path = ROOT / "specs" / "causal.attn"
    assert main(["build", str(path), "--target", "t4", "-o", str(tmp_path / "o")]) == 2
    assert f"{path} for t4: bf16 needs compute capability 8.0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    for command in (["plan"], ["check", "--quick"]):
        assert main([command[0], str(path), "--target", "t4", *command[1:]]) == 2
        assert f"attngen: cannot plan: {path}: bf16 needs compute capability 8.0" in capsys.readouterr().err


def test_plan_prints_the_derivation(capsys):
    assert main(["plan", str(ROOT / "specs" / "causal.attn"), "--target", "h100"]) == 0
    out = capsys.readouterr().out
    assert "B_c = ceil(M / 4d) = ceil(116224 / 512)  =>  227" in out and "BLOCK_M=128 BLOCK_N=128" in out


def test_plan_draws_the_tile_map(capsys):
    assert main(["plan", str(ROOT / "specs" / "causal.attn"), "--target", "h100", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert "+...\n#+..\n##+.\n###+\n" in out
    assert "full 6, partial 4, empty 6 of 16 tiles; 62.5% must be visited" in out
    assert "kept blocks as lists" not in out
    # a block pattern: the map of its tiles, and the lists the Triton kernels walk instead of the holes between them
    assert main(["plan", str(ROOT / "specs" / "butterfly_blocks.attn"), "--target", "h100", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert "###.#...\n##.#.#..\n" in out and "walk the block pattern's kept blocks as lists" in out


def test_targets_lists_the_table(capsys):
    assert main(["targets", "-v"]) == 0
    out = capsys.readouterr().out
    for name in ("t4", "v100", "a10g", "l4", "a100", "h100", "h200", "rtx4090"):
        assert f"\n{name} " in out
    assert "CUDA C++ Programming Guide" in out


def test_targets_marks_what_triton_cannot_build(capsys):
    assert main(["targets"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:] if line.strip() and not line.startswith("sources")}
    assert rows["v100"].endswith("unsupported: Triton 3.6 needs sm_75+")
    assert [name for name, line in rows.items() if "unsupported" in line] == ["v100"]  # t4 (7.5) is the oldest Triton 3.6 builds for


@pytest.mark.parametrize("command", [["plan"], ["build", "--no-binaries"], ["build"]])
def test_unsupported_target_exits_2_and_says_why(command, tmp_path, capsys):
    # an fp16 spec: nothing else stands in the way on a V100
    argv = [command[0], str(ROOT / "specs" / "local_window.attn"), "--target", "v100", *command[1:]]
    if command[0] == "build":
        argv += ["-o", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "attngen: cannot plan: " in err
    assert "NVIDIA V100 SXM2 (v100) is compute capability 7.0 (sm_70): Triton 3.6, which attngen's kernels are written for, builds for 7.5" in err
    assert not (tmp_path / "o").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    triton, torch = importlib.metadata.version("triton"), importlib.metadata.version("torch")
    assert capsys.readouterr().out == f"attngen {attngen.__version__} (Triton {triton}, torch {torch})\n"


def test_check_runs_the_reference_comparison(capsys, device):
    assert main(["check", str(ROOT / "specs" / "local_window.attn"), "--device", device, "--quick", "--dtype", "fp32"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "out err/bound" in out and "all passed" in out and out.count(" ok") >= 3
    assert f"attngen check [3/3]: {ROOT / 'specs' / 'local_window.attn'}, fp32, (B,Hq,Hkv,Nq,Nk) = (1, 4, 2, 65, 63) on {device}" in captured.err


def test_check_reports_each_case_before_running_it(monkeypatch, capsys):
    """Progress goes to stderr as the check goes: each case's line is out before the case runs, the tables after all."""
    seen = []

    def fake_check(kernel, shape, device):
        captured = capsys.readouterr()
        seen.append((captured.err, captured.out))
        return verify.Result(shape, kernel.spec.dtype.value, {"out": (0.0, 0.0, 1.0)})

    monkeypatch.setattr(verify, "check_one", fake_check)
    specs = [str(ROOT / "specs" / name) for name in ("local_window.attn", "causal.attn")]
    assert main(["check", *specs, "--quick", "--dtype", "fp32", "--dtype", "fp16"]) == 0
    cases = [(spec, dtype, shape) for spec in specs for dtype in ("fp32", "fp16") for shape in verify.CPU_SHAPES[:3]]
    assert len(seen) == len(cases) == 12
    for i, ((err, out), (spec, dtype, shape)) in enumerate(zip(seen, cases), 1):
        assert err == f"attngen check [{i}/12]: {spec}, {dtype}, (B,Hq,Hkv,Nq,Nk) = {shape} on cpu\n"
        assert ("err/bound" in out) == (i == 7)  # the first spec's table comes after its six cases
    assert "all passed" in capsys.readouterr().out


@pytest.mark.slow  # a process of its own (5 s)
def test_check_prints_only_its_progress_on_stderr():
    """Rows that keep no key (key padding with length 0; kv_outer's padding lanes) have lse = log2(0) = -inf by
    design: `attngen check` must not show numpy's warnings about it, as it once did."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # check sets it itself for --device cpu
    run = subprocess.run([sys.executable, "-m", "attngen", "check", "specs/key_padding.attn", "specs/causal_fa1.attn", "--quick"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    assert len(lines) == 6 and all(line.startswith("attngen check [") for line in lines), run.stderr[-2000:]


@pytest.mark.slow  # two pytest processes collecting the suite (10 s)
def test_the_quick_subset_leaves_out_the_slow_tests():
    """`-m "not slow"` (README, Set-up) drops what compiles for sm_90, starts processes or runs long, and only that;
    an unregistered marker is an error (--strict-markers), so a misspelt `slow` cannot slip a test into the quick
    subset."""
    def collect(*args):
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return {line for line in run.stdout.splitlines() if "::" in line}

    every, quick = collect(), collect("-m", "not slow")
    slow = every - quick
    assert quick < every and len(slow) >= 20
    for name in ("test_gluon.py::test_every_taken_spec_compiles_for_sm90", "test_bundle.py::test_build_writes_cubins_for_each_target",
                 "test_cli.py::test_check_prints_only_its_progress_on_stderr"):
        assert any(name in t for t in slow) and not any(name in t for t in quick), name
    assert "--strict-markers" in (ROOT / "pyproject.toml").read_text()


def test_console_script_runs_from_another_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "attngen", "build", str(ROOT / "specs" / "causal.attn"), "--target", "h100", "--no-binaries"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "build" / "causal_h100.py").is_file()


@pytest.mark.parametrize("argv", [["build", "x.attn"], ["frobnicate"]])
def test_usage_errors(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


def test_no_command_prints_the_full_help(capsys):
    """`attngen` or `python -m attngen` alone: the description and every command with its help, exit 0."""
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attngen") and "Compile .attn attention specs" in out
    for command in ("build", "plan", "check", "bench", "targets"):
        assert f"    {command}" in out, command


@pytest.mark.parametrize("argv, message", [(["--seq", "-5"], "--seq: -5: must be at least 1"), (["--seq", "0"], "--seq: 0: must be at least 1"),
                                           (["--seq", "256", "--kv-seq", "-1"], "--kv-seq: -1: must be at least 1"),
                                           (["--seq", "x"], "--seq: 'x' is not a whole number")])
def test_plan_refuses_lengths_below_one(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", str(ROOT / "specs" / "causal.attn"), *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_plan_draws_no_map_too_large_to_read(capsys):
    assert main(["plan", str(ROOT / "specs" / "causal.attn"), "--target", "h100", "--seq", "100000000"]) == 0
    out = capsys.readouterr().out
    assert "more than the 65536 a map draws" in out and "must be visited" not in out
