"""Input-bound workloads for the input pipeline's knobs (dataset_cache, augment_on).

``jpeg``: images stored as JPEG bytes, decoded and resized per item with Pillow (the
deterministic part, which a cache keeps), a random flip per batch (``augment``, which
it does not). ``jpeg(random_crop=True)`` is its twin that draws a crop in
``__getitem__``: its items differ between reads, and the cache must refuse it.

``rows``: a table in a ``TensorDataset`` behind a small MLP, at large batches: each batch
is collated from thousands of items, and the objects they make start the interpreter's
full garbage collections every few steps (``gc_freeze``).

``reviews`` and ``gru_reviews``: token lists of 16-256 tokens, padded per batch by their
collate, behind a transformer encoder layer (it computes on the padding, masked) and a
bidirectional GRU over packed sequences (it skips most of it); both give their items'
lengths (``group_by_length``).

``tokenized``: texts split into words and looked up in a vocabulary in ``__getitem__``,
items as a tokenizer without ``return_tensors`` gives them (Python lists of ids and a
mask), padded per batch; ``tokenized(word_dropout=0.1)`` is its twin that drops words at
random in ``__getitem__``, which the cache must refuse.

``keywords``: keyword spotting on clips of 0.5-3 s, whose spectrogram the loading
process computes per read (a short-time Fourier transform), padded per batch to the
batch's longest clip, behind a 1-D conv net that computes on the padding; it gives its
items' lengths (``group_by_length``), so grouping cuts both the padding and its compute.

``utterances``: dialogue turns whose lengths have a long tail (most a few dozen tokens, a
few hundred at most), padded per batch behind two transformer encoder layers: a batch's
padding grows with the chance that it holds one of the long turns, and attention's cost
with the square of its longest.

``sessions``: clickstream sessions with long-tailed lengths (most a couple of dozen
events, a few hundred at most), each event's features built per read, behind a two-layer
LSTM over packed sequences: it skips the padding's compute, but steps through the batch's
longest session one event at a time.
"""

from __future__ import annotations

import io
import math
import random
import re

import numpy as np
import torch
from torch import nn

from tuner import Workload


