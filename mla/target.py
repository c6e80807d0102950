"""Where the kernels run: the TileLang target and the per-target kernel configuration.

The same TileLang source serves every target; what differs per target lives here and only here:
the target dict, the fp8 flavour (e4m3fn on NVIDIA, e4m3fnuz on gfx942), the shared-memory / LDS budget and the
block sizes that fit it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

TARGET_ENV = "MLA_TARGET"  # force a target for lowering-only use: "sm_90a" or "gfx942"


@dataclass(frozen=True)
class TargetSpec:
    """Static facts about one compilation target."""

    name: str  # "sm_90a", "gfx942", ...
    tl_target: tuple  # TileLang target dict as sorted items (hashable); see ``target_dict``
    fp8_torch_dtype: torch.dtype
    fp8_tl_dtype: str  # TileLang dtype name of the same fp8 flavour
    smem_bytes: int  # shared memory (LDS) one CTA / workgroup may use
    warp_size: int
    num_sms: int  # multiprocessors / compute units, for the split heuristic

    @property
    def target_dict(self) -> dict:
        return dict(self.tl_target)

    @property
    def is_hip(self) -> bool:
        return self.target_dict["kind"] == "hip"


def _cuda_spec(arch: str, num_sms: int) -> TargetSpec:
    return TargetSpec(
        name=arch,
        tl_target=tuple(sorted({"kind": "cuda", "arch": arch}.items())),
        fp8_torch_dtype=torch.float8_e4m3fn,
        fp8_tl_dtype="float8_e4m3fn",
        smem_bytes=227 * 1024 if arch.startswith("sm_90") else 99 * 1024,
        warp_size=32,
        num_sms=num_sms,
    )


def _hip_spec(mcpu: str, num_sms: int) -> TargetSpec:
    fnuz = mcpu == "gfx942"  # gfx950 uses OCP e4m3fn like NVIDIA
    return TargetSpec(
        name=mcpu,
        tl_target=tuple(sorted({"kind": "hip", "mcpu": mcpu}.items())),
        fp8_torch_dtype=torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn,
        fp8_tl_dtype="float8_e4m3fnuz" if fnuz else "float8_e4m3fn",
        smem_bytes=64 * 1024 if mcpu == "gfx942" else 160 * 1024,
        warp_size=64,
        num_sms=num_sms,
    )


def spec_for_name(name: str, num_sms: int | None = None) -> TargetSpec:
    """TargetSpec for a target name such as "sm_90a" or "gfx942" (no device needed)."""
    if name.startswith("sm_"):
        return _cuda_spec(name, num_sms or 132)
    if name.startswith("gfx"):
        return _hip_spec(name, num_sms or 304)
    raise ValueError(f"unknown target {name!r}: expected 'sm_XY[a]' or 'gfxNNN'")


def spec_for_device(device: torch.device) -> TargetSpec:
    """TargetSpec for a torch device, or for $MLA_TARGET when that is set (cached: called on every op call)."""
    return _spec_for_device(device, os.environ.get(TARGET_ENV))


@functools.lru_cache(maxsize=None)
def _spec_for_device(device: torch.device, forced: str | None) -> TargetSpec:
    if forced:
        return spec_for_name(forced)
    if device.type != "cuda":
        raise ValueError(f"q: expected a CUDA/ROCm tensor (MLA decode runs on the GPU), got device {device}")
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        return _hip_spec(props.gcnArchName.split(":")[0], props.multi_processor_count)
    major, minor = props.major, props.minor
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")  # wgmma/setmaxnreg need the arch-specific sm_90a
    return _cuda_spec(arch, props.multi_processor_count)
