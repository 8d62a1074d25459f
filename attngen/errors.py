"""Typed errors. Every error a user can cause says where (file:line:col) and what was expected."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A region of spec text: 1-based line and column of its start and end (end exclusive)."""

    line: int
    col: int
    end_line: int
    end_col: int


class AttngenError(Exception):
    """Base class of every error attngen raises on purpose."""


class SourceError(AttngenError):
    """An error tied to a place in a spec's text; formats as `file:line:col: message` plus a caret excerpt."""

    kind = "error"

    def __init__(self, message: str, span: Span | None = None, text: str | None = None, filename: str | None = None):
        self.message = message
        self.span = span
        self.text = text
        self.filename = filename or "<spec>"
        super().__init__(self.render())

    def with_source(self, text: str, filename: str | None) -> "SourceError":
        """The same error, attached to the spec text it came from (errors are raised deep, text is known on top)."""
        err = type(self).__new__(type(self))
        SourceError.__init__(err, self.message, self.span, text, filename or self.filename)
        return err

    def render(self) -> str:
        if self.span is None:
            return f"{self.filename}: {self.kind}: {self.message}"
        head = f"{self.filename}:{self.span.line}:{self.span.col}: {self.kind}: {self.message}"
        if self.text is None:
            return head
        lines = self.text.splitlines()
        if not 1 <= self.span.line <= len(lines):
            return head
        src = lines[self.span.line - 1].expandtabs(1)
        width = 1
        if self.span.end_line == self.span.line:
            width = max(1, self.span.end_col - self.span.col)
        caret = " " * (self.span.col - 1) + "^" * min(width, max(1, len(src) - self.span.col + 1))
        return f"{head}\n    {src}\n    {caret}"

    def __str__(self) -> str:  # the message may have gained its source after construction
        return self.render()


class SpecSyntaxError(SourceError):
    """The text does not follow the grammar."""

    kind = "syntax error"


class SpecError(SourceError):
    """The text parses but means nothing valid: unknown setting, wrong type, value out of range, ..."""

    kind = "error"


class PlanError(AttngenError):
    """The spec is valid but cannot be planned for the target (too little SRAM, dtype unsupported, ...)."""


class InputError(AttngenError, ValueError):
    """Tensors handed to a kernel at call time do not match its spec."""


class BundleError(AttngenError):
    """An ahead-of-time bundle cannot be built, or (strict=True) cannot be used as built."""
