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
