"""The wheel carries the templates and the grammar: a non-editable install into a clean virtual environment
runs `attngen build` from another directory (building needs neither torch nor a GPU)."""
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.slow  # pip in subprocesses: builds a wheel, installs it into a new virtual environment


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)])
    (path,) = out.glob("attngen-*.whl")
    return path


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = {p.relative_to(ROOT / "templates").as_posix() for p in (ROOT / "templates").rglob("*.jinja")}
    assert templates and {f"attngen/templates/{t}" for t in templates} <= names
    assert "attngen/lang/grammar.lark" in names
    assert "attngen/py.typed" in names  # PEP 561: type checkers read attngen's annotations
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_builds_from_another_directory(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # attngen itself without its heavy dependencies (torch, triton: not needed to build without binaries), plus what that needs
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
    _run([str(py), "-m", "pip", "install", "-q", "lark>=1.1.9", "jinja2>=3.1"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = ROOT / "specs" / "causal.attn"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = _run([str(env_dir / "bin" / "attngen"), "build", str(spec), "--target", "h100", "--no-binaries"], cwd=elsewhere, env=env)
    built = elsewhere / "build" / "causal_h100.py"
    assert built.is_file() and "wrote" in proc.stdout
    where = _run([str(py), "-c", "import attngen, os; print(os.path.dirname(attngen.__file__))"], cwd=elsewhere, env=env).stdout.strip()
    assert where.startswith(str(env_dir)), where  # the installed copy, not the source tree
    assert "def _attn_fwd(" in built.read_text()
