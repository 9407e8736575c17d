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
