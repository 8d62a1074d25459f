"""GPU targets: on-chip memory, SM count and compute capability, each figure with its source.

Shared memory per block is the opt-in maximum a kernel may request (cudaFuncAttributeMaxDynamicSharedMemorySize),
which is what Triton plans against. Sources: NVIDIA CUDA C++ Programming Guide, "Technical Specifications per
Compute Capability" (shared memory per SM and per block), and each GPU's architecture whitepaper or datasheet
(SM counts).
"""
from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
# Triton 3.6 (the version attngen pins and its kernels are written against) generates code for compute
# capability 7.5 (Turing) and newer; older GPUs stay in the table for reference but cannot be planned for.
TRITON = "3.6"
MIN_COMPUTE_CAPABILITY = (7, 5)
_GUIDE = "CUDA C++ Programming Guide, Compute Capabilities: technical specifications (cc {cc})"


@dataclass(frozen=True)
class Target:
    name: str
    full_name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_sm: int  # bytes
    smem_per_block: int  # bytes, opt-in maximum for one block
    registers_per_sm: int = 65536  # 32-bit registers; 64K on every architecture listed
    sources: tuple[str, ...] = ()

    @property
    def arch(self) -> int:
        major, minor = self.compute_capability
        return major * 10 + minor

    @property
    def supports_bf16(self) -> bool:
        return self.compute_capability >= (8, 0)

    @property
    def unsupported(self) -> str | None:
        """Why attngen cannot build for this GPU (None if it can)."""
        if self.compute_capability >= MIN_COMPUTE_CAPABILITY:
            return None
        major, minor = MIN_COMPUTE_CAPABILITY
        return f"Triton {TRITON} needs sm_{major}{minor}+"


def _t(name, full, cc, sms, smem_sm_kib, smem_block_kib, sm_source):
    return Target(
        name=name,
        full_name=full,
        compute_capability=cc,
        sm_count=sms,
        smem_per_sm=smem_sm_kib * KIB,
        smem_per_block=smem_block_kib * KIB,
        sources=(_GUIDE.format(cc=f"{cc[0]}.{cc[1]}"), sm_source),
    )


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        _t("t4", "NVIDIA T4", (7, 5), 40, 64, 64, "NVIDIA Turing architecture whitepaper / T4 datasheet: 40 SMs"),
        _t("v100", "NVIDIA V100 SXM2", (7, 0), 80, 96, 96, "NVIDIA Tesla V100 GPU architecture whitepaper: 80 SMs"),
        _t("a100", "NVIDIA A100 SXM4", (8, 0), 108, 164, 163, "NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs"),
        _t("a10g", "NVIDIA A10G", (8, 6), 80, 100, 99, "AWS EC2 G5 documentation / NVIDIA A10G: 80 SMs"),
        _t("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 82, 100, 99, "NVIDIA Ampere GA102 GPU architecture whitepaper: 82 SMs"),
        _t("l4", "NVIDIA L4", (8, 9), 58, 100, 99, "NVIDIA Ada GPU architecture whitepaper / L4 datasheet: 58 SMs"),
        _t("l40s", "NVIDIA L40S", (8, 9), 142, 100, 99, "NVIDIA L40S datasheet: 142 SMs"),
        _t("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 128, 100, 99, "NVIDIA Ada GPU architecture whitepaper: 128 SMs"),
        _t("h100", "NVIDIA H100 SXM5", (9, 0), 132, 228, 227, "NVIDIA H100 Tensor Core GPU architecture whitepaper: 132 SMs (SXM5); 132 read off the lent H100"),
        _t("h100-pcie", "NVIDIA H100 PCIe", (9, 0), 114, 228, 227, "NVIDIA H100 Tensor Core GPU architecture whitepaper: 114 SMs (PCIe)"),
        _t("h200", "NVIDIA H200 SXM", (9, 0), 132, 228, 227, "NVIDIA H200 datasheet (GH100, as H100 SXM5): 132 SMs"),
    )
}


def get_target(name: str) -> Target:
    from .errors import PlanError

    key = name.lower()
    if key in TARGETS:
        return supported(TARGETS[key])
    raise PlanError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)} (or auto)")


def supported(target: Target) -> Target:
    """The target, if Triton can build for it; else a PlanError that says why (before anything is generated: a
    kernel planned for it would only fail later, in Triton's compiler)."""
    from .errors import PlanError

    if target.unsupported:
        cc = ".".join(map(str, target.compute_capability))
        need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
        raise PlanError(f"{target.full_name} ({target.name}) is compute capability {cc} (sm_{target.arch}): Triton {TRITON}, which attngen's "
                        f"kernels are written for, builds for {need} (sm_{MIN_COMPUTE_CAPABILITY[0]}{MIN_COMPUTE_CAPABILITY[1]}) and newer; "
                        f"pick a newer target (`attngen targets` marks the unsupported ones)")
    return target


def detect() -> Target:
    """The live CUDA device as a Target: its own figures, named after the table's entry when one matches."""
    import torch

    from .errors import PlanError

    if not torch.cuda.is_available():
        raise PlanError("target = auto needs a CUDA device and none is visible; name one with --target / target= (see `attngen targets`)")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    cc = (props.major, props.minor)
    smem_block = getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 48 * KIB)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or smem_block
    name = props.name.lower()
    best = None
    for t in TARGETS.values():
        if t.compute_capability == cc and t.sm_count == props.multi_processor_count:
            best = t
            break
    key = best.name if best else "cuda-" + "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")
    return supported(Target(
        name=key,
        full_name=props.name,
        compute_capability=cc,
        sm_count=props.multi_processor_count,
        smem_per_sm=smem_sm,
        smem_per_block=smem_block,
        sources=("read from the live device (torch.cuda.get_device_properties)",),
    ))
