"""The language: `.attn` text to a validated Spec.

    grammar.lark, syntax.py   the text parsed into nodes that carry their spans (SpecSyntaxError)
    check.py                  the nodes checked into a typed, frozen Spec (SpecError at file:line:col)
    spec.py                   the Spec and the expression nodes (no torch, no triton)
    expr.py                   the expression IR: variables, functions, typing, traversal, printing
    algebra.py, analysis.py   constant folding and derivatives; signs, affinity, separable biases
    ranges.py, intervals.py   integer ranges over every accepted call; intervals and tile classes over a tile
    canonical.py              the canonical text and hash of a Spec
"""
