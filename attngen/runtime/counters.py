"""Buffers that kernels share across launches on one stream: counters, zero before a launch and put back to zero
by the launch itself (the persistent forward's ticket counter, the decode kernel's count of arrived splits), and
scratch memory that a call's launches write and read back themselves (the decode kernel's partial results, the
Gluon backward's pre-pass results and dQ's float32 sum).

The launches on one stream run one after another, so they can share these; launches on other streams, which may
run at the same time, get their own. Two CUDA graphs captured on one stream share its buffers too: replay them on
one stream (as torch.compile's CUDA graphs do), not on two at once.
"""
from __future__ import annotations

import threading

import torch

_BUFFERS: dict[tuple, torch.Tensor] = {}  # (name, element type, device, stream) -> its buffer
_OUTGROWN: list[torch.Tensor] = []  # buffers replaced by larger ones (at most about the size of the last: each doubles)


def stream_counters(name: str, device: torch.device, size: int) -> torch.Tensor:
    """At least `size` int32 counters named `name` for `device`'s current stream, zero wherever no launch is
    under way (a launch that takes them puts them back to zero). Made once per stream (again, larger, when a
    call needs more: the new ones are zero too)."""
    return _stream_buffer(name, device, size, torch.int32, torch.zeros)


def stream_scratch(name: str, device: torch.device, size: int) -> torch.Tensor:
    """At least `size` float32 elements of scratch memory named `name` for `device`'s current stream, for a launch
    that writes them and reads them back itself (never holding anything between launches)."""
    return _stream_buffer(name, device, size, torch.float32, torch.empty)


def stream_carve(name: str, device: torch.device, layout: tuple) -> list[torch.Tensor]:
    """Tensors of `layout` ((size, strides, element type) each), one after another in the scratch memory `name` of
    `device`'s current stream (stream_scratch), each at a 256-byte boundary: for a call's launches on that stream
    that write them and read them back, holding nothing once the call's work is queued."""
    places, total = [], 0
    for size, strides, dtype in layout:
        extent = 1 + sum((n - 1) * s for n, s in zip(size, strides)) if all(size) else 0
        words = -(-extent * dtype.itemsize // 4)  # float32 elements of scratch
        places.append((total, words))
        total += -(-words // 64) * 64
    buffer = stream_scratch(name, device, max(total, 1))
    return [buffer[at:at + words].view(dtype).as_strided(size, strides) for (at, words), (size, strides, dtype) in zip(places, layout)]


def stream_of(device: torch.device) -> int:
    """The device's current stream as a number (its raw handle; 0 on the CPU), by which the buffers are kept.
    (torch.cuda.current_stream took 10 us.)"""
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


def _stream_buffer(name: str, device: torch.device, size: int, dtype: torch.dtype, make_with) -> torch.Tensor:
    key = (name, dtype, device, stream_of(device))  # (a kind's counters and scratch memory are two buffers)
    buffer = _BUFFERS.get(key)
    if buffer is None or buffer.numel() < size:
        numel = max(size, 2 * buffer.numel() if buffer is not None else 1)
        make = lambda: make_with(numel, dtype=dtype, device=device)  # noqa: E731
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if buffer is not None:  # kept: a launch queued on the stream may still use it (the new one is made on another thread)
            _OUTGROWN.append(buffer)
        buffer = _BUFFERS[key] = make() if device.type != "cuda" or capturing else _outside_graph_pools(make, device)
    return buffer


def _outside_graph_pools(make, device: torch.device) -> torch.Tensor:
    """make()'s tensor, made on a thread of its own and waited for. torch.compile's CUDA graphs (mode
    reduce-overhead) send every allocation of the thread that runs a graph's first calls into the graph's memory
    pool, and stop with "tensor(s) in the cudagraph pool not tracked as outputs" where one stays alive there
    that the graph does not return: these buffers outlive every graph. (While a stream is captured, they are made
    in the capture: a graph replays the counters' zeroing.)"""
    made = []
    thread = threading.Thread(target=lambda: made.append(make()) or torch.cuda.synchronize(device))
    thread.start()
    thread.join()
    if not made:
        raise RuntimeError(f"could not allocate a stream's buffer on {device}")
    return made[0]
