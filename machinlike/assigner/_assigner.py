"""ModelAssigner: places models on devices by gradient descent and discrete refinement.

Data flow::

    models --ModelSizeEstimator--> sizes (MB)       devices --_resolve_devices--> specs
    model_connection --> C [n, n]                    specs --> allowed MB, power, D [m, m]
                \\_____________ _make_problem (normalise) _____________/
                                       |
        _solve: Adam on seeded logit matrices [k, n, m] (the optimize_placement cost)
                -> row argmax -> local search (moves, swaps; memory first) + kicks
                -> still overflowing? exact fit search, or InfeasiblePlacementError
                                       |
                  .assignment, .report(), models moved with .to(device)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn

from .. import _checks
from ._devices import DeviceLike, DeviceSpec, _distance_matrix, _parse_device, _resolve_devices
from ._estimator import ModelSizeEstimator
from ._objective import (
    PlacementReport, PlacementTerms, _discrete_terms, _make_problem, _relaxed_cost, _to_torch,
)
from ._search import _NoFit, _solve
from ._validate import (
    _check_int, _check_models, _check_moved_once, _check_number, _complexities, _connection_matrix,
)

__all__ = ["ModelAssigner", "InfeasiblePlacementError"]


def _mb(value: float) -> str:
    """``value`` MB for a message: two decimals, or three significant digits below 1 MB
    (small models read "0.00 MB over")."""
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


class InfeasiblePlacementError(RuntimeError):
    """The models do not fit in the memory the devices allow (a RuntimeError, as machin
    raised). The message says which limit is exceeded and by how many MB."""


class ModelAssigner:
    """Assigns models to devices, in the scope of a single process.

    Each model ``i`` gets a device ``a(i)`` minimising the objective (``s`` model sizes
    and ``c`` allowed memory in MB, ``C`` connections, ``D`` device distances)::

        J(a) = connection_weight       * sum_ik C'_ik D'[a(i), a(k)]
             + size_match_weight       * sum_j relu(U_j - c_j) / mean(s)
             + complexity_match_weight * sum_j (L_j - t_j) ** 2
             + entropy_weight          * H                 (0 for a discrete placement)

    where ``C' = C / sum(C)`` (0 without connections); ``D' = D / max(D)`` with distance
    0 on one device, ``gpu_gpu_distance`` between two GPUs and ``cpu_gpu_distance``
    between the CPU and a GPU; ``U_j`` is the MB placed on device ``j``; ``L_j`` the
    share of the total model complexity placed on ``j`` and ``t_j = w_j / sum(w)`` the
    share of its compute power ``w_j``, so the term is 0 when every device's complexity
    / compute power ratio is the same. A device of power 0 (the CPU with the default
    ``cpu_weight=0``) should compute nothing: all complexity it holds counts as
    imbalance, but it still takes models when the GPUs' memory runs out. If every device
    has power 0 they count as equal; if no model has complexity the term is 0. ``H`` is
    the mean entropy (nats) of the rows of a soft placement.

    The assignment minimises ``J`` among the placements that fit (``U_j <= c_j``
    everywhere), in two stages:

    1. Gradient descent: Adam (``update_rate``, ``iterations`` steps, torch's defaults
       otherwise) on up to 32 logit matrices ``[n, m]`` at once, started from normal
       noise of a private generator seeded with ``seed``; the soft placement is the
       row-wise softmax and the cost ``J`` of it (as :meth:`optimize_placement`).
    2. Discrete refinement: each matrix's row-wise argmax starts a local search over
       single moves (a model to another device) and pairwise swaps, taking the best
       step until none improves: overflow is reduced first, and once a placement fits
       no step may make it overflow. Then iterated local search: ``max(32, 6n)`` (at
       most 256) rounds of perturbing the best placement (2-3 random moves, or two
       devices exchanging all their models) and descending again, keeping improvements.
       Should every result still overflow, an exact depth-first fit search (largest
       model first) finds a fitting placement to refine, or proves that none exists.

    So ``.assignment`` fits whenever a fitting placement exists and the fit search finds
    it within its budget of 200,000 nodes (milliseconds to a second); tightly packed
    instances of a few dozen models can exhaust it (bin packing is NP-hard), and the
    error then says so (a little more room, through ``max_mem_ratio`` or a device, lets
    the search succeed). Runs are deterministic for a given ``seed``
    and leave the global RNGs of torch and NumPy untouched.

    Args:
        models: Models to place.
        model_connection: Data sent between models: ``{(source, target): amount}``
            (amount >= 0, missing pairs 0, an empty dict for none) or an ``[n, n]``
            matrix with a zero diagonal.
        devices: Candidate devices: ``"cpu"``/``"cuda:N"`` strings or ``torch.device``
            (capacity read from the machine: CUDA free memory by
            ``torch.cuda.mem_get_info`` and compute power by multiprocessor count
            relative to the largest GPU; the CPU's available memory from the OS and
            power ``cpu_weight``), or :class:`DeviceSpec` (used as given). None: every
            visible CUDA device, or the CPU when there is none.
        model_size_multiplier: Factor on each model's parameter and buffer size.
        max_mem_ratio: Share (0, 1] of each device's free memory the models may use.
        cpu_weight: Compute power of the CPU relative to one GPU (>= 0; 0 is none).
        connection_weight: Weight of the connection term (>= 0).
        size_match_weight: Weight of the memory overflow term (>= 0).
        complexity_match_weight: Weight of the compute balance term (>= 0).
        entropy_weight: Weight of the entropy term (>= 0).
        iterations: Adam steps (>= 0; 0 refines the random starts directly).
        update_rate: Adam learning rate (> 0).
        gpu_gpu_distance: Transfer cost between two GPUs (>= 0).
        cpu_gpu_distance: Transfer cost between the CPU and a GPU (>= 0).
        move_models: Move every model to its device with ``model.to(device)``. Models
            that share a module (a shared encoder, tied weights) are refused then: a
            shared tensor is on one device (pass them as one model). Each model's size
            counts what it shares.
        model_complexity: Compute cost of each model (>= 0, any unit); None: its size.
        seed: Seed of the private generators of the search.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: An argument is out of range or inconsistent (the message names it),
            a device does not exist here, or ``move_models`` targets a CUDA device this
            machine does not have (then no model is moved).
        InfeasiblePlacementError: No placement fits in the allowed memory.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        model_connection: Union[Mapping[tuple[int, int], float], torch.Tensor, Any],
        devices: Optional[Sequence[DeviceLike]] = None,
        model_size_multiplier: float = 2,
        max_mem_ratio: float = 0.5,
        cpu_weight: float = 0,
        connection_weight: float = 2,
        size_match_weight: float = 1e-2,
        complexity_match_weight: float = 1,
        entropy_weight: float = 1,
        iterations: int = 500,
        update_rate: float = 0.01,
        gpu_gpu_distance: float = 1,
        cpu_gpu_distance: float = 10,
        move_models: bool = True,
        *,
        model_complexity: Optional[Sequence[float]] = None,
        seed: int = 0,
    ) -> None:
        self._models = _check_models(models)
        _checks.boolean("move_models", move_models)
        if move_models:
            _check_moved_once(self._models)
        n = len(self._models)
        conn = _connection_matrix(model_connection, n)
        multiplier = _check_number(model_size_multiplier, "model_size_multiplier", positive=True)
        ratio = _check_number(max_mem_ratio, "max_mem_ratio", positive=True)
        if ratio > 1:
            raise ValueError(f"max_mem_ratio must be in (0, 1], got {max_mem_ratio!r}")
        weights = [
            _check_number(value, name) for value, name in (
                (connection_weight, "connection_weight"),
                (size_match_weight, "size_match_weight"),
                (complexity_match_weight, "complexity_match_weight"),
                (entropy_weight, "entropy_weight"),
            )
        ]
        cpu_power = _check_number(cpu_weight, "cpu_weight")
        lr = _check_number(update_rate, "update_rate", positive=True)
        gpu_gpu = _check_number(gpu_gpu_distance, "gpu_gpu_distance")
        cpu_gpu = _check_number(cpu_gpu_distance, "cpu_gpu_distance")
        iterations = _check_int(iterations, "iterations", 0)
        seed = _check_int(seed, "seed", 0)
        complexity = _complexities(model_complexity, n)
        sizes = [ModelSizeEstimator(m, multiplier).estimate_size() for m in self._models]
        self._complexity = sizes if complexity is None else complexity  # machin's default
        self._specs = _resolve_devices(devices, cpu_power)
        self._problem = _make_problem(
            sizes, [s.memory * ratio for s in self._specs], conn,
            _distance_matrix(self._specs, gpu_gpu, cpu_gpu), self._complexity,
            [s.compute for s in self._specs], weights,
        )
        self._check_totals(ratio, multiplier)
        try:
            self._placement = _solve(self._problem, iterations, lr, seed)
        except _NoFit as e:
            raise InfeasiblePlacementError(self._no_fit_message(e)) from None
        self._assignment = [self._specs[j].device for j in self._placement]
        if move_models:
            self._move()

    @property
    def assignment(self) -> list[torch.device]:
        """The device of each model, in the order of ``models``."""
        return list(self._assignment)

    @property
    def devices(self) -> list[torch.device]:
        """The candidate devices, in the order the objective indexes them."""
        return [s.device for s in self._specs]

    @property
    def model_sizes(self) -> list[float]:
        """MB each model needs (parameters and buffers times ``model_size_multiplier``)."""
        return self._problem.sizes.tolist()

    @property
    def memory_capacity(self) -> list[float]:
        """MB the models may use on each device (free memory * ``max_mem_ratio``)."""
        return self._problem.capacity.tolist()

    def evaluate(self, placements: Any) -> PlacementTerms:
        """Evaluates the objective on discrete placements of this problem.

        Args:
            placements: Device indices (into :attr:`devices`) of shape ``[n]`` or
                ``[k, n]`` (tensor, array or nested lists).

        Returns:
            The terms of each placement, float64 tensors of shape ``[k]`` (``[1]``).

        Raises:
            ValueError: Wrong shape, not integers, or an index outside ``0..m-1``.
        """
        if isinstance(placements, torch.Tensor):
            placements = placements.cpu().numpy()
        a = np.asarray(placements)
        n, m = len(self._models), len(self._specs)
        if a.ndim == 1:
            a = a[None, :]
        if a.ndim != 2 or a.shape[1] != n or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(
                f"placements must be integer device indices of shape [{n}] or [k, {n}], "
                f"got shape {list(np.shape(placements))} of {a.dtype}"
            )
        if a.size and (a.min() < 0 or a.max() >= m):
            raise ValueError(f"placements hold device indices outside 0..{m - 1}")
        terms = _discrete_terms(self._problem, a.astype(np.int64))
        return PlacementTerms(**{k: torch.from_numpy(v) for k, v in terms.items()})

    def report(
        self, placement: Optional[Sequence[Union[int, DeviceLike]]] = None
    ) -> PlacementReport:
        """Scores a placement and tells the load it puts on each device.

        Args:
            placement: One device per model, as an index into :attr:`devices` or a
                device; None: :attr:`assignment`.

        Raises:
            ValueError: Wrong length, or a device that is not a candidate.
        """
        if placement is None:
            a = np.asarray(self._placement, dtype=np.int64)
        else:
            index = {d: j for j, d in enumerate(self.devices)}
            a = np.empty(len(placement), dtype=np.int64)
            for i, p in enumerate(placement):
                if isinstance(p, (int, np.integer)) and not isinstance(p, bool):
                    a[i] = p
                    continue
                dev = p.device if isinstance(p, DeviceSpec) else _parse_device(p, f"placement[{i}]")
                if dev not in index:
                    raise ValueError(f"placement[{i}]: {dev} is not one of {self.devices}")
                a[i] = index[dev]
        terms = self.evaluate(a)
        pb, m = self._problem, len(self._specs)
        return PlacementReport(
            devices=tuple(self.devices),
            assignment=tuple(self._specs[j].device for j in a),
            connection=float(terms.connection[0]), memory=float(terms.memory[0]),
            compute=float(terms.compute[0]), entropy=0.0, weights=pb.weights,
            total=float(terms.total[0]), model_sizes=tuple(pb.sizes.tolist()),
            memory_used=tuple(np.bincount(a, weights=pb.sizes, minlength=m).tolist()),
            memory_allowed=tuple(pb.capacity.tolist()),
            compute_load=tuple(np.bincount(a, weights=self._complexity, minlength=m).tolist()),
            compute_power=tuple(s.compute for s in self._specs),
            feasible=bool(terms.overflow_mb[0] <= pb.tolerance),
        )

    @staticmethod
    def optimize_placement(
        optimizer: torch.optim.Optimizer,
        placement: torch.Tensor,
        model_size: torch.Tensor,
        size_capacity: torch.Tensor,
        model_complexity: torch.Tensor,
        complexity_capacity: torch.Tensor,
        model_connection: torch.Tensor,
        device_distance: torch.Tensor,
        connection_weight: float,
        size_match_weight: float,
        complexity_match_weight: float,
        entropy_weight: float,
    ) -> torch.Tensor:
        """One optimisation step on placement logits, for n models and m devices.

        Computes the class docstring's ``J`` of the soft placement
        ``softmax(placement, dim=-1)`` from raw (unnormalised) inputs, then runs
        ``optimizer.zero_grad()``, ``backward()`` and ``optimizer.step()``. The
        assigner's own loop computes the same steps without autograd (tests check both
        agree with ``torch.optim.Adam``).

        Args:
            optimizer: Optimiser over ``placement`` (the assigner uses Adam).
            placement: Logits ``[n, m]``, or ``[k, n, m]`` for k independent placements
                (their costs are summed for the backward pass); must require grad.
            model_size: ``[1, n]`` MB each model needs.
            size_capacity: ``[1, m]`` MB allowed on each device.
            model_complexity: ``[1, n]`` compute cost of each model (>= 0).
            complexity_capacity: ``[1, m]`` compute power of each device (>= 0).
            model_connection: ``[n, n]`` data sent from model i to model k (>= 0; the
                diagonal is ignored).
            device_distance: ``[m, m]`` symmetric transfer cost between devices (>= 0).
            connection_weight: Weight of the connection term.
            size_match_weight: Weight of the memory overflow term.
            complexity_match_weight: Weight of the compute balance term.
            entropy_weight: Weight of the entropy term.

        Returns:
            The cost before the step, detached; a scalar, or ``[k]`` for batched logits.

        Raises:
            ValueError: A tensor has the wrong shape.
        """
        if placement.dim() not in (2, 3):
            raise ValueError(
                f"placement must have shape [n, m] or [k, n, m], got {list(placement.shape)}"
            )
        n, m = placement.shape[-2:]
        for name, tensor, shape in (
            ("model_size", model_size, (1, n)), ("size_capacity", size_capacity, (1, m)),
            ("model_complexity", model_complexity, (1, n)),
            ("complexity_capacity", complexity_capacity, (1, m)),
            ("model_connection", model_connection, (n, n)),
            ("device_distance", device_distance, (m, m)),
        ):
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"{name} must have shape {list(shape)}, got {list(tensor.shape)}"
                )

        def raw(tensor: torch.Tensor) -> np.ndarray:
            return tensor.detach().cpu().double().numpy()

        pb = _make_problem(
            raw(model_size)[0], raw(size_capacity)[0], raw(model_connection),
            raw(device_distance), raw(model_complexity)[0], raw(complexity_capacity)[0],
            (connection_weight, size_match_weight, complexity_match_weight, entropy_weight),
        )
        cost = _relaxed_cost(placement, _to_torch(pb, placement.dtype, placement.device))
        optimizer.zero_grad()
        cost.sum().backward()
        optimizer.step()
        return cost.detach()

    def _check_totals(self, ratio: float, multiplier: float) -> None:
        """Fails fast on the two shortfalls that need no search to prove."""
        pb = self._problem
        need, allowed = float(pb.sizes.sum()), float(pb.capacity.sum())
        fix = (
            f"(sizes include model_size_multiplier={multiplier:g}; allowed memory is free "
            f"memory x max_mem_ratio={ratio:g}); lower model_size_multiplier, raise "
            "max_mem_ratio or add devices"
        )
        if need > allowed + pb.tolerance:
            raise InfeasiblePlacementError(
                f"the models need {_mb(need)} MB but the devices allow {_mb(allowed)} MB in "
                f"total: {_mb(need - allowed)} MB short {fix}"
            )
        big, room = int(np.argmax(pb.sizes)), int(np.argmax(pb.capacity))
        if pb.sizes[big] > pb.capacity[room] + pb.tolerance:
            raise InfeasiblePlacementError(
                f"model {big} needs {_mb(pb.sizes[big])} MB but the largest allowance is "
                f"{_mb(pb.capacity[room])} MB on {self._specs[room].device}: "
                f"{_mb(pb.sizes[big] - pb.capacity[room])} MB short {fix}"
            )

    def _no_fit_message(self, e: _NoFit) -> str:
        pb = self._problem
        used = np.bincount(e.best, weights=pb.sizes, minlength=len(pb.capacity))
        worst = int(np.argmax(used - pb.capacity))
        why = (
            "no placement within the allowed memory was found before the fit search's "
            "budget ran out (one may exist)" if e.exhausted else
            "the models cannot be split across the devices without overflowing one"
        )
        return (
            f"{why}: they need {_mb(pb.sizes.sum())} MB of {_mb(pb.capacity.sum())} MB "
            f"allowed in total, and the best placement found puts {_mb(used[worst])} MB on "
            f"{self._specs[worst].device}, which allows {_mb(pb.capacity[worst])} MB "
            f"({_mb(used[worst] - pb.capacity[worst])} MB over); lower "
            "model_size_multiplier, raise max_mem_ratio or add devices"
        )

    def _move(self) -> None:
        count = torch.cuda.device_count()
        for i, dev in enumerate(self._assignment):
            if dev.type == "cuda" and dev.index >= count:
                raise ValueError(
                    f"cannot move model {i} to {dev}: this machine has {count} CUDA "
                    "device(s); pass move_models=False to only plan the placement"
                )
        for model, dev in zip(self._models, self._assignment):
            model.to(dev)
