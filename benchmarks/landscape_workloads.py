"""Workloads of other kinds for the landscape library (``benchmarks/landscapes/``): written
the way a user writes one, on synthetic data, models built from their configs (no
download). Hugging Face's GPT-2 and ResNet are in ``hf_workloads.py``.

    workload: ../landscape_workloads.py:lstm
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from tuner import Workload

# hf_workloads, beside this file: the tuner loads this one by its path, so its folder is
# not on the path
sys.path.insert(0, str(Path(__file__).parent))


class Sequences(Dataset):
    """Random token sequences and a label, made on each read."""

    def __init__(self, size: int, seq_len: int, vocab: int, classes: int = 4):
        self.size, self.seq_len, self.vocab, self.classes = size, seq_len, vocab, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return (torch.randint(0, self.vocab, (self.seq_len,), generator=g),
                torch.randint(0, self.classes, (), generator=g))


class LSTMClassifier(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])


def lstm(size: int = 4096, seq_len: int = 64, vocab: int = 2000, dim: int = 128, layers: int = 2) -> Workload:
    """A 2-layer LSTM sequence classifier."""
    return Workload(model=lambda: LSTMClassifier(vocab, dim, layers),
                    dataset=lambda: Sequences(size, seq_len, vocab),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


class Rows(Dataset):
    """Tabular rows: numeric features normalised per read, plus categorical ids."""

    def __init__(self, size: int, numeric: int, categorical: int, cardinality: int):
        self.size, self.numeric, self.categorical, self.cardinality = size, numeric, categorical, cardinality

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.numeric, generator=g)
        return {"numeric": (x - x.mean()) / (x.std() + 1e-6),
                "categorical": torch.randint(0, self.cardinality, (self.categorical,), generator=g),
                "target": torch.randn((), generator=g)}


class TabularMLP(nn.Module):
    def __init__(self, numeric: int, categorical: int, cardinality: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(cardinality, 16)
        self.net = nn.Sequential(nn.Linear(numeric + 16 * categorical, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))

    def forward(self, numeric: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([numeric, self.embed(categorical).flatten(1)], 1)).squeeze(1)


def mlp(size: int = 16384, numeric: int = 64, categorical: int = 8, cardinality: int = 1000,
        width: int = 512) -> Workload:
    """A tabular MLP: many cheap samples, so the per-sample data path dominates."""

    def loss(model, batch):
        return nn.functional.mse_loss(model(batch["numeric"], batch["categorical"]), batch["target"])

    return Workload(model=lambda: TabularMLP(numeric, categorical, cardinality, width),
                    dataset=lambda: Rows(size, numeric, categorical, cardinality), loss=loss)


def bert(size: int = 1024, seq_len: int = 64, layers: int = 2, hidden: int = 128, vocab: int = 4096) -> Workload:
    """A small BERT-style encoder (``BertForSequenceClassification`` from a config)."""
    from hf_workloads import Tokens

    def model():
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                         max_position_embeddings=seq_len, num_labels=4)
        return BertForSequenceClassification(cfg)

    def loss(model, batch):
        labels = batch["input_ids"][:, 0] % 4
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss

    return Workload(model=model, dataset=lambda: Tokens(size, seq_len, vocab), loss=loss)


def vit(size: int = 1024, image: int = 32, patch: int = 4, layers: int = 2, hidden: int = 128) -> Workload:
    """A small ViT (``ViTForImageClassification`` from a config)."""
    from hf_workloads import Images

    def model():
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(image_size=image, patch_size=patch, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden, num_labels=10)
        return ViTForImageClassification(cfg)

    def loss(model, batch):
        return model(**batch).loss

    return Workload(model=model, dataset=lambda: Images(size, image, 10), loss=loss)


# ---- held out: workloads unlike the ones the search's rules were chosen on --------------


class Reviews(Dataset):
    """Token sequences of varied length (16 to ``max_len``) and a label: short reviews and
    long ones, as a text set holds them."""

    def __init__(self, size: int, max_len: int, vocab: int):
        self.size, self.max_len, self.vocab = size, max_len, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(16, self.max_len + 1, (), generator=g))
        return torch.randint(1, self.vocab, (n,), generator=g), int(torch.randint(0, 2, (), generator=g))


def pad_batch(items: list) -> dict:
    """The batch's sequences padded to its longest, with their mask: a padding collate."""
    tokens = nn.utils.rnn.pad_sequence([t for t, _ in items], batch_first=True)
    return {"tokens": tokens, "mask": tokens != 0, "label": torch.tensor([y for _, y in items])}


class TextClassifier(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.encoder = nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens), src_key_padding_mask=~mask)
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def textcls(size: int = 4096, max_len: int = 256, vocab: int = 8000, dim: int = 128, heads: int = 4) -> Workload:
    """A text classifier on reviews of varied length, padded per batch by its collate."""

    def loss(model, batch):
        return nn.functional.cross_entropy(model(batch["tokens"], batch["mask"]), batch["label"])

    return Workload(model=lambda: TextClassifier(vocab, dim, heads), dataset=lambda: Reviews(size, max_len, vocab),
                    loss=loss, collate=pad_batch)


def wide_tabular(size: int = 262144, numeric: int = 128, categorical: int = 16, cardinality: int = 5000,
                 width: int = 1024) -> Workload:
    """A tabular MLP trained in large batches: thousands of cheap rows a step."""
    base = mlp(size, numeric, categorical, cardinality, width)
    return Workload(model=base.model, dataset=base.dataset, loss=base.loss)


class Photos(Dataset):
    """Images made on each read and put through an expensive per-sample transform: a blur,
    a random rotation and crop by resampling, and a colour jitter, as an augmentation
    pipeline does to decoded photos."""

    def __init__(self, size: int, image: int):
        self.size, self.image = size, image
        k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
        self.blur = (torch.outer(k, k) / 256).expand(3, 1, 5, 5).contiguous()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        x = torch.rand(1, 3, self.image + 32, self.image + 32, generator=g)
        x = nn.functional.conv2d(x, self.blur, padding=2, groups=3)
        angle = float(torch.rand((), generator=g)) * 0.6 - 0.3
        cos, sin = torch.cos(torch.tensor(angle)), torch.sin(torch.tensor(angle))
        theta = torch.tensor([[cos, -sin, 0.0], [sin, cos, 0.0]]).unsqueeze(0)
        grid = nn.functional.affine_grid(theta, [1, 3, self.image, self.image], align_corners=False)
        x = nn.functional.grid_sample(x, grid, align_corners=False)[0]
        x = x * (0.8 + 0.4 * torch.rand(3, 1, 1, generator=g))
        return (x - x.mean()) / (x.std() + 1e-6), int(torch.randint(0, 10, (), generator=g))


def augmented(size: int = 2048, image: int = 64) -> Workload:
    """A small conv net on images whose per-sample transform costs more than the step."""

    def model():
        return nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, stride=2, padding=1),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    return Workload(model=model, dataset=lambda: Photos(size, image),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))
