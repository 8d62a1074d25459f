"""Triton's interpreter, made faster for the test suite without changing what it computes.

Two costs of Triton 3.6's interpreter that the kernels' results do not depend on:
- It re-patches triton.language at every call of a @triton.jit helper from inside a kernel
  (`InterpretedFunction.__call__` -> `_patch_lang`: `inspect.getmembers` over tl, tl.tensor and tl.math, then a new
  wrapper for each builtin), about 0.4 ms a call on CI's machine: an eighth of a dropout test's time. The patches it
  makes are the same at every call (they depend only on which of tl / tl.core the helper's module sees, and bind
  the one interpreter builder), so within one launch a helper call whose modules are patched already skips it.
  The launch itself (`GridExecutor.__call__`) still patches and restores as before.
- Every add, subtract and multiply of 32-bit integers is also done in int64 and compared with int32's range
  (`sanitize_overflow`), and the result dropped: the assertion it feeds is made only in debug mode, which is off.
  That is 40 % of a masked variant's time. The suite runs with it off; `overflow_checks()` turns it on, with debug
  mode so that it asserts, for the kernels of test_interpreter.py, which cover each kind of index arithmetic the
  templates emit (and show that the check fires).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect


def skip_repeated_patches() -> bool:
    """Install both shortcuts if the interpreter is the one they were written for; True if installed."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if triton.__version__ != "3.6.0" or getattr(interpreter, "_attngen_tests_patched", False):
        return False
    original_patch = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    # per launch in progress (innermost last): the language modules it patched, and the functions it saw
    patched: list[tuple[set, set]] = []

    def patch_lang(fn):
        if patched and id(fn) in patched[-1][1]:
            return interpreter._LangPatchScope()  # a helper called before in this launch: its modules are patched
        langs = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        if patched and langs <= patched[-1][0]:
            scope = interpreter._LangPatchScope()  # nothing to do: this launch patched these modules already
        else:
            scope = original_patch(fn)
        if patched:
            patched[-1][0].update(langs)
            patched[-1][1].add(id(fn))
        return scope

    def launch(self, *args, **kwargs):
        patched.append((set(), set()))
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    _set_overflow_checks(False)
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    interpreter._attngen_tests_patched = True
    return True


def _set_overflow_checks(on: bool) -> tuple:
    """The interpreter's int32 overflow checks (and debug mode, without which they assert nothing) on or off; the
    options they replace."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    was = builder.options
    builder.options = dataclasses.replace(was, sanitize_overflow=on, debug=on)
    return was


@contextlib.contextmanager
def overflow_checks():
    """The interpreter's int32 overflow checks on inside the block, asserting."""
    from triton.runtime import interpreter

    was = _set_overflow_checks(True)
    try:
        yield
    finally:
        interpreter.interpreter_builder.options = was
