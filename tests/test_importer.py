"""Import-time kernels: with attngen.install_import_hook(), `import pkg.attention.causal` compiles
pkg/attention/causal.attn into a module whose `attention` is the autograd-wrapped kernel. The kernels are checked
by attngen.verify (O, lse, dQ, dK, dV against the float64 reference of a spec parsed from the same text, NaN
failing), so a module that compiled the wrong file, or kept a stale kernel on reload, fails."""
import importlib
import re
import sys
import uuid
from pathlib import Path

import pytest

import attngen
from attngen.tools import verify
from attngen.lang.check import load_spec
from attngen.errors import AttngenError, PlanError, SpecError, SpecSyntaxError
from attngen.importer import AttnFinder

SPECS = Path(__file__).parent.parent / "specs"
SHAPES = (verify.CPU_SHAPES[1], verify.CPU_SHAPES[2])  # (2, 2, 2, 17, 17) and GQA (1, 4, 2, 65, 63)


class Project:
    """A fresh top-level package on sys.path, with a unique name (modules of one test never meet another's)."""

    def __init__(self, root: Path):
        self.root = root
        self.name = f"attnproj_{uuid.uuid4().hex[:10]}"

    def write(self, relative: str, text: str) -> Path:
        path = self.root / self.name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        importlib.invalidate_caches()  # Python's path finders cache directory listings
        return path

    def import_(self, dotted: str):
        return importlib.import_module(f"{self.name}.{dotted}")


