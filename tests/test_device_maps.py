"""Device maps computed from members' declared devices (pure logic: no GPU needed).

torch's own validation of device maps is the oracle: every plan must pass it."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.rpc import TensorPipeRpcBackendOptions
from torch.distributed.rpc.backend_registry import _validate_device_maps

from machinlike.distributed._calls.device_maps import DevicePlan, MemberDevices, plan_device_maps

CPU = torch.device("cpu")


def cuda(i):
    return torch.device("cuda", i)


def plan(**members):
    """plan(name=(devices, device_count), ...)"""
    return plan_device_maps([MemberDevices.of(name, devs, count) for name, (devs, count) in members.items()])


def assert_torch_accepts(p: DevicePlan, counts):
    names = list(p.devices)
    _validate_device_maps(names, counts, {n: p.device_maps.get(n, {}) for n in names}, p.devices)
    for name in names:  # and each member's options can be built from it
        TensorPipeRpcBackendOptions(device_maps=p.device_maps.get(name, {}), devices=p.devices[name])


def test_same_index_first_and_the_rest_staged():
    p = plan(learner=(["cuda:0", "cuda:1"], 2), actor=([0], 1), cpu=([], 0))
    assert p.device_maps["learner"] == {"actor": {cuda(0): cuda(0)}}
    assert p.device_maps["actor"] == {"learner": {cuda(0): cuda(0)}}
    assert "cpu" not in p.device_maps  # a CPU-only member sends CPU tensors
    assert p.staged == {"learner": {"actor": frozenset({cuda(1)}), "cpu": frozenset({cuda(0), cuda(1)})},
                        "actor": {"cpu": frozenset({cuda(0)})}}
    assert p.devices == {"learner": [cuda(0), cuda(1)], "actor": [cuda(0)], "cpu": []}
    assert p.arrives_on("learner", "actor", "cuda:0") == cuda(0)
    assert p.arrives_on("learner", "actor", "cuda:1") == CPU  # staged
    assert p.arrives_on("actor", "cpu", 0) == CPU
    assert p.arrives_on("cpu", "learner", "cpu") == CPU
    assert_torch_accepts(p, {"learner": 2, "actor": 1, "cpu": 0})


def test_several_processes_on_one_gpu():
    p = plan(a=(["cuda:0"], 1), b=(["cuda:0"], 1), c=(["cuda:0"], 4))
    for source in "abc":
        assert p.device_maps[source] == {t: {cuda(0): cuda(0)} for t in "abc" if t != source}
    assert p.staged == {}
    assert_torch_accepts(p, {"a": 1, "b": 1, "c": 4})


def test_unmatched_indices_pair_in_order_and_the_way_back_is_the_inverse():
    p = plan(a=([0, 1], 2), b=([1, 2], 3))
    assert p.device_maps["a"]["b"] == {cuda(1): cuda(1), cuda(0): cuda(2)}
    assert p.device_maps["b"]["a"] == {cuda(1): cuda(1), cuda(2): cuda(0)}
    assert p.staged == {}
    assert_torch_accepts(p, {"a": 2, "b": 3})


def test_random_declarations_pass_torchs_validation_and_are_symmetric():
    rng = random.Random(24)
    for _ in range(300):
        counts = {f"m{i}": rng.randint(0, 4) for i in range(rng.randint(1, 5))}
        declared = {n: rng.sample(range(c), rng.randint(0, c)) for n, c in counts.items()}
        p = plan(**{n: (declared[n], counts[n]) for n in counts})
        assert_torch_accepts(p, counts)
        for s in counts:
            for t in counts:
                if s == t:
                    continue
                forward = p.device_maps.get(s, {}).get(t, {})
                back = p.device_maps.get(t, {}).get(s, {})
                if declared[t]:
                    assert back == {v: k for k, v in forward.items()} or not declared[s]
                # every declared device is either mapped or staged, never both
                staged = p.staged.get(s, {}).get(t, frozenset())
                assert set(forward) | staged == set(p.devices[s]) and not set(forward) & staged
                # same index wins whenever both declare it
                for i in set(declared[s]) & set(declared[t]):
                    assert forward[cuda(i)] == cuda(i) and p.arrives_on(s, t, cuda(i)) == cuda(i)


@pytest.mark.parametrize("args, error, match", [
    (("a", ["cpu"], 1), ValueError, r"member 'a': declared device 'cpu' is not an indexed CUDA device"),
    (("a", ["cuda"], 1), ValueError, r"'cuda' is not an indexed CUDA device; declare 'cuda:N'"),
    (("a", ["gpu0"], 1), ValueError, r"member 'a': 'gpu0' is not a device"),
    (("a", [0, "cuda:0"], 1), ValueError, r"member 'a' declares a device twice"),
    (("a", ["cuda:2"], 2), ValueError, r"member 'a' declares cuda:2 but sees 2 CUDA device\(s\); declare "
                                       r"indices below 2"),
    (("a", "cuda:0", 1), TypeError, "devices must be a sequence"),
    (("a", [0], -1), TypeError, "device_count must be an int >= 0"),
    (("", [0], 1), TypeError, "name must be a non-empty str"),
])
def test_bad_declarations(args, error, match):
    with pytest.raises(error, match=match):
        MemberDevices.of(*args)


def test_bad_plans_and_questions():
    a = MemberDevices.of("a", [0], 1)
    with pytest.raises(ValueError, match="member 'a' is declared twice"):
        plan_device_maps([a, a])
    with pytest.raises(TypeError, match="members must be MemberDevices"):
        plan_device_maps([("a", [0], 1)])
    p = plan_device_maps([a, MemberDevices.of("b", [], 0)])
    with pytest.raises(KeyError, match="'c' is not a member"):
        p.arrives_on("a", "c", 0)
    with pytest.raises(ValueError, match=r"member 'b' did not declare cuda:0: it sends only from the CPU"):
        p.arrives_on("b", "a", "cuda:0")
