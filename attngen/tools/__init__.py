"""What a user runs around the kernels: the command line (cli.py), the naive reference (reference.py), the check of
a kernel against it (verify.py, `attngen check`) and the benchmarks against its peers (bench.py, bench_decode.py)."""
