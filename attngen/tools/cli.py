"""attngen build | plan | targets | check | bench | tune | plot | --version. Spec errors print file:line:col with a caret and exit 2."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..errors import AttngenError, PlanError, SourceError

EXIT_SPEC = 2


@contextlib.contextmanager
def _in_file(spec):
    """A PlanError raised while planning `spec` names its file (as `attngen build` does), not only the spec."""
    try:
        yield
    except PlanError as err:
        if not spec.filename:
            raise
        raise PlanError(f"{spec.filename}: {str(err).removeprefix(spec.name + ': ')}") from None


def _specs(paths: list[str]):
    from ..lang.check import read_spec

    return [read_spec(Path(p)) for p in paths]


def cmd_targets(args) -> int:
    from ..targets import TARGETS

    print(f"{'name':<11}{'GPU':<26}{'sm':>5}{'SMs':>6}{'smem/SM':>10}{'smem/block':>12}  bf16  note")
    for t in TARGETS.values():
        # listed for reference, but `plan` and `build` refuse it (PlanError): say so where the user looks
        note = f"unsupported: {t.unsupported}" if t.unsupported else ""
        print(f"{t.name:<11}{t.full_name:<26}{t.arch:>5}{t.sm_count:>6}{t.smem_per_sm // 1024:>8}KB{t.smem_per_block // 1024:>10}KB  "
              f"{'yes' if t.supports_bf16 else 'no':<4}  {note}".rstrip())
    print("\nsources: CUDA C++ Programming Guide (compute capability tables) and each GPU's whitepaper; `attngen targets -v` lists them")
    if args.verbose:
        for t in TARGETS.values():
            print(f"  {t.name}: " + "; ".join(t.sources))
    return 0


MAX_MAP_TILES = 1 << 16  # `attngen plan --seq`: the largest tile map drawn (256 x 256 tiles)


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def cmd_plan(args) -> int:
    from ..codegen.gluon import choose
    from ..lang.intervals import TileClass, classify_tiles, tile_counts, tile_map
    from ..plan.planner import plan

    for spec in _specs(args.spec):
        with _in_file(spec):
            p = plan(spec, args.target)
        choice = choose(spec, p)
        print(p.describe())
        print(f"\ngenerator: {choice.describe()}")
        if choice.gluon is not None:
            print(choice.gluon.describe())
        if args.seq and spec.sparsity != "runtime":
            from ..plan.decode import decode_shape

            kv_len = args.kv_seq or args.seq
            print(f"\ndecode over {kv_len} keys a sequence ({p.target.name}, {p.target.sm_count} SMs; rows: the query heads of a "
                  f"key/value head x the new tokens):")
            for batch, heads, kv_heads, q_len in ((1, 32, 8, 1), (8, 32, 8, 1), (64, 32, 8, 1), (8, 32, 8, 16)):
                print(f"  B={batch} Hq={heads} Hkv={kv_heads} Nq={q_len}: {decode_shape(p, batch, heads, kv_heads, q_len, kv_len).describe()}")
        if args.seq and spec.kv_layout.value == "contiguous":
            q_len, kv_len = args.seq, args.kv_seq or args.seq
            tiles = -(-q_len // p.block_m) * -(-kv_len // p.block_n)
            if tiles > MAX_MAP_TILES:
                print(f"\ntile classes at q_len={q_len}, kv_len={kv_len}: {tiles} tiles, more than the {MAX_MAP_TILES} a map draws "
                      f"(take a shorter --seq; the classes repeat along the diagonal)")
                continue
            classes = classify_tiles(p.mask, q_len, kv_len, p.block_m, p.block_n)
            counts = tile_counts(classes)
            total = sum(counts.values())
            print(f"\ntile classes at q_len={q_len}, kv_len={kv_len} (BLOCK_M={p.block_m} x BLOCK_N={p.block_n}; "
                  f"rows: query tiles, columns: key tiles; # full, + partial, . empty):")
            print(tile_map(classes))
            print(f"full {counts[TileClass.FULL]}, partial {counts[TileClass.PARTIAL]}, empty {counts[TileClass.EMPTY]} "
                  f"of {total} tiles; {100 * (total - counts[TileClass.EMPTY]) / total:.1f}% must be visited")
            print("(proved by interval analysis of the mask: the kernels skip empty tiles and run full ones without masking;\n"
                  " parts of a mask that read inputs are undecided here, so such tiles count as partial; the kernels\n"
                  " decide them at run time from the inputs' per-chunk minima and maxima)")
            if p.block_lists:
                print("(the Triton kernels walk the block pattern's kept blocks as lists, made once per call sizes from the\n"
                      " pattern: a row visits its kept tiles only, none of the empty ones between them)")
    return 0


def cmd_build(args) -> int:
    from ..aot import build

    # Everything is planned before anything is compiled, and the output directory is replaced only when the whole
    # build succeeded: an error leaves it as it was.
    manifest = build(args.spec, args.target, args.output, jobs=args.jobs, binaries=not args.no_binaries, progress=not args.quiet)
    built = {(s.name) for s in _specs(args.spec)}
    for e in manifest["entries"]:
        if e["name"] not in built or e["target"] not in {t.lower() for t in args.target}:
            continue
        f = e["plan"]["forward"]
        kernels = f"{len(e['kernels'])} binaries for sm_{e['arch']}" if e["kernels"] else "no binaries (--no-binaries)"
        print(f"wrote {Path(args.output) / e['module']['path']}  (fwd {f['block_m']}x{f['block_n']}, {f['num_warps']} warps, "
              f"{f['num_stages']} stages; {e['plan']['loop_order']}) + {kernels}")
        gluon = e.get("gluon")
        if gluon is not None:
            passes = " and ".join(p for p in ("forward", "backward") if gluon[p] == "gluon")
            kernels = f"{len(gluon['kernels'])} binaries for sm_{e['arch']}" if gluon["kernels"] else "no binaries (--no-binaries)"
            print(f"wrote {Path(args.output) / gluon['module']['path']}  (the Gluon generator's {passes}) + {kernels}")
    print(f"bundle {args.output}: {len(manifest['entries'])} spec/target entries; load it with attngen.load({str(args.output)!r}"
          f"{', name' if len({e['name'] for e in manifest['entries']}) > 1 else ''})")
    return 0


def cmd_check(args) -> int:
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by attngen.runtime)
    from dataclasses import replace

    import torch

    from ..lang.spec import DType
    from ..runtime import compile as compile_spec
    from . import verify

    if args.device == "cuda" and not torch.cuda.is_available():
        print("attngen check: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 1
    shapes = verify.CUDA_SHAPES if args.device == "cuda" else verify.CPU_SHAPES
    if args.quick:
        shapes = shapes[:3]
    runs = [(spec, args.dtype or [spec.dtype.value]) for spec in _specs(args.spec)]
    # One line per case on stderr before it runs (a case takes seconds in the interpreter, the tables come at the end)
    total, done = sum(len(dtypes) for _, dtypes in runs) * len(shapes), 0
    failed = 0
    for spec, dtypes in runs:
        results = []
        for dtype in dtypes:
            with _in_file(spec):
                kernel = compile_spec(replace(spec, dtype=DType(dtype)), args.target or ("h100" if args.device == "cpu" else None))
            for shape in shapes:
                done += 1
                print(f"attngen check [{done}/{total}]: {spec.filename or spec.name}, {dtype}, (B,Hq,Hkv,Nq,Nk) = {shape} on {args.device}",
                      file=sys.stderr, flush=True)
                results.append(verify.check_one(kernel, shape, args.device))
        # flushed: piped into one log with the progress lines, each table lands after its own cases
        print(verify.format_table(f"\n{spec.filename or spec.name} on {args.device}", results), flush=True)
        failed += sum(not r.ok for r in results)
    print(f"\n{'all passed' if not failed else f'{failed} case(s) FAILED'}")
    return 1 if failed else 0


TRAIN_SEQS = [1024, 4096, 16384]  # attngen bench / tune: sequence lengths
DECODE_SEQS = [4096, 8192, 32768, 131072]  # attngen bench --decode: keys per sequence


def cmd_gpu(args) -> int:
    """attngen bench / attngen tune: exit 1 with the reason when they cannot run (no GPU, a bad --head-dim)."""
    from . import bench

    try:
        if args.command == "bench" and args.decode:
            from . import bench_decode

            bench_decode.run(args.spec, args.seq or DECODE_SEQS, args.batch, args.queries, heads=args.heads, kv_heads=args.kv_heads,
                             head_dim=(args.head_dim or [128])[0], json_path=args.json, plot_path=args.plot)
        elif not args.spec:
            print(f"attngen {args.command}: name at least one .attn file{' (or --decode: a decoding benchmark)' if args.command == 'bench' else ''}",
                  file=sys.stderr)
            return 2
        elif args.command == "bench":
            bench.run(args.spec, args.seq or TRAIN_SEQS, json_path=args.json, dtype=args.dtype, head_dims=args.head_dim, tune=args.tune,
                      plot_path=args.plot)
        else:
            bench.tune_report(args.spec, args.seq or TRAIN_SEQS, json_path=args.json, dtype=args.dtype, head_dims=args.head_dim)
    except RuntimeError as err:
        print(f"attngen {args.command}: {err}", file=sys.stderr)
        return 1
    return 0


def cmd_plot(args) -> int:
    """attngen plot: the charts of a saved `attngen bench --json` file, on any machine with matplotlib."""
    import json

    from . import bench

    try:
        results = json.loads(Path(args.results).read_text())
    except (OSError, ValueError) as err:
        print(f"attngen plot: cannot read {args.results}: {err}", file=sys.stderr)
        return 1
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        print(f"attngen plot: {args.results} is not an `attngen bench --json` file (no \"rows\" list)", file=sys.stderr)
        return 1
    try:
        bench.plot(results, args.output)
    except RuntimeError as err:  # no matplotlib, no rows
        print(f"attngen plot: {err}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, AttributeError) as err:  # a row without the fields bench writes, or not a record
        print(f"attngen plot: {args.results}: malformed row ({err!r})", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


class _Version(argparse.Action):
    """--version: attngen's version and the Triton and torch it runs with (looked up only when asked: the lookup
    imports the renderer, which every other command would pay for)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from ..codegen import versions

        v = versions()
        print(f"attngen {v['attngen']} (Triton {v['triton']}, torch {v['torch']})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attngen", description="Compile .attn attention specs into Triton kernels.")
    parser.add_argument("--version", action=_Version, help="print the versions of attngen, Triton and torch and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="build an ahead-of-time bundle: generated modules and GPU binaries for targets (no GPU needed)")
    p.add_argument("spec", nargs="+", help=".attn files")
    p.add_argument("--target", action="append", required=True, help="GPU name from `attngen targets` (repeatable)")
    p.add_argument("-o", "--output", default="build", help="bundle directory (default: ./build); attngen.load(DIR) loads it")
    p.add_argument("-j", "--jobs", type=int, default=None, help="compiler processes (default: one per CPU core)")
    p.add_argument("--no-binaries", action="store_true", help="only the generated modules and the manifest (fast; the kernels compile at first use)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("plan", help="print the tiling plan and its derivation from the target's SRAM")
    p.add_argument("spec", nargs="+")
    p.add_argument("--target", default=None, help="GPU name (default: the spec's target)")
    p.add_argument("--seq", type=_positive, default=None, help="also print the tile-class map for this query length")
    p.add_argument("--kv-seq", type=_positive, default=None, help="key length for the map (default: --seq)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("targets", help="list the known GPUs")
    p.add_argument("-v", "--verbose", action="store_true", help="show the source of each figure")
    p.set_defaults(func=cmd_targets)

    p = sub.add_parser("check", help="run kernels against the naive reference over a matrix of shapes")
    p.add_argument("spec", nargs="+")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu runs Triton's interpreter")
    p.add_argument("--dtype", action="append", choices=("fp16", "bf16", "fp32"), help="dtypes to check (default: the spec's)")
    p.add_argument("--target", default=None, help="plan for this GPU (default: h100 on cpu, the live device on cuda)")
    p.add_argument("--quick", action="store_true", help="only the three smallest shapes")
    p.set_defaults(func=cmd_check)

    for name, help_text in (("bench", "time the kernels against FlexAttention and torch SDPA on this GPU"),
                            ("tune", "tune the tiles of specs on this GPU (every key auto), fill the tuning cache, print derived vs tuned")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("spec", nargs="*")
        p.add_argument("--seq", type=int, nargs="+", default=None, help=f"sequence lengths (B = 16384 // N tokens per batch; default "
                                                                      f"{' '.join(map(str, TRAIN_SEQS))}); with --decode: keys per sequence "
                                                                      f"(default {' '.join(map(str, DECODE_SEQS))})")
        p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default=None, help="override the spec's dtype")
        p.add_argument("--head-dim", type=int, nargs="+", default=None, help="run each spec at these head dims instead of its own (e.g. 64 128)")
        p.add_argument("--json", default=None, help="also write the results to this file")
        if name == "bench":
            p.add_argument("--tune", action="store_true", help="tune attngen's tiles (every key auto) and time the derived tiles beside them")
            p.add_argument("--plot", default=None, metavar="OUT.png", help="also draw the table as bar charts (needs matplotlib)")
            p.add_argument("--decode", action="store_true", help="decoding instead: a few queries per sequence against a key/value cache, "
                                                                 "contiguous and paged, GB/s against the copy rate and FlexAttention (default spec: "
                                                                 "causal over each sequence's cache)")
            p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="--decode: sequences per call (default 1 8 64)")
            p.add_argument("--queries", type=int, nargs="+", default=[1], help="--decode: new tokens per sequence (default 1; 16: speculative)")
            p.add_argument("--heads", type=int, default=32, help="--decode: query heads (default 32)")
            p.add_argument("--kv-heads", type=int, default=8, help="--decode: key/value heads (default 8)")
        p.set_defaults(func=cmd_gpu)

    p = sub.add_parser("plot", help="draw a saved `attngen bench --json` file as bar charts (needs matplotlib)")
    p.add_argument("results", help="the JSON file of attngen bench --json")
    p.add_argument("-o", "--output", default="bench.png", help="image file (default: bench.png; the suffix picks the format)")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # `attngen` (or `python -m attngen`) alone: the full help
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SourceError as err:
        print(err, file=sys.stderr)
        return EXIT_SPEC
    except PlanError as err:
        print(f"attngen: cannot plan: {err}", file=sys.stderr)
        return EXIT_SPEC
    except AttngenError as err:
        print(f"attngen: {err}", file=sys.stderr)
        return EXIT_SPEC


if __name__ == "__main__":
    sys.exit(main())
