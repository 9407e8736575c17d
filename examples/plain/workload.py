"""A plain PyTorch model on (x, y) batches with cross-entropy: the shape most training
scripts have. Swap in your own model and dataset; keep the three parts.

    python -m tuner run examples/plain/space.yaml
    python -m tuner export results/example-plain --format python -o train_tuned.py
"""

import torch
from torch import nn

from tuner import Workload


class Shapes(torch.utils.data.Dataset):
    """Small noisy images of four classes; each item is made on read (as a decoding
    dataset does), the same on every read."""

    def __init__(self, size: int = 2048, image: int = 32):
        self.size, self.image = size, image

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = i % 4
        x = torch.randn(3, self.image, self.image, generator=g) * 0.5
        x[label % 3, :, label * 4:label * 4 + 8] += 1.0  # a class-dependent stripe
        return x, label


class Net(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(2 * width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch  # already on the device
    return nn.functional.cross_entropy(model(x), y)


def make(size: int = 2048, width: int = 32) -> Workload:
    return Workload(model=lambda: Net(width), dataset=lambda: Shapes(size), loss=loss)
