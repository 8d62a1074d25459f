"""The command line: build, plan, targets, check; spec errors print file:line:col and exit 2, writing nothing."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attngen.cli import main

ROOT = Path(__file__).parent.parent


def test_build_writes_one_module_per_spec_and_target(tmp_path, capsys):
    # --no-binaries: the modules and the manifest only (tests/test_bundle.py compiles binaries)
    assert main(["build", str(ROOT / "specs" / "causal.attn"), str(ROOT / "specs" / "document.attn"), "--target", "h100", "--target", "a100",
                 "-o", str(tmp_path), "--no-binaries"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["causal_a100.py", "causal_h100.py", "document_a100.py", "document_h100.py", "manifest.json"]
    assert "wrote" in capsys.readouterr().out
    compile((tmp_path / "causal_h100.py").read_text(), "causal_h100.py", "exec")


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
    assert main(["build", str(ROOT / "specs" / "causal.attn"), "--target", "t4", "-o", str(tmp_path / "o")]) == 2
    assert "bf16 needs compute capability 8.0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_plan_prints_the_derivation(capsys):
    assert main(["plan", str(ROOT / "specs" / "causal.attn"), "--target", "h100"]) == 0
    out = capsys.readouterr().out
    assert "B_c = ceil(M / 4d) = ceil(116224 / 512)  =>  227" in out and "BLOCK_M=128 BLOCK_N=128" in out


def test_plan_draws_the_tile_map(capsys):
    assert main(["plan", str(ROOT / "specs" / "causal.attn"), "--target", "h100", "--seq", "512"]) == 0
    out = capsys.readouterr().out
    assert "+...\n#+..\n##+.\n###+\n" in out
    assert "full 6, partial 4, empty 6 of 16 tiles; 62.5% must be visited" in out


def test_targets_lists_the_table(capsys):
    assert main(["targets", "-v"]) == 0
    out = capsys.readouterr().out
    for name in ("t4", "v100", "a10g", "l4", "a100", "h100", "h200", "rtx4090"):
        assert f"\n{name} " in out
    assert "CUDA C++ Programming Guide" in out


def test_check_runs_the_reference_comparison(capsys, device):
    assert main(["check", str(ROOT / "specs" / "local_window.attn"), "--device", device, "--quick", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "out err/bound" in out and "all passed" in out and out.count(" ok") >= 3


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
