"""Models and optimisers shared by the gradient-server tests (imported by the ranks too)."""

from __future__ import annotations

import torch
from torch import nn


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        with torch.no_grad():
            self.lin.weight.zero_()
            self.lin.bias.zero_()


class GatedSGD(torch.optim.SGD):
    """SGD whose steps wait until ``gate`` is set: jams the server so its queues fill."""

    def __init__(self, params, gate):
        super().__init__(params, lr=1.0)
        self.gate = gate

    def step(self, closure=None):
        assert self.gate.wait(60), "the test never opened the gate"
        return super().step(closure)
