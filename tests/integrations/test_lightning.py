"""qhoptim.torch in a Lightning module with a scheduler (the recipe in docs/integrations.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

lightning = pytest.importorskip("lightning")

from qhoptim import reference  # noqa: E402
from qhoptim.torch import QHM, QHAdam  # noqa: E402

LR = 0.1
# Lightning's own warnings, about its use of torch and about this tiny run;
# nothing of qhoptim's.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
    pytest.mark.filterwarnings("ignore:GPU available but not used.*"),
]


class Regression(lightning.LightningModule):  # type: ignore[misc]
    def __init__(self, make_optimizer: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(3, 1)
        self.make_optimizer = make_optimizer
        self.first: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = self.make_optimizer(self.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.first:
            self.first = {
                n: (p.detach().double().numpy().copy(), p.grad.double().numpy().copy())
                for n, p in self.named_parameters()
            }

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.first_after = {
                n: p.detach().double().numpy().copy() for n, p in self.named_parameters()
            }


def _fit(make_optimizer: Any, steps: int = 4) -> Regression:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 3, generator=gen)
    data = torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    module = Regression(make_optimizer)
    trainer = lightning.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return module


@pytest.mark.parametrize(
    ("make", "ref"),
    [
        (
            lambda ps: QHAdam(ps, lr=LR, betas=(0.9, 0.999), nus=(0.7, 0.8)),
            reference.QHAdam(lr=LR, betas=(0.9, 0.999), nus=(0.7, 0.8)),
        ),
        (
            lambda ps: QHM(ps, lr=LR, momentum=0.9, nu=0.7),
            reference.QHM(lr=LR, momentum=0.9, nu=0.7),
        ),
    ],
    ids=["QHAdam", "QHM"],
)
def test_a_lightning_module_takes_qh_steps_and_its_scheduler_halves_lr(make: Any, ref: Any) -> None:
    module = _fit(make)
    optimizer = module.trainer.optimizers[0]
    assert type(optimizer).__name__ in {"QHAdam", "QHM"}
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5**4)
    for name, (x0, grad) in module.first.items():
        want, _ = ref.step(x0, grad, ref.init(x0))
        np.testing.assert_allclose(module.first_after[name], want, rtol=1e-6, atol=1e-8)
