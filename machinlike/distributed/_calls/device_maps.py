"""Device maps for torch RPC, computed from the devices each member declares.

torch's TensorPipe agent moves a CUDA tensor from caller to callee only along a *device
map* written for that pair (``TensorPipeRpcBackendOptions.set_device_map``); results
come back along its inverse. Users write these maps by hand and get them wrong (a map
that sends two devices to one, a target index the callee does not have). This module
computes them, for every ordered pair of members, from what each member declares::

    member  declared devices      source → target    map                  staged (CPU)
    learner cuda:0, cuda:1        learner → actor    cuda:0 → cuda:0      cuda:1
    actor   cuda:0                actor → learner    cuda:0 → cuda:0      -
    cpu     (none)                learner → cpu      -                    cuda:0, cuda:1

Rules, per ordered pair (source, target), both with CUDA devices:

1. Same index first: the source's ``cuda:i`` goes to the target's ``cuda:i`` when both
   declare it, so a tensor arrives on the index it was sent from. Several processes on
   one GPU (each declaring ``cuda:0``) are the common case of this rule.
2. Then the source's remaining devices are paired with the target's remaining ones in
   index order. The pairing is symmetric, so the map back (target → source) is this
   one inverted and a result travels back to the device its request came from.
3. Source devices left over (the target declares fewer) cannot be mapped: a map must be
   one-to-one (torch refuses duplicated targets). Their tensors are *staged*: copied to
   pinned CPU memory by the sender and sent as CPU tensors. So are all CUDA tensors sent
   to a member that declares no CUDA device.

Indices are each process's own (after ``CUDA_VISIBLE_DEVICES``), as torch's maps are.
This is a pure computation; nothing here talks to torch RPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Sequence, Tuple, Union

import torch

__all__ = ["MemberDevices", "DevicePlan", "plan_device_maps"]

DeviceLike = Union[int, str, torch.device]
DeviceMap = Dict[torch.device, torch.device]
CPU = torch.device("cpu")


def _cuda(member: str, device: DeviceLike) -> torch.device:
    try:
        # An int is a CUDA index (torch.device(int) would ask for the current
        # accelerator, which a machine without one does not have).
        if isinstance(device, int) and not isinstance(device, bool):
            dev = torch.device("cuda", device)
        else:
            dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"member {member!r}: {device!r} is not a device ({err}); declare CUDA devices as "
                         f"'cuda:N', N or torch.device('cuda', N)") from None
    if dev.type != "cuda" or dev.index is None:
        raise ValueError(f"member {member!r}: declared device {device!r} is not an indexed CUDA device; declare "
                         f"'cuda:N' (CPU needs no declaration)")
    return dev


@dataclass(frozen=True)
class MemberDevices:
    """What one member declares: its name and the CUDA devices it uses.

    Attributes:
        name: The member's RPC name.
        devices: The CUDA devices it sends from and receives on, as this process
            numbers them; empty: a CPU-only member.
        device_count: CUDA devices visible to the process (``torch.cuda.device_count()``);
            every declared index must be below it.
    """

    name: str
    devices: Tuple[torch.device, ...]
    device_count: int

    @classmethod
    def of(cls, name: str, devices: Sequence[DeviceLike], device_count: int) -> "MemberDevices":
        """Validate and normalise a declaration.

        Raises:
            TypeError: ``name`` is not a str, ``device_count`` not an int.
            ValueError: a device is not an indexed CUDA device, is declared twice, or
                its index is not below ``device_count``.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, not {name!r}")
        if not isinstance(device_count, int) or isinstance(device_count, bool) or device_count < 0:
            raise TypeError(f"member {name!r}: device_count must be an int >= 0, not {device_count!r}")
        if isinstance(devices, (str, bytes, torch.device)):
            raise TypeError(f"member {name!r}: devices must be a sequence of devices, not {devices!r}")
        parsed = [_cuda(name, d) for d in devices]
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"member {name!r} declares a device twice: {[str(d) for d in parsed]}")
        beyond = [str(d) for d in parsed if d.index >= device_count]
        if beyond:
            raise ValueError(f"member {name!r} declares {', '.join(beyond)} but sees {device_count} CUDA device(s); "
                             f"declare indices below {device_count} (as numbered after CUDA_VISIBLE_DEVICES)")
        return cls(name, tuple(sorted(parsed, key=lambda d: d.index)), device_count)