class JpegImages(torch.utils.data.Dataset):
    def __init__(self, size: int = 512, stored: int = 160, image: int = 64, random_crop: bool = False):
        from PIL import Image

        rng = np.random.default_rng(0)
        self.blobs, self.image, self.random_crop = [], image, random_crop
        for i in range(size):
            # smooth gradients plus noise: a photo-like image JPEG compresses, not flat noise
            yy, xx = np.mgrid[0:stored, 0:stored]
            base = (np.stack([xx * (i % 7 + 1), yy * (i % 5 + 1), xx + yy], -1) % 256).astype(np.float32)
            pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
            self.blobs.append(buf.getvalue())
        self.labels = [i % 10 for i in range(size)]

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int):
        from PIL import Image

        img = Image.open(io.BytesIO(self.blobs[i])).convert("RGB")
        if self.random_crop:
            w, h = img.size
            x, y = random.randint(0, w // 4), random.randint(0, h // 4)
            img = img.crop((x, y, x + 3 * w // 4, y + 3 * h // 4))
        img = img.resize((self.image, self.image), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - 0.5) / 0.25, self.labels[i]


def _flip(batch):
    x, y = batch
    flip = torch.rand(x.shape[0], 1, 1, 1, device=x.device) < 0.5
    return torch.where(flip, x.flip(-1), x), y


def jpeg(size: int = 512, image: int = 64, random_crop: bool = False) -> Workload:
    def model():
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    return Workload(model=model, dataset=lambda: JpegImages(size, image=image, random_crop=random_crop),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
                    augment=_flip)


def rows(size: int = 200_000, features: int = 64) -> Workload:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(size, features, generator=g)
    y = (x[:, :8].sum(1, keepdim=True) > 0).float()
    return Workload(
        model=lambda: nn.Sequential(nn.Linear(features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                    nn.Linear(512, 1)),
        dataset=torch.utils.data.TensorDataset(x, y),
        loss=lambda model, batch: nn.functional.binary_cross_entropy_with_logits(model(batch[0]), batch[1]),
    )


class Reviews(torch.utils.data.Dataset):
    """Token lists of 16 to ``longest`` tokens, each the same on every read (the length of
    item i is drawn once, up front: what ``lengths`` reads without reading the items)."""

    classes = 2

    def __init__(self, size: int = 4096, longest: int = 256, vocab: int = 8000):
        rng = random.Random(0)
        self.lengths = [rng.randint(16, longest) for _ in range(size)]
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randint(1, self.vocab, (self.lengths[i],), generator=g), i % self.classes


def _padded(items):
    tokens = nn.utils.rnn.pad_sequence([t for t, _ in items], batch_first=True)
    return tokens, torch.tensor([len(t) for t, _ in items]), torch.tensor([y for _, y in items])


class Encoder(nn.Module):
    def __init__(self, vocab: int = 8000, dim: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens, lengths):
        mask = tokens != 0
        h = self.layer(self.embed(tokens), src_key_padding_mask=~mask)
        return self.head((h * mask.unsqueeze(-1)).sum(1) / lengths.unsqueeze(-1))


class Recurrent(nn.Module):
    def __init__(self, vocab: int = 8000, dim: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.gru = nn.GRU(dim, dim, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * dim, 2)

    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, h = self.gru(packed)
        return self.head(torch.cat([h[0], h[1]], 1))


def _classify(model, batch):
    tokens, lengths, y = batch
    return nn.functional.cross_entropy(model(tokens, lengths), y)


def reviews(size: int = 4096, longest: int = 256) -> Workload:
    """A transformer encoder layer on token lists padded per batch, with their lengths."""
    return Workload(model=Encoder, dataset=lambda: Reviews(size, longest), loss=_classify, collate=_padded,
                    lengths=lambda ds: ds.lengths)


def gru_reviews(size: int = 4096, longest: int = 256) -> Workload:
    """A bidirectional GRU over the packed token lists, with their lengths."""
    return Workload(model=Recurrent, dataset=lambda: Reviews(size, longest), loss=_classify, collate=_padded,
                    lengths=lambda ds: ds.lengths)


class Texts(torch.utils.data.Dataset):
    """Texts of 20-120 words, tokenized on every read: a regular expression splits the words
    and punctuation, a dict maps them to ids; the items are dicts of Python lists."""

    def __init__(self, size: int = 8192, vocab: int = 5000, word_dropout: float = 0.0):
        rng = random.Random(0)
        words = [f"w{i}" for i in range(vocab)]
        self.texts = [" ".join(rng.choice(words) + rng.choice([",", ".", ""]) for _ in range(rng.randint(20, 120)))
                      for _ in range(size)]
        self.ids = {w: i + 2 for i, w in enumerate(words + [",", "."])}
        self.word_dropout = word_dropout

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        words = re.findall(r"\w+|[^\w\s]", self.texts[i].lower())
        if self.word_dropout:
            words = [w for w in words if random.random() >= self.word_dropout]
        ids = [self.ids.get(w, 1) for w in words]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "label": i % 2}


def _pad_lists(items):
    longest = max(len(it["input_ids"]) for it in items)
    ids = torch.tensor([it["input_ids"] + [0] * (longest - len(it["input_ids"])) for it in items])
    mask = torch.tensor([it["attention_mask"] + [0] * (longest - len(it["attention_mask"])) for it in items])
    return ids, mask, torch.tensor([it["label"] for it in items])


class MeanOfWords(nn.Module):
    def __init__(self, vocab: int = 5004, dim: int = 64):  # 5000 words, 2 marks, padding and unknown
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim, padding_idx=0), nn.Linear(dim, 2)

    def forward(self, ids, mask):
        h = self.embed(ids) * mask.unsqueeze(-1)
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))


def tokenized(size: int = 8192, word_dropout: float = 0.0) -> Workload:
    """A mean-of-embeddings classifier on texts tokenized per read (see the module's docstring)."""
    return Workload(model=MeanOfWords, dataset=lambda: Texts(size, word_dropout=word_dropout),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0], batch[1]), batch[2]),
                    collate=_pad_lists)