@pytest.fixture
def project(tmp_path, target):
    """The hook installed (planning for the test target), tmp_path on sys.path; afterwards the hook, the path
    entry and every module of the project are gone."""
    attngen.install_import_hook(target=target)
    sys.path.insert(0, str(tmp_path))
    proj = Project(tmp_path)
    yield proj
    attngen.uninstall_import_hook()
    sys.path.remove(str(tmp_path))
    for name in [m for m in sys.modules if m == proj.name or m.startswith(proj.name + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


class Checked:
    """A module's kernel as attngen.verify checks it, against the reference of `text` parsed independently."""

    def __init__(self, module, text: str):
        self.spec, self.plan, self.call = load_spec(text), module.plan, module.attention

    def __call__(self, q, k, v, **kwargs):
        return self.call(q, k, v, **kwargs)


def _check(module, text: str, device) -> list:
    return [verify.check_one(Checked(module, text), shape, device, seed=i) for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("layout", ["package", "namespace package"])
def test_import_compiles_the_attn_file(project, layout, device):
    """A package with __init__.py, or a namespace package (none), holding causal.attn; the module's attributes are
    those of the compiled kernel, and its kernel matches the reference of the file's spec."""
    text = (SPECS / "causal.attn").read_text()
    path = project.write("attention/causal.attn", text)
    if layout == "package":
        project.write("__init__.py", "")
        project.write("attention/__init__.py", "")
    mod = project.import_("attention.causal")
    assert mod.__file__ == str(path) and mod.__spec__.origin == str(path)
    assert mod.attention is mod.kernel and isinstance(mod.kernel, attngen.Kernel)
    assert mod.spec == load_spec(text) and mod.spec.filename == str(path)
    assert mod.plan is mod.kernel.plan and mod.source == mod.kernel.source and "_attn_fwd" in mod.source
    assert sys.modules[f"{project.name}.attention.causal"] is mod
    for result in _check(mod, text, device):
        assert result.ok, verify.format_table("imported causal", [result])


def test_top_level_module_on_sys_path(project):
    """A .attn file directly in a sys.path directory imports as a top-level module."""
    path = project.root / f"{project.name}.attn"
    path.write_text((SPECS / "causal_softcap.attn").read_text())
    importlib.invalidate_caches()
    mod = importlib.import_module(project.name)
    assert mod.__file__ == str(path) and mod.spec.name == "causal_softcap"


def test_reload_recompiles_an_edited_spec(project, device):
    """causal.attn edited to a dense spec: the reloaded module's kernel matches the dense reference, which the
    causal kernel did not (so the check tells the two apart)."""
    causal = (SPECS / "causal.attn").read_text()
    dense = causal.replace("mask     = q_idx >= kv_idx\n", "")
    assert dense != causal
    path = project.write("attention/causal.attn", causal)
    mod = project.import_("attention.causal")
    before = mod.attention
    assert not all(r.ok for r in _check(mod, dense, device))
    path.write_text(dense)
    assert importlib.reload(mod) is mod
    assert mod.attention is not before and mod.spec == load_spec(dense) and mod.spec.mask is None
    for result in _check(mod, dense, device):
        assert result.ok, verify.format_table("reloaded dense", [result])


def test_spec_errors_name_the_attn_file_and_line(project):
    """A semantic error and a syntax error, at import and at reload: the error names the .attn file, line and
    column; a failed import leaves no module behind, a failed reload leaves the previous kernel."""
    path = project.write("attention/bad.attn", "attention bad {\n    head_dim = 64\n    mask     = q_idx - kv_idx\n}\n")
    with pytest.raises(SpecError, match=rf"^{re.escape(str(path))}:3:16: error: mask must be a boolean expression") as err:
        project.import_("attention.bad")
    assert "mask     = q_idx - kv_idx" in str(err.value) and f"{project.name}.attention.bad" not in sys.modules

    path = project.write("attention/causal.attn", (SPECS / "causal.attn").read_text())
    mod = project.import_("attention.causal")
    kernel = mod.attention
    path.write_text("attention causal {\n    head_dim = 128\n    mask = q_idx >= \n}\n")
    with pytest.raises(SpecSyntaxError, match=rf"^{re.escape(str(path))}:4:1: syntax error"):
        importlib.reload(mod)
    assert mod.attention is kernel and mod.spec.name == "causal"


def test_errors_without_a_place_name_the_file(project):
    """A spec that parses but cannot be planned (PlanError has no line): the error still names the file."""
    path = project.write("attention/big.attn", "attention big {\n    head_dim = 64\n    block_m = 256\n    block_n = 256\n    dtype = fp32\n}\n")
    with pytest.raises(PlanError, match=rf"^{re.escape(str(path))}: big: tiles"):
        project.import_("attention.big")


def test_python_module_takes_precedence(project):
    """causal.py beside causal.attn: the import is the Python module (Python's own finders come first)."""
    project.write("attention/causal.attn", (SPECS / "causal.attn").read_text())
    project.write("attention/causal.py", "FROM_PYTHON = True\n")
    mod = project.import_("attention.causal")
    assert mod.FROM_PYTHON and not hasattr(mod, "attention") and mod.__file__.endswith("causal.py")


def test_install_is_idempotent_and_uninstall_removes_the_finder(project, target):
    """One finder however often the hook is installed (the last options win); after uninstall, a .attn module
    is a missing module."""
    project.write("attention/causal.attn", (SPECS / "causal.attn").read_text())
    finder = attngen.install_import_hook(target="a100")
    assert attngen.install_import_hook(target="a100") is finder
    assert sum(isinstance(f, AttnFinder) for f in sys.meta_path) == 1
    assert project.import_("attention.causal").plan.target.name == "a100"
    attngen.uninstall_import_hook()
    assert not any(isinstance(f, AttnFinder) for f in sys.meta_path)
    project.write("attention/dense.attn", (SPECS / "dense.attn").read_text())
    with pytest.raises(ModuleNotFoundError, match="dense"):
        project.import_("attention.dense")


def test_unreadable_spec_is_an_attngen_error(project):
    """Bytes that are not UTF-8: the import fails with an AttngenError naming the file."""
    path = project.root / project.name / "attention" / "binary.attn"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\xff\xfe attention")
    importlib.invalidate_caches()
    with pytest.raises(AttngenError, match=f"^cannot read spec file {re.escape(str(path))}"):
        project.import_("attention.binary")
