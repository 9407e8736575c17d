"""A LightningModule with its own training_step and configure_optimizers, and a
LightningDataModule: the tuner runs your step and searches the loader and the knobs.

    pip install -e ".[lightning]"
    python -m tuner run examples/lightning/space.yaml
    python -m tuner export results/example-lightning --format lightning
"""

import lightning as L
import torch
from torch import nn

from tuner.lightning import lightning_workload


class Points(torch.utils.data.Dataset):
    """Rows of features whose label is a fixed nonlinear function of them."""

    def __init__(self, size: int = 8192, features: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, features, generator=g)
        w = torch.randn(features, generator=g)
        self.y = ((self.x @ w).sin() > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Classifier(L.LightningModule):
    def __init__(self, features: int = 64, width: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                 nn.Linear(width, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)  # not called by the tuner's loop
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class PointsData(L.LightningDataModule):
    def __init__(self, size: int = 8192, batch_size: int = 64):
        super().__init__()
        self.size, self.batch_size = size, batch_size

    def setup(self, stage: str | None = None) -> None:
        self.train = Points(self.size)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train, batch_size=self.batch_size, shuffle=True)


def make(size: int = 8192):
    return lightning_workload(Classifier, datamodule=lambda: PointsData(size))
