"""The code generators: each renders a plan into the source of a Python module of GPU kernels.

    codegen/triton/   portable Triton (every GPU from sm_75, and the CPU interpreter)
    codegen/gluon/    Gluon for Hopper (sm_90): warp-specialized, TMA rings, asynchronous wgmma

Both render from the same front end (the checked Spec, the expression IR, the tile classes), so they cannot
disagree on what a spec means; each keeps its templates in its own folder of the top-level templates/, and
templates/common/ holds the pieces both include (plain Triton kernels both modules launch).
This module holds what they share: finding and rendering templates, and the versions stamped in every module.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import sys
from pathlib import Path

import jinja2

from ..errors import AttngenError
from ..version import __version__


class TemplateError(AttngenError):
    """A template failed to render: an attngen bug, reported with the template's file and line."""


def templates_root() -> Path:
    """Installed wheels carry the templates inside the package; a source checkout has them at the top level."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / "triton" / "module.py.jinja").is_file():
            return candidate
    raise TemplateError(f"attngen's templates are missing (looked in {package / 'templates'} and {package.parent / 'templates'})")


def versions() -> dict[str, str]:
    out = {"attngen": __version__}
    for dist in ("triton", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


class Templates:
    """One generator's folder of templates: a strict Jinja environment over it, and its digest (part of every
    cache key, so editing a template invalidates what was rendered from it)."""

    SHARED = "common"  # templates both generators include, searched after a generator's own folder

    def __init__(self, folder: str, main: str, directory: Path | None = None):
        self.folder = folder
        self.main = main
        self.directory = directory  # another folder of this generator's templates (benchmarks/ab_templates.py)

    @property
    def path(self) -> Path:
        path = self.directory or templates_root() / self.folder
        if not (path / self.main).is_file():
            raise TemplateError(f"attngen's {self.folder} templates are missing ({path / self.main})")
        return path

    @functools.cached_property
    def environment(self) -> jinja2.Environment:
        return jinja2.Environment(
            loader=jinja2.FileSystemLoader([str(self.path), str(templates_root() / self.SHARED)]),
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
            autoescape=False,
        )

    @functools.cache  # noqa: B019 (one instance per generator, alive for the process)
    def digest(self) -> str:
        h = hashlib.sha256()
        for path in sorted(self.path.glob("*.jinja")) + sorted((templates_root() / self.SHARED).glob("*.jinja")):
            h.update(path.name.encode())
            h.update(path.read_bytes())
        return h.hexdigest()

    def render(self, name: str, values: dict) -> str:
        try:
            return self.environment.get_template(name).render(**values)
        except jinja2.TemplateSyntaxError as err:
            raise TemplateError(f"{err.filename or err.name}:{err.lineno}: {err.message}") from err
        except jinja2.TemplateError as err:
            tb = sys.exc_info()[2]
            where = ""
            while tb is not None:
                if tb.tb_frame.f_code.co_filename.endswith(".jinja"):
                    where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}: "
                tb = tb.tb_next
            raise TemplateError(f"{where}{err}") from err
