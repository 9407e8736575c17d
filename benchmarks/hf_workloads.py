"""Workloads written the way a user writes one around Hugging Face model definitions:
the model built from a config (no download), synthetic data, the model's own loss,
batches as a ``BatchEncoding`` (a ``Mapping``, not a ``dict``) or as a dict of
tensors. ``benchmarks/truth.py`` checks ``bench`` against a plain loop on them, as
the issue's independent check did (a small GPT-2, a small ResNet).

    workload: benchmarks/hf_workloads.py:gpt2
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from tuner import Workload


class Tokens(Dataset):
    """Random token ids, made on each read (as a tokenizer-on-the-fly dataset would)."""

    def __init__(self, size: int, seq_len: int, vocab: int):
        self.size, self.seq_len, self.vocab = size, seq_len, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _encoding(samples: list[dict]):
    from torch.utils.data import default_collate
    from transformers import BatchEncoding

    return BatchEncoding(default_collate(samples))


def gpt2_flops_per_sample(seq_len: int, n_layer: int, n_embd: int, vocab: int) -> float:
    """Training FLOPs per sequence as nanoGPT's ``estimate_mfu`` counts them (the PaLM
    paper's appendix B): 6 per parameter per token, position embeddings left out, plus
    attention's 12 * layers * width * seq_len per token."""
    params = n_layer * (12 * n_embd**2 + 13 * n_embd) + vocab * n_embd + 2 * n_embd
    return seq_len * (6 * params + 12 * n_layer * n_embd * seq_len)


def gpt2(size: int = 512, seq_len: int = 64, n_layer: int = 2, n_embd: int = 128, vocab: int = 4096) -> Workload:
    """A GPT-2 (``GPT2LMHeadModel`` from a config), next-token loss; small by default,
    GPT-2 124M with ``seq_len=1024, n_layer=12, n_embd=768, vocab=50257``."""

    def model():
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
                         n_head=max(1, n_embd // 64), bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)

    def loss(model, batch):
        return model(**batch, labels=batch["input_ids"]).loss

    return Workload(model=model, dataset=lambda: Tokens(size, seq_len, vocab), loss=loss, collate=_encoding,
                    flops_per_sample=gpt2_flops_per_sample(seq_len, n_layer, n_embd, vocab))


class Images(Dataset):
    """Random images and labels, decoded-image sized, made on each read."""

    def __init__(self, size: int, image: int, classes: int):
        self.size, self.image, self.classes = size, image, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.rand(3, self.image, self.image, generator=g),
                "labels": torch.randint(0, self.classes, (), generator=g)}


def _own_loss(model, batch):
    """The model's own loss, the batch (labels included) passed as keyword arguments."""
    return model(**batch).loss


def resnet(size: int = 1024, image: int = 64, classes: int = 10) -> Workload:
    """A small ResNet (``ResNetForImageClassification`` from a config), its own loss."""

    def model():
        from transformers import ResNetConfig, ResNetForImageClassification

        cfg = ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                           layer_type="basic", num_labels=classes)
        return ResNetForImageClassification(cfg)

    return Workload(model=model, dataset=lambda: Images(size, image, classes), loss=_own_loss)


def resnet50(size: int = 4096, image: int = 224, classes: int = 1000) -> Workload:
    """ResNet-50 (``ResNetConfig``'s defaults are ResNet-50's) on random images made on
    each read, as a decoding dataset makes them: the DataLoader's workers matter.
    FLOPs: 4.1 G multiply-adds per 224-pixel image forward, training three times that."""

    def model():
        from transformers import ResNetConfig, ResNetForImageClassification

        return ResNetForImageClassification(ResNetConfig(num_labels=classes))

    return Workload(model=model, dataset=lambda: Images(size, image, classes), loss=_own_loss,
                    flops_per_sample=3 * 2 * 4.1e9 * (image / 224) ** 2)


class Vectors(Dataset):
    """Random feature vectors and targets, made on each read."""

    def __init__(self, size: int, features: int):
        self.size, self.features = size, features

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.rand(self.features, generator=g), "y": torch.rand(1, generator=g)}


def tiny(size: int = 16384, features: int = 16) -> Workload:
    """A linear model whose step costs almost nothing: what a loop or a framework adds per
    step stands alone (``framework_speed.py --overhead``)."""

    def loss(model, batch):
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])

    return Workload(model=lambda: torch.nn.Linear(features, 1), dataset=lambda: Vectors(size, features), loss=loss)
