"""Devices a placement may use: explicit specs, capacities read from the machine, and
the distance between two devices."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ._estimator import MB
from ._validate import _check_number

__all__ = ["DeviceSpec", "DeviceLike"]


def _parse_device(value: object, name: str) -> torch.device:
    """Turns a device string or ``torch.device`` into a canonical cpu/cuda device.

    ``"cpu:0"`` becomes ``cpu`` and ``"cuda"`` becomes ``cuda:<current device>`` (index 0
    on a machine without CUDA), so one device has one spelling.
    """
    if isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError as e:
            raise ValueError(
                f"{name}: {value!r} is not a device string; use e.g. 'cpu' or 'cuda:0'"
            ) from e
    elif isinstance(value, torch.device):
        device = value
    else:
        raise TypeError(
            f"{name} must be a torch.device, a device string or a DeviceSpec, "
            f"got {type(value).__name__}"
        )
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if device.index is not None:
            return device
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    raise ValueError(
        f"{name}: device type {device.type!r} ({value!r}) is not supported; "
        "the assigner places models on 'cpu' and 'cuda:N' devices"
    )


@dataclass(frozen=True)
class DeviceSpec:
    """A device with its capacity given explicitly instead of read from the machine.

    A spec is used exactly as given, even for a CUDA device this machine does not have,
    so a placement can be planned (and tested) anywhere; ``max_mem_ratio`` of the
    assigner still applies to ``memory``.

    Args:
        device: ``"cpu"``, ``"cuda:N"`` or a ``torch.device`` of those types.
        memory: Free memory of the device in MB (``2**20`` bytes).
        compute: Compute power relative to one GPU (1.0); 0 means the device should do
            no computation (see :class:`ModelAssigner` for how that is weighed).

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: Unknown device string or type, or negative/non-finite numbers.
    """

    device: torch.device
    memory: float
    compute: float = 1.0

    def __post_init__(self) -> None:
        # frozen: normalise the fields in place once, at construction
        object.__setattr__(self, "device", _parse_device(self.device, "DeviceSpec.device"))
        object.__setattr__(self, "memory", _check_number(self.memory, "DeviceSpec.memory"))
        object.__setattr__(self, "compute", _check_number(self.compute, "DeviceSpec.compute"))


DeviceLike = Union[DeviceSpec, torch.device, str]


def _cgroup_room_bytes() -> Optional[int]:
    """Bytes left under this process's cgroup v2 memory limit, None when unlimited."""
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)


def _cpu_available_mb() -> float:
    """Memory the OS could give this process without swapping, in MB.

    ``MemAvailable`` of ``/proc/meminfo``, lowered to the room left under a container's
    cgroup limit (``/proc/meminfo`` shows the host's memory); elsewhere the free pages
    from ``os.sysconf``.
    """
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            # free pages only (no reclaimable cache): an underestimate, the safe side
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError) as e:
            raise RuntimeError(
                "cannot read the available CPU memory on this system; "
                "pass devices=[DeviceSpec('cpu', memory=<MB>), ...] instead"
            ) from e
    room = _cgroup_room_bytes()
    return (available if room is None else min(available, room)) / MB


def _cuda_specs(indices: Sequence[int]) -> list[DeviceSpec]:
    """Reads free memory and compute power of visible CUDA devices.

    Compute power is the multiprocessor count relative to the largest visible GPU, so
    the strongest GPU has 1.0 as in machin, which assumed identical GPUs.
    """
    if not indices:
        return []
    count = torch.cuda.device_count()
    sms = [torch.cuda.get_device_properties(i).multi_processor_count for i in range(count)]
    strongest = max(sms)
    specs = []
    for i in indices:
        free_bytes, _total = torch.cuda.mem_get_info(i)
        specs.append(DeviceSpec(torch.device("cuda", i), free_bytes / MB, sms[i] / strongest))
    return specs


def _resolve_devices(
    devices: Optional[Sequence[DeviceLike]], cpu_weight: float
) -> list[DeviceSpec]:
    """Turns the ``devices`` argument of the assigner into specs with capacities."""
    if devices is None:
        count = torch.cuda.device_count()
        if count:
            return _cuda_specs(range(count))
        return [DeviceSpec(torch.device("cpu"), _cpu_available_mb(), cpu_weight)]
    if isinstance(devices, (str, torch.device, DeviceSpec)) or not isinstance(
        devices, Sequence
    ):
        raise TypeError(
            "devices must be a list of devices (str, torch.device or DeviceSpec) or None, "
            f"got {type(devices).__name__}"
        )
    if not devices:
        raise ValueError("devices is empty; pass None to use the machine's devices")
    specs: list[Optional[DeviceSpec]] = []
    wanted_gpus: list[tuple[int, int]] = []  # (position, cuda index) read in one batch
    for pos, entry in enumerate(devices):
        if isinstance(entry, DeviceSpec):
            specs.append(entry)
            continue
        device = _parse_device(entry, f"devices[{pos}]")
        if device.type == "cpu":
            specs.append(DeviceSpec(device, _cpu_available_mb(), cpu_weight))
            continue
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(
                f"devices[{pos}]: {device} does not exist, this machine has {count} CUDA "
                f"device(s); to plan for it anyway pass DeviceSpec('{device}', memory=<MB>)"
            )
        specs.append(None)
        wanted_gpus.append((pos, device.index))
    for (pos, _), spec in zip(wanted_gpus, _cuda_specs([i for _, i in wanted_gpus])):
        specs[pos] = spec
    filled = [spec for spec in specs if spec is not None]  # every GPU placeholder was filled above
    seen: dict[torch.device, int] = {}
    for pos, spec in enumerate(filled):
        if spec.device in seen:
            raise ValueError(
                f"devices[{pos}]: {spec.device} is listed twice "
                f"(also devices[{seen[spec.device]}]); list each device once"
            )
        seen[spec.device] = pos
    return filled


def _distance_matrix(
    specs: Sequence[DeviceSpec], gpu_gpu_distance: float, cpu_gpu_distance: float
) -> np.ndarray:
    """Transfer cost between devices: 0 on one device, else by the pair's types."""
    m = len(specs)
    dist = np.zeros((m, m))
    for a in range(m):
        for b in range(m):
            if a != b:
                both_gpu = specs[a].device.type == specs[b].device.type == "cuda"
                dist[a, b] = gpu_gpu_distance if both_gpu else cpu_gpu_distance
    return dist