class Clips(torch.utils.data.Dataset):
    """Clips of 0.5-3 s at 8 kHz (a few tones in noise, each the same on every read), read
    as a log-magnitude spectrogram: frames x 201 frequency bins."""

    def __init__(self, size: int = 3000, rate: int = 8000, classes: int = 12):
        rng = random.Random(0)
        self.samples = [rng.randint(rate // 2, 3 * rate) for _ in range(size)]
        self.rate, self.classes = rate, classes
        self.window = torch.hann_window(400)

    def __len__(self) -> int:
        return len(self.samples)

    def lengths(self) -> list[int]:
        return [1 + n // 80 for n in self.samples]  # the spectrogram's frames (hop 80)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        t = torch.arange(self.samples[i]) / self.rate
        label = i % self.classes
        wave = torch.sin(2 * torch.pi * (300 + 150 * label) * t) + 0.5 * torch.randn(len(t), generator=g)
        spec = torch.stft(wave, 400, hop_length=80, window=self.window, return_complex=True)
        return torch.log1p(spec.abs()).T.contiguous(), label


def _pad_clips(items):
    return (nn.utils.rnn.pad_sequence([x for x, _ in items], batch_first=True),
            torch.tensor([y for _, y in items]))


class Spotter(nn.Module):
    def __init__(self, bins: int = 201, width: int = 96, classes: int = 12):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(bins, width, 5, padding=2), nn.ReLU(),
                                 nn.Conv1d(width, width, 5, padding=2), nn.ReLU(),
                                 nn.Conv1d(width, width, 5, padding=2), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.net(x.transpose(1, 2)).mean(2))


def keywords(size: int = 3000) -> Workload:
    """Keyword spotting on spectrograms of clips of varying length, with their lengths."""
    return Workload(model=Spotter, dataset=lambda: Clips(size),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
                    collate=_pad_clips, lengths=lambda ds: ds.lengths())


class Utterances(Reviews):
    """Token lists whose lengths are log-normal (median 40 tokens), 4 to ``longest``, each
    the same on every read."""

    classes = 4

    def __init__(self, size: int = 2048, longest: int = 384, vocab: int = 8000):
        rng = random.Random(1)
        self.lengths = [min(longest, max(4, round(rng.lognormvariate(math.log(40), 0.8)))) for _ in range(size)]
        self.vocab = vocab


class Turns(nn.Module):
    def __init__(self, vocab: int = 8000, dim: int = 192, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens, lengths):
        mask = tokens != 0
        h = self.encoder(self.embed(tokens), src_key_padding_mask=~mask)
        return self.head((h * mask.unsqueeze(-1)).sum(1) / lengths.unsqueeze(-1))


def utterances(size: int = 2048, longest: int = 384) -> Workload:
    """Two transformer encoder layers on long-tailed token lists padded per batch, with
    their lengths."""
    return Workload(model=Turns, dataset=lambda: Utterances(size, longest), loss=_classify, collate=_padded,
                    lengths=lambda ds: ds.lengths)


class Sessions(torch.utils.data.Dataset):
    """Clickstream sessions of 2 to ``longest`` events (log-normal lengths, median 24),
    each event an item id and the log of the seconds since the one before, built per read
    from the raw event times (the same on every read)."""

    def __init__(self, size: int = 1536, longest: int = 320, items: int = 20000):
        rng = random.Random(2)
        self.lengths = [min(longest, max(2, round(rng.lognormvariate(math.log(24), 0.9)))) for _ in range(size)]
        self.items = items

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        n = self.lengths[i]
        times = torch.cumsum(torch.empty(n).exponential_(1 / 30, generator=g), 0)
        gaps = torch.log1p(torch.diff(times, prepend=times[:1]))
        ids = torch.randint(1, self.items, (n,), generator=g)
        return ids, gaps, i % 2


def _pad_sessions(items):
    ids = nn.utils.rnn.pad_sequence([x for x, _, _ in items], batch_first=True)
    gaps = nn.utils.rnn.pad_sequence([t for _, t, _ in items], batch_first=True)
    return ids, gaps, torch.tensor([len(x) for x, _, _ in items]), torch.tensor([y for _, _, y in items])


class SessionNet(nn.Module):
    def __init__(self, items: int = 20000, dim: int = 96):
        super().__init__()
        self.embed = nn.Embedding(items, dim, padding_idx=0)
        self.gap = nn.Linear(1, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids, gaps, lengths):
        x = self.embed(ids) + self.gap(gaps.unsqueeze(-1))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


def sessions(size: int = 1536, longest: int = 320) -> Workload:
    """A two-layer LSTM over packed clickstream sessions with long-tailed lengths, with
    their lengths."""
    return Workload(model=SessionNet, dataset=lambda: Sessions(size, longest),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(*batch[:3]), batch[3]),
                    collate=_pad_sessions, lengths=lambda ds: ds.lengths)
