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


def gpt2(size: int = 512, seq_len: int = 64, n_layer: int = 2, n_embd: int = 128, vocab: int = 4096) -> Workload:
    """A small GPT-2 (``GPT2LMHeadModel`` from a config), next-token loss."""

    def model():
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
                         n_head=max(1, n_embd // 64), bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)

    def loss(model, batch):
        return model(**batch, labels=batch["input_ids"]).loss

    return Workload(model=model, dataset=lambda: Tokens(size, seq_len, vocab), loss=loss, collate=_encoding)


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


def resnet(size: int = 1024, image: int = 64, classes: int = 10) -> Workload:
    """A small ResNet (``ResNetForImageClassification`` from a config), its own loss."""

    def model():
        from transformers import ResNetConfig, ResNetForImageClassification

        cfg = ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                           layer_type="basic", num_labels=classes)
        return ResNetForImageClassification(cfg)

    def loss(model, batch):
        return model(**batch).loss

    return Workload(model=model, dataset=lambda: Images(size, image, classes), loss=loss)
