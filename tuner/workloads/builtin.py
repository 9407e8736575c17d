"""Built-in workloads on synthetic data, each with real CPU-side preprocessing.

- ``conv``: a small conv net on images that are zlib-"decoded", cropped,
  flipped and normalized per sample (an image pipeline in miniature).
- ``transformer``: a small causal LM on text that is generated and tokenized
  per sample (a word-piece lookup in Python, like a tokenizer).
- ``multisource``: three sources of different shapes (images, token
  sequences, tabular rows) behind one model; a batch that mixes sources needs
  one forward pass per source, a batch of one source needs one
  (the guides' "group_collate" recipe, the ``batch_grouping`` knob).
- ``files``: the conv net on images in a zip archive on disk, opened lazily in
  each DataLoader worker (epoch boundaries cost what they cost a real
  file-backed dataset: persistent workers matter).

Sizes are arguments so that a space file can scale them.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from tuner.workloads import Workload

# --- conv ---------------------------------------------------------------------------


class SyntheticImages(Dataset):
    """Compressed images decoded and augmented on every access: zlib "decode" at four
    times the training resolution, sensor noise, random crop, 4x downscale, flip,
    brightness and contrast jitter, normalization."""

    def __init__(self, size: int = 2048, image_size: int = 32, classes: int = 10, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.image_size = image_size
        self.raw = 4 * image_size + 16  # stored larger: random crops, then a downscale
        self.labels = rng.integers(0, classes, size)
        # Smooth images compress like photos do; keep a few distinct ones to bound memory.
        base = rng.integers(0, 256, (16, self.raw // 4, self.raw // 4, 3), dtype=np.uint8)
        self.blobs = [zlib.compress(np.kron(b, np.ones((4, 4, 1), np.uint8)).tobytes(), 6) for b in base]
        self.size = size
        self.mean = np.array([0.485, 0.456, 0.406], np.float32) * 255
        self.std = np.array([0.229, 0.224, 0.225], np.float32) * 255

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(i)
        img = np.frombuffer(zlib.decompress(self.blobs[i % len(self.blobs)]), np.uint8)
        img = img.reshape(self.raw, self.raw, 3).astype(np.float32)
        img += rng.normal(0.0, 8.0, img.shape).astype(np.float32)  # sensor noise
        crop = 4 * self.image_size
        y, x = rng.integers(0, self.raw - crop + 1, 2)
        img = img[y:y + crop, x:x + crop]
        img = img.reshape(self.image_size, 4, self.image_size, 4, 3).mean(axis=(1, 3))  # resize
        if rng.random() < 0.5:
            img = img[:, ::-1]
        brightness, contrast = rng.uniform(0.8, 1.2, 2)
        img = (img - img.mean()) * contrast + img.mean() * brightness
        img = (np.clip(img, 0, 255) - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.float32)), int(self.labels[i])


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10, width: int = 32):
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

        self.blocks = nn.ModuleList([
            block(3, width), block(width, width), nn.MaxPool2d(2),
            block(width, 2 * width), block(2 * width, 2 * width), nn.MaxPool2d(2),
            block(2 * width, 4 * width),
        ])
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


def _conv_flops(image_size: int, width: int) -> float:
    s = image_size
    layers = [(3, width, s), (width, width, s), (width, 2 * width, s // 2),
              (2 * width, 2 * width, s // 2), (2 * width, 4 * width, s // 4)]
    fwd = sum(2 * 9 * cin * cout * r * r for cin, cout, r in layers)
    return 3.0 * fwd  # forward + backward ~ 3x forward


def conv(size: int = 2048, image_size: int = 32, width: int = 32) -> Workload:
    """A small conv net on augmented synthetic images (input-heavy on a CPU)."""
    return _conv_workload(lambda: SyntheticImages(size, image_size), image_size, width)


def _conv_workload(dataset: Any, image_size: int, width: int) -> Workload:
    """The conv net, its loss and optimizer, around a dataset factory."""
    return Workload(
        model=lambda: SmallConvNet(width=width),
        dataset=dataset,
        loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        flops_per_sample=_conv_flops(image_size, width),
    )


# --- transformer --------------------------------------------------------------------

_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "qu", "ph", "st", "ar", "en", "or"]


class SyntheticText(Dataset):
    """Text generated and tokenized on every access (word pieces looked up in Python)."""

    def __init__(self, size: int = 2048, seq_len: int = 128, vocab: int = 4096):
        self.size, self.seq_len, self.vocab_size = size, seq_len, vocab
        pieces = [a + b for a in _SYLLABLES for b in _SYLLABLES] + _SYLLABLES
        self.vocab = {p: i + 2 for i, p in enumerate(pieces)}  # 0 pad, 1 unknown

    def __len__(self) -> int:
        return self.size

    def _tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            for j in range(0, len(word), 4):
                ids.append(self.vocab.get(word[j:j + 4], 1))
        return ids

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = np.random.default_rng(i)
        n_words = self.seq_len // 2 + 2
        lengths = rng.integers(1, 5, n_words)
        syll = rng.integers(0, len(_SYLLABLES), int(lengths.sum()))
        words, k = [], 0
        for n in lengths:
            words.append("".join(_SYLLABLES[s] for s in syll[k:k + n]))
            k += n
        ids = self._tokenize(" ".join(words))[: self.seq_len + 1]
        ids += [0] * (self.seq_len + 1 - len(ids))
        return torch.tensor(ids, dtype=torch.long)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 4096, dim: int = 128, layers: int = 2, heads: int = 4, seq_len: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        ])
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        mask = self.mask[:n, :n]
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.out(self.norm(x))


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def transformer(size: int = 2048, seq_len: int = 64, dim: int = 128, layers: int = 2) -> Workload:
    """A small causal LM on generated, tokenized text."""
    params = layers * 12 * dim * dim + 2 * 4096 * dim
    return Workload(
        model=lambda: TinyLM(dim=dim, layers=layers, seq_len=seq_len),
        dataset=lambda: SyntheticText(size, seq_len),
        loss=_lm_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4),
        flops_per_sample=6.0 * params * seq_len,
    )


# --- multisource --------------------------------------------------------------------

SOURCES = ("image", "sequence", "table")


class MultiSource(Dataset):
    """Samples from three sources of different shapes: (source, input, label)."""

    def __init__(self, size: int = 3072, image_size: int = 32, seq_len: int = 64, features: int = 256):
        self.size = size
        self.shapes = {"image": (3, image_size, image_size), "sequence": (seq_len,), "table": (features,)}

    def __len__(self) -> int:
        return self.size

    def source_of(self, i: int) -> str:
        return SOURCES[i % len(SOURCES)]

    def __getitem__(self, i: int) -> tuple[str, torch.Tensor, int]:
        rng = np.random.default_rng(i)
        source = self.source_of(i)
        shape = self.shapes[source]
        if source == "sequence":
            x = torch.from_numpy(rng.integers(0, 1000, shape))
        else:
            x = torch.from_numpy(rng.normal(0.0, 1.0, shape).astype(np.float32))
        return source, x, int(rng.integers(0, 10))


def group_collate(samples: list) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Stack samples per source: {source: (inputs, labels)}."""
    by_source: dict[str, list] = defaultdict(list)
    for source, x, y in samples:
        by_source[source].append((x, y))
    return {s: (torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items]))
            for s, items in by_source.items()}


