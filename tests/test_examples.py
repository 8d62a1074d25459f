"""examples/: the training example runs end to end (on the CPU: its smoke configuration, kernels in Triton's
interpreter) and attngen's run computes what PyTorch's SDPA computes from the same weights on the same batches."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a process of its own, training three tiny models through the interpreter: about 10 s
def test_train_gpt_smoke_matches_sdpa(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    runs = result["runs"]
    assert set(runs) == {"sdpa", "attngen", "window_softcap"}
    for name, r in runs.items():
        assert len(r["loss"]) == 2 and all(math.isfinite(x) for x in r["loss"]), (name, r["loss"])
        assert r["held_out"] and all(math.isfinite(x) for _, x in r["held_out"]), (name, r["held_out"])
        # 256 byte values, GPT-2's small initialization: the first loss is near the uniform guess's ln 256
        assert abs(r["loss"][0] - math.log(256)) < 0.5, (name, r["loss"][0])
    # the same weights and batches: attngen's causal attention gives SDPA's losses, before and after a step
    for a, b in zip(runs["attngen"]["loss"] + [runs["attngen"]["held_out"][-1][1]],
                    runs["sdpa"]["loss"] + [runs["sdpa"]["held_out"][-1][1]]):
        assert abs(a - b) <= 1e-3 * abs(b), (runs["attngen"], runs["sdpa"])
    assert "tokens/s" in proc.stdout


def _train(tmp_path, name, *extra, processes=1):
    """examples/train_gpt.py --smoke (attngen's run, 2 heads), in one process or under torchrun with `processes`:
    its losses, held-out losses and standard output."""
    out = tmp_path / name
    script = [str(ROOT / "examples" / "train_gpt.py"), "--smoke", "--runs", "attngen", "--heads", "2", "--out", str(out), *extra]
    # (--standalone: a free port for the ranks' rendezvous, whatever else runs on the machine)
    launch = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(launch + script, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.with_suffix(".json").read_text())["runs"]["attngen"]
    return run["loss"] + [x for _, x in run["held_out"]], proc.stdout


@pytest.mark.slow  # three runs, two of them two processes each (gloo): about 40 s
def test_train_gpt_with_context_parallelism_and_fsdp_matches_one_process(tmp_path):
    """--context-parallel 2 under torchrun (gloo, the interpreter): each rank keeps half of every sequence, the
    attention runs over both (the ring, and Ulysses' exchange of heads), the model is sharded by FSDP2; the losses
    before and after an optimizer step and the held-out loss are the one-process run's, within float32 noise."""
    one, _ = _train(tmp_path, "one")
    for method in ("ring", "ulysses"):
        split, stdout = _train(tmp_path, method, "--context-parallel", "2", "--method", method, processes=2)
        assert all(math.isfinite(x) for x in split) and len(split) == len(one) == 3
        for a, b in zip(split, one):
            assert abs(a - b) <= 1e-4 * abs(b), (method, split, one)
        assert f"context parallel over 2 processes ({method}) with FSDP2" in stdout