@dataclass(frozen=True)
class DevicePlan:
    """Device maps and staging decisions for a set of members.

    Attributes:
        device_maps: ``source -> target -> {source device: target device}``; pairs
            with nothing to map are absent. ``device_maps[name]`` is what member
            ``name`` passes as ``TensorPipeRpcBackendOptions(device_maps=...)``.
        devices: ``name -> declared devices``, the ``devices=`` option of each member.
        staged: ``source -> target -> source devices`` whose tensors to that target go
            through pinned CPU memory; pairs with nothing staged are absent.
    """

    device_maps: Dict[str, Dict[str, DeviceMap]] = field(default_factory=dict)
    devices: Dict[str, List[torch.device]] = field(default_factory=dict)
    staged: Dict[str, Dict[str, FrozenSet[torch.device]]] = field(default_factory=dict)

    def arrives_on(self, source: str, target: str, device: DeviceLike) -> torch.device:
        """Where a tensor that ``source`` sends to ``target`` from ``device`` arrives.

        Returns:
            The target's device of the map, or ``cpu`` (a CPU tensor, a staged device).

        Raises:
            KeyError: ``source`` or ``target`` is not a planned member.
            ValueError: ``device`` is a CUDA device ``source`` did not declare.
        """
        for name in (source, target):
            if name not in self.devices:
                raise KeyError(f"{name!r} is not a member of this plan ({sorted(self.devices)})")
        dev = _cuda(source, device) if not (isinstance(device, (str, torch.device)) and
                                            torch.device(device).type == "cpu") else CPU
        if dev.type == "cpu":
            return dev
        if dev not in self.devices[source]:
            raise ValueError(f"member {source!r} did not declare {dev}: it sends only from "
                             f"{[str(d) for d in self.devices[source]] or 'the CPU'}")
        mapped = self.device_maps.get(source, {}).get(target, {}).get(dev)
        return mapped if mapped is not None else torch.device("cpu")


def _pair(source: Tuple[torch.device, ...], target: Tuple[torch.device, ...]) -> DeviceMap:
    by_index = {d.index: d for d in target}
    mapping: DeviceMap = {d: by_index[d.index] for d in source if d.index in by_index}
    rest_source = [d for d in source if d not in mapping]
    rest_target = [d for d in target if d not in mapping.values()]
    mapping.update(zip(rest_source, rest_target))  # both in index order: symmetric
    return mapping


def plan_device_maps(members: Sequence[MemberDevices]) -> DevicePlan:
    """Compute every ordered pair's device map and staging (rules in the module doc).

    Args:
        members: One declaration per member (:meth:`MemberDevices.of`).

    Returns:
        The plan; its maps pass torch's own validation of device maps.

    Raises:
        TypeError: an entry is not a :class:`MemberDevices`.
        ValueError: two entries have the same name.
    """
    seen: Dict[str, MemberDevices] = {}
    for member in members:
        if not isinstance(member, MemberDevices):
            raise TypeError(f"members must be MemberDevices (MemberDevices.of(name, devices, device_count)), "
                            f"not {type(member).__name__}")
        if member.name in seen:
            raise ValueError(f"member {member.name!r} is declared twice")
        seen[member.name] = member
    plan = DevicePlan(devices={m.name: list(m.devices) for m in seen.values()})
    for source in seen.values():
        if not source.devices:
            continue  # a CPU-only member sends CPU tensors: nothing to map or stage
        for target in seen.values():
            if target.name == source.name:
                continue
            mapping = _pair(source.devices, target.devices)
            if mapping:
                plan.device_maps.setdefault(source.name, {})[target.name] = mapping
            left = frozenset(d for d in source.devices if d not in mapping)
            if left:
                plan.staged.setdefault(source.name, {})[target.name] = left
    return plan