class MultiSourceNet(nn.Module):
    def __init__(self, seq_len: int = 64, features: int = 256, dim: int = 256):
        super().__init__()
        self.encoders = nn.ModuleDict({
            "image": nn.Sequential(nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, dim)),
            "sequence": nn.Sequential(nn.Embedding(1000, 32), nn.Flatten(1), nn.Linear(32 * seq_len, dim)),
            "table": nn.Sequential(nn.Linear(features, dim), nn.ReLU(), nn.Linear(dim, dim)),
        })
        self.trunk = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(4)])
        self.head = nn.Linear(dim, 10)

    def forward(self, source: str, x: torch.Tensor) -> torch.Tensor:
        h = self.encoders[source](x)
        for b in self.trunk:
            h = h + b(h)
        return self.head(h)


def _multisource_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    total, n = 0.0, 0
    for source, (x, y) in batch.items():
        total = total + nn.functional.cross_entropy(model(source, x), y, reduction="sum")
        n += y.shape[0]
    return total / n


def _groups(dataset: MultiSource) -> list[list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i in range(len(dataset)):
        groups[dataset.source_of(i)].append(i)
    return list(groups.values())


def multisource(size: int = 3072, seq_len: int = 64) -> Workload:
    """Three sources of different shapes; batching by source is the fast way."""
    return Workload(
        model=lambda: MultiSourceNet(seq_len=seq_len),
        dataset=lambda: MultiSource(size, seq_len=seq_len),
        loss=_multisource_loss,
        collate=group_collate,
        groups=_groups,
    )


# --- files --------------------------------------------------------------------------


def _write_image_zip(path: str, size: int, raw: int, seed: int = 0) -> None:
    """Write ``size`` smooth images, zlib-compressed, one zip member each (once per path)."""
    import os
    import tempfile
    import zipfile

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (64, raw // 4, raw // 4, 3), dtype=np.uint8)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".part")
    os.close(fd)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for i in range(size):
            img = np.kron(base[i % len(base)], np.ones((4, 4, 1), np.uint8))
            img[rng.integers(0, raw), :, :] = rng.integers(0, 256)  # distinct bytes per member
            z.writestr(f"img/{i:07d}.z", zlib.compress(img.tobytes(), 6))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # atomic: concurrent trials never read a half-written archive


class ZipImages(Dataset):
    """Images read from a zip archive on disk, opened lazily in each process that reads
    it (each DataLoader worker opens its own handle, as real file-backed datasets do):
    a new worker pays the open (the archive's directory is read and indexed) before its
    first sample. Decoding and augmentation as in ``SyntheticImages``."""

    def __init__(self, path: str, image_size: int = 32, classes: int = 10):
        import zipfile

        self.path, self.image_size = path, image_size
        self.raw = 4 * image_size + 16
        with zipfile.ZipFile(path) as z:  # the length only; the handle is per process
            self.names = sorted(n for n in z.namelist() if n.endswith(".z"))
        self.labels = np.random.default_rng(1).integers(0, classes, len(self.names))
        self.mean = np.array([0.485, 0.456, 0.406], np.float32) * 255
        self.std = np.array([0.229, 0.224, 0.225], np.float32) * 255
        self._zip = None
        self._pid = None

    def __len__(self) -> int:
        return len(self.names)

    def _open(self) -> None:
        import os
        import zipfile

        self._zip = zipfile.ZipFile(self.path)
        self._index = {info.filename: info for info in self._zip.infolist()}
        self._pid = os.getpid()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import os

        if self._pid != os.getpid():  # a new worker (or the first read): open here
            self._open()
        blob = self._zip.read(self._index[self.names[i]])
        rng = np.random.default_rng(i)
        img = np.frombuffer(zlib.decompress(blob), np.uint8).reshape(self.raw, self.raw, 3).astype(np.float32)
        crop = 4 * self.image_size
        y, x = rng.integers(0, self.raw - crop + 1, 2)
        img = img[y:y + crop, x:x + crop]
        img = img.reshape(self.image_size, 4, self.image_size, 4, 3).mean(axis=(1, 3))
        if rng.random() < 0.5:
            img = img[:, ::-1]
        img = (img - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1), dtype=np.float32)), int(self.labels[i])

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_zip"], state["_pid"] = None, None  # a handle never crosses processes
        return state


def files(size: int = 2048, image_size: int = 32, width: int = 32, root: str | None = None) -> Workload:
    """The conv net on images stored in a zip archive on disk (written once, under
    ``root``, default the system temp folder), opened lazily per DataLoader worker:
    the case where persistent workers matter at every epoch boundary."""
    import os
    import tempfile

    folder = root or os.path.join(tempfile.gettempdir(), "tuner-files")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"images-{size}-{image_size}.zip")
    if not os.path.exists(path):
        _write_image_zip(path, size, 4 * image_size + 16)
    return _conv_workload(lambda: ZipImages(path, image_size), image_size, width)
