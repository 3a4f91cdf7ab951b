"""Caps: what one CUDA device can do, filled in once by the runtime. The only place an
architecture name is tested: every kernel choice reads these fields (pydflash.linear.dispatch,
the attention launcher, the programmatic launches), never the arch string itself.

ARCHS is the table of the generations pydflash knows and what each one enables. A device of
another generation (sm_100, a future one) runs the generic paths, the ones sm_80 runs, until
its row says otherwise: that row is where a new architecture opts in to wgmma, tensor-map
copies or programmatic dependent launch, after its kernels were measured there.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ArchFacts:
    """What a generation offers the kernels (measured, not assumed)."""

    wgmma: bool = False  # warpgroup MMAs: the arch-specific target (sm_90a) compiles them
    tma: bool = False  # tensor-map (TMA) copies in the wgmma tiles
    pdl: bool = False  # programmatic dependent launch (measured on sm_90 only)
    smem_per_block: int = 99 * 1024  # opt-in shared memory a block, for synthetic Caps
    smem_per_sm: int = 100 * 1024


ARCHS: dict[str, ArchFacts] = {
    "sm_80": ArchFacts(smem_per_block=163 * 1024, smem_per_sm=164 * 1024),  # A100
    "sm_86": ArchFacts(smem_per_block=99 * 1024, smem_per_sm=100 * 1024),
    "sm_89": ArchFacts(smem_per_block=99 * 1024, smem_per_sm=100 * 1024),  # L40S, RTX 40
    "sm_90": ArchFacts(  # H100 / H200: wgmma, TMA and PDL were measured here
        wgmma=True, tma=True, pdl=True, smem_per_block=227 * 1024, smem_per_sm=228 * 1024
    ),
    "sm_120": ArchFacts(smem_per_block=99 * 1024, smem_per_sm=100 * 1024),  # RTX 50
}
GENERIC = ArchFacts()  # an architecture not in the table: the sm_80 paths


@dataclasses.dataclass(frozen=True)
class Caps:
    """One device's capabilities (Runtime.caps)."""

    arch: str  # "sm_90"
    name: str  # the device's name
    sm_count: int
    smem_per_block: int  # opt-in dynamic shared memory a block
    smem_per_sm: int  # shared memory an SM holds for its resident blocks
    wgmma: bool  # the wgmma tiles can run (ArchFacts.wgmma)
    tma: bool  # ... fed by TMA: the arch has it, and the driver encodes tensor maps and
    # launches kernels taking them (cuLaunchKernelEx)
    pdl: bool  # programmatic dependent launch is taken
    known: bool  # the arch is in ARCHS (else the generic paths)

    @property
    def arch_target(self) -> str:
        """NVRTC's target for the arch-specific families ("sm_90a"; the wgmma kernels)."""
        return self.arch + "a"

    @classmethod
    def of(
        cls,
        major: int,
        minor: int,
        name: str,
        sm_count: int,
        smem_per_block: int,
        smem_per_sm: int,
        *,
        tensor_maps: bool,
    ) -> Caps:
        """The capabilities of a device of compute capability (major, minor); tensor_maps:
        the driver encodes tensor maps and launches kernels that take them."""
        arch = f"sm_{major}{minor}"
        facts = ARCHS.get(arch, GENERIC)
        return cls(
            arch=arch,
            name=name,
            sm_count=int(sm_count),
            smem_per_block=int(smem_per_block),
            smem_per_sm=int(smem_per_sm),
            wgmma=facts.wgmma,
            tma=facts.tma and facts.wgmma and bool(tensor_maps),
            pdl=facts.pdl,
            known=arch in ARCHS,
        )

    @classmethod
    def synthetic(cls, arch: str, sm_count: int = 132, *, tensor_maps: bool = True) -> Caps:
        """The capabilities a device of `arch` would have (the table's shared memory): for
        dispatch decisions and tests on a machine without that device."""
        facts = ARCHS.get(arch, GENERIC)
        major, minor = divmod(int(arch.removeprefix("sm_")), 10)
        return cls.of(
            major,
            minor,
            f"synthetic {arch}",
            sm_count,
            facts.smem_per_block,
            facts.smem_per_sm,
            tensor_maps=tensor_maps,
        )


def caps_of(rt: Any) -> Caps:
    """The Caps of a runtime (or of anything carrying .caps)."""
    return rt.caps
