"""A tiny real training state shared by the checkpoint tests."""

from __future__ import annotations

import torch

from supervisor.state import TrainingState


class Tiny:
    """A two-layer model with AdamW, a scheduler and a GradScaler, registered in a TrainingState."""

    def __init__(self, seed: int = 0, width: int = 16, frozen_width: int = 0):
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(width, width), torch.nn.Dropout(0.1), torch.nn.Linear(width, 4)]
        if frozen_width:
            layers.insert(0, torch.nn.Linear(width, width))
            layers[0].requires_grad_(False)
        self.model = torch.nn.Sequential(*layers)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu")
        self.state = TrainingState()
        for name, obj in (
            ("model", self.model),
            ("optimizer", self.opt),
            ("scheduler", self.sched),
            ("scaler", self.scaler),
        ):
            self.state.register(name, obj)
        self.width = width

    def step(self) -> float:
        x = torch.randn(8, self.width)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.state.step += 1
        return loss.item()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of every model and optimizer tensor, by key path."""
        return {k: v.clone() for k, v in self.state.live_tensors().items()}

    def equals(self, snap: dict[str, torch.Tensor]) -> bool:
        live = self.state.live_tensors()
        return live.keys() == snap.keys() and all(torch.equal(live[k], snap[k]) for k in snap)
