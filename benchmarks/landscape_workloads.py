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


class Clips(Dataset):
    """One-second audio clips made on each read (a few tones and noise at 16 kHz), turned
    into a log-mel spectrogram by a short-time Fourier transform and a mel filterbank in the
    loading process, as a keyword-spotting pipeline does to decoded audio."""

    def __init__(self, size: int, rate: int = 16000, n_fft: int = 400, hop: int = 160, mels: int = 40):
        self.size, self.rate, self.n_fft, self.hop = size, rate, n_fft, hop
        self.window = torch.hann_window(n_fft)
        # triangular filters evenly spaced on the mel scale
        hz = 700 * (10 ** (torch.linspace(0, 2595 * torch.log10(torch.tensor(1 + rate / 2 / 700)), mels + 2) / 2595) - 1)
        bins = torch.linspace(0, rate / 2, n_fft // 2 + 1)
        lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
        self.filters = torch.clamp(torch.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), min=0)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        t = torch.arange(self.rate) / self.rate
        freqs = 100 + 3000 * torch.rand(3, 1, generator=g)
        wave = torch.sin(2 * torch.pi * freqs * t).sum(0) + 0.1 * torch.randn(self.rate, generator=g)
        spec = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True).abs() ** 2
        mel = torch.log(self.filters @ spec + 1e-6)
        return ((mel - mel.mean()) / (mel.std() + 1e-6)).unsqueeze(0), int(torch.randint(0, 12, (), generator=g))


def speech(size: int = 4096, width: int = 32) -> Workload:
    """Keyword spotting: a small conv net over log-mel spectrograms computed per clip."""

    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    def model():
        return nn.Sequential(block(1, width), block(width, 2 * width), block(2 * width, 2 * width),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 12))

    return Workload(model=model, dataset=lambda: Clips(size),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


class Interactions(Dataset):
    """Click logs: dense counters and, per sparse feature, a bag of 1 to ``bag`` ids drawn
    with a long tail (a few ids are most of the traffic), as a recommender's rows are."""

    def __init__(self, size: int, dense: int, sparse: int, rows: int, bag: int):
        self.size, self.dense, self.sparse, self.rows, self.bag = size, dense, sparse, rows, bag

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, list[torch.Tensor], float]:
        g = torch.Generator().manual_seed(i)
        counts = torch.randint(1, self.bag + 1, (self.sparse,), generator=g)
        bags = [(torch.rand(int(n), generator=g) ** 3 * self.rows).long() for n in counts]
        return torch.log1p(torch.rand(self.dense, generator=g) * 100), bags, float(torch.rand((), generator=g) < 0.3)


def bag_batch(items: list) -> dict:
    """Per sparse feature, the batch's ids flat with their offsets (``nn.EmbeddingBag``'s
    input): a collate that builds variable-length bags."""
    ids, offsets = [], []
    for f in range(len(items[0][1])):
        lengths = torch.tensor([len(bags[f]) for _, bags, _ in items])
        ids.append(torch.cat([bags[f] for _, bags, _ in items]))
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
    return {"dense": torch.stack([d for d, _, _ in items]), "ids": ids, "offsets": offsets,
            "click": torch.tensor([c for _, _, c in items])}


class Recommender(nn.Module):
    """DLRM-style: a bottom MLP on the dense features, one summed embedding bag per sparse
    feature, their pairwise dot products, and a top MLP."""

    def __init__(self, dense: int, sparse: int, rows: int, dim: int):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(sparse))
        pairs = (sparse + 1) * sparse // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, ids: list, offsets: list) -> torch.Tensor:
        x = self.bottom(dense)
        z = torch.stack([x] + [t(i, o) for t, i, o in zip(self.tables, ids, offsets, strict=True)], 1)
        dots = z @ z.transpose(1, 2)
        upper = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, upper[0], upper[1]]], 1)).squeeze(1)


def recommender(size: int = 65536, dense: int = 13, sparse: int = 8, rows: int = 100000, dim: int = 32,
                bag: int = 8) -> Workload:
    """A click-through recommender: embedding bags over long-tailed ids, large batches."""

    def loss(model, batch):
        return nn.functional.binary_cross_entropy_with_logits(
            model(batch["dense"], batch["ids"], batch["offsets"]), batch["click"])

    return Workload(model=lambda: Recommender(dense, sparse, rows, dim),
                    dataset=lambda: Interactions(size, dense, sparse, rows, bag), loss=loss, collate=bag_batch)


class Molecules(Dataset):
    """Small graphs (10 to 40 atoms, about two bonds an atom) with atom features and one
    target each, as a molecular property set holds them."""

    def __init__(self, size: int, features: int):
        self.size, self.features = size, features

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(10, 41, (), generator=g))
        chain = torch.stack([torch.arange(n - 1), torch.arange(1, n)])  # a backbone, then rings
        extra = torch.randint(0, n, (2, n // 4), generator=g)
        edges = torch.cat([chain, extra], 1)
        return torch.randn(n, self.features, generator=g), torch.cat([edges, edges.flip(0)], 1), \
            float(torch.randn((), generator=g))


def graph_batch(items: list) -> dict:
    """The batch's graphs as one disconnected graph: nodes stacked, each graph's edges
    shifted by the nodes before it, and each node's graph index (for pooling)."""
    sizes = torch.tensor([x.shape[0] for x, _, _ in items])
    shift = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    return {"x": torch.cat([x for x, _, _ in items]),
            "edges": torch.cat([e + s for (_, e, _), s in zip(items, shift, strict=True)], 1),
            "graph": torch.repeat_interleave(torch.arange(len(items)), sizes),
            "y": torch.tensor([y for _, _, y in items])}


class MessagePassing(nn.Module):
    """A graph network: each layer averages the neighbours' states (a scatter over the
    edge list) and updates every node; a mean over each graph's nodes, then a head."""

    def __init__(self, features: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.updates = nn.ModuleList(nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU()) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, edges: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        src, dst = edges
        degree = torch.zeros(len(h)).index_add_(0, dst, torch.ones(len(dst))).clamp(min=1).unsqueeze(1)
        for update in self.updates:
            incoming = torch.zeros_like(h).index_add_(0, dst, h[src]) / degree
            h = h + update(torch.cat([h, incoming], 1))
        graphs = int(graph.max()) + 1
        pooled = torch.zeros(graphs, h.shape[1]).index_add_(0, graph, h)
        pooled = pooled / torch.bincount(graph, minlength=graphs).unsqueeze(1)
        return self.head(pooled).squeeze(1)


def molecules(size: int = 8192, features: int = 32, hidden: int = 128, layers: int = 4) -> Workload:
    """A graph network for a molecular property: irregular gathers and scatters, batches
    of graphs built by the collate."""

    def loss(model, batch):
        return nn.functional.mse_loss(model(batch["x"], batch["edges"], batch["graph"]), batch["y"])

    return Workload(model=lambda: MessagePassing(features, hidden, layers), dataset=lambda: Molecules(size, features),
                    loss=loss, collate=graph_batch)


class Scans(Dataset):
    """Scanned objects made on each read (noisy points on a box, a cylinder or a sphere),
    reduced to a fixed number of points by farthest-point sampling, centred, scaled to the
    unit sphere and turned by a random angle about the up axis: what a point-cloud
    classification pipeline does to each object before batching."""

    def __init__(self, size: int, raw: int, points: int):
        self.size, self.raw, self.points = size, raw, points

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = int(torch.randint(0, 3, (), generator=g))
        u = torch.rand(self.raw, 3, generator=g) * 2 - 1
        if label == 1:  # a cylinder's side
            angle = torch.pi * u[:, 0]
            u = torch.stack([torch.cos(angle), torch.sin(angle), u[:, 2]], 1)
        elif label == 2:  # a sphere
            u = u / u.norm(dim=1, keepdim=True)
        else:  # a box's faces
            face = torch.randint(0, 3, (self.raw,), generator=g)
            u[torch.arange(self.raw), face] = torch.sign(u[torch.arange(self.raw), face])
        raw = u * (0.5 + torch.rand(3, generator=g)) + 0.02 * torch.randn(self.raw, 3, generator=g)
        chosen = torch.empty(self.points, dtype=torch.long)
        nearest = torch.full((self.raw,), float("inf"))
        far = int(torch.randint(0, self.raw, (), generator=g))
        for j in range(self.points):  # each next point the farthest from those chosen
            chosen[j] = far
            nearest = torch.minimum(nearest, ((raw - raw[far]) ** 2).sum(1))
            far = int(nearest.argmax())
        pts = raw[chosen]
        pts = pts - pts.mean(0)
        pts = pts / pts.norm(dim=1).max()
        turn = 2 * torch.pi * float(torch.rand((), generator=g))
        c, s = torch.cos(torch.tensor(turn)), torch.sin(torch.tensor(turn))
        rotation = torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])
        return (pts @ rotation.T).T.contiguous(), label


def pointnet(size: int = 4096, raw: int = 1024, points: int = 256, width: int = 1024) -> Workload:
    """PointNet-style classification: a shared per-point MLP (1-wide convolutions), a max
    over the points, then a head; the loading samples each object's points."""

    def model():
        return nn.Sequential(nn.Conv1d(3, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                             nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                             nn.Conv1d(128, width, 1), nn.BatchNorm1d(width), nn.ReLU(),
                             nn.AdaptiveMaxPool1d(1), nn.Flatten(),
                             nn.Linear(width, 256), nn.ReLU(), nn.Linear(256, 3))

    return Workload(model=model, dataset=lambda: Scans(size, raw, points),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


class Scenes(Dataset):
    """Images and their per-pixel class masks made on each read (a few random ellipses on a
    noisy background), with the augmentation a segmentation pipeline applies to both: a
    random crop, a flip, a 90-degree turn, and a colour jitter on the image alone."""

    def __init__(self, size: int, image: int, classes: int, crop: int):
        self.size, self.image, self.classes, self.crop = size, image, classes, crop
        ys, xs = torch.meshgrid(torch.arange(image), torch.arange(image), indexing="ij")
        self.ys, self.xs = ys.float(), xs.float()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        mask = torch.zeros(self.image, self.image, dtype=torch.long)
        for c in range(1, self.classes):
            cy, cx, ry, rx = (torch.rand(4, generator=g) * torch.tensor([1.0, 1.0, 0.3, 0.3]) + torch.tensor(
                [0.0, 0.0, 0.05, 0.05])) * self.image
            mask[((self.ys - cy) / ry) ** 2 + ((self.xs - cx) / rx) ** 2 < 1] = c
        colours = torch.rand(self.classes, 3, generator=g)
        img = colours[mask].permute(2, 0, 1) + 0.2 * torch.randn(3, self.image, self.image, generator=g)
        top, left = (int(v) for v in torch.randint(0, self.image - self.crop + 1, (2,), generator=g))
        img, mask = img[:, top:top + self.crop, left:left + self.crop], mask[top:top + self.crop, left:left + self.crop]
        if torch.rand((), generator=g) < 0.5:
            img, mask = img.flip(-1), mask.flip(-1)
        k = int(torch.randint(0, 4, (), generator=g))
        img, mask = torch.rot90(img, k, (1, 2)), torch.rot90(mask, k, (0, 1))
        img = (img - img.mean()) * (0.8 + 0.4 * torch.rand((), generator=g)) + img.mean()
        return img.contiguous(), mask.contiguous()


class UNet(nn.Module):
    """A two-level U-Net: skip connections joined by concatenation, a transposed conv up."""

    def __init__(self, classes: int, width: int):
        super().__init__()

        def double(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

        self.down1, self.down2 = double(3, width), double(width, 2 * width)
        self.middle = double(2 * width, 4 * width)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2), double(4 * width, 2 * width)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2), double(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.down1(x)
        b = self.down2(nn.functional.max_pool2d(a, 2))
        m = self.middle(nn.functional.max_pool2d(b, 2))
        b = self.dec2(torch.cat([self.up2(m), b], 1))
        return self.head(self.dec1(torch.cat([self.up1(b), a], 1)))


def segment(size: int = 2048, image: int = 64, crop: int = 48, classes: int = 4, width: int = 8) -> Workload:
    """Semantic segmentation: a small U-Net on images and masks augmented together per sample."""
    return Workload(model=lambda: UNet(classes, width), dataset=lambda: Scenes(size, image, classes, crop),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


class Windows(Dataset):
    """Forecasting windows cut from long multivariate series: each read slices a context and
    a horizon from one series, scales them by the context's own statistics, and adds the
    calendar and lag features a forecasting pipeline computes per window."""

    def __init__(self, size: int, series: int, length: int, channels: int, context: int, horizon: int):
        g = torch.Generator().manual_seed(0)
        t = torch.arange(length, dtype=torch.float32)
        phase = torch.rand(series, channels, 1, generator=g) * 6.28
        trend = torch.randn(series, channels, 1, generator=g) * 1e-3
        self.data = (torch.sin(t / 24 * 6.28 + phase) + torch.sin(t / 168 * 6.28 + 2 * phase) + trend * t
                     + 0.3 * torch.randn(series, channels, length, generator=g))
        self.size, self.context, self.horizon = size, context, horizon

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        s = int(torch.randint(0, self.data.shape[0], (), generator=g))
        start = int(torch.randint(168, self.data.shape[2] - self.context - self.horizon, (), generator=g))
        ctx = self.data[s, :, start:start + self.context]
        target = self.data[s, :, start + self.context:start + self.context + self.horizon]
        mean, std = ctx.mean(1, keepdim=True), ctx.std(1, keepdim=True) + 1e-5
        steps = torch.arange(start, start + self.context, dtype=torch.float32)
        calendar = torch.stack([torch.sin(steps / 24 * 6.28), torch.cos(steps / 24 * 6.28),
                                torch.sin(steps / 168 * 6.28), torch.cos(steps / 168 * 6.28)])
        lags = torch.stack([self.data[s, :, start - lag:start - lag + self.context] for lag in (24, 168)])
        features = torch.cat([(ctx - mean) / std, ((lags - mean) / std).flatten(0, 1), calendar])
        return features, (target - mean) / std


class TemporalConv(nn.Module):
    """Dilated causal convolutions over the context, a linear head onto the horizon."""

    def __init__(self, inputs: int, channels: int, context: int, horizon: int, width: int, levels: int):
        super().__init__()
        layers, cin = [], inputs
        for k in range(levels):
            layers += [nn.ConstantPad1d((2 ** (k + 1), 0), 0.0), nn.Conv1d(cin, width, 3, dilation=2 ** k), nn.GELU()]
            cin = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width * context, channels * horizon)
        self.channels, self.horizon = channels, horizon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1)).view(-1, self.channels, self.horizon)


def forecast(size: int = 16384, series: int = 64, length: int = 4096, channels: int = 8, context: int = 96,
             horizon: int = 24, width: int = 64, levels: int = 4) -> Workload:
    """Multivariate forecasting: a temporal conv net on windows sliced and scaled per read."""
    inputs = channels * 3 + 4
    return Workload(model=lambda: TemporalConv(inputs, channels, context, horizon, width, levels),
                    dataset=lambda: Windows(size, series, length, channels, context, horizon),
                    loss=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


class MixtureOfExperts(nn.Module):
    """Top-1 routed experts: a gate picks one expert MLP per row, the rows are gathered per
    expert, run, and scattered back, with an auxiliary load-balancing loss: many small ops
    whose sizes change every step."""

    def __init__(self, features: int, hidden: int, experts: int, classes: int):
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.gate = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(),
                                                   nn.Linear(2 * hidden, hidden)) for _ in range(experts))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.embed(x))
        probs = torch.softmax(self.gate(h), -1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                out.index_add_(0, rows, expert(h[rows]) * weight[rows, None])
        share = torch.bincount(choice, minlength=len(self.experts)).float() / len(choice)
        balance = len(self.experts) * (share * probs.mean(0)).sum()
        return self.head(h + out), balance


class Events(Dataset):
    """Tabular event rows: numeric features with heavy tails, clipped and log-scaled per read."""

    def __init__(self, size: int, features: int, classes: int):
        self.size, self.features, self.classes = size, features, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        raw = torch.randn(self.features, generator=g).exp() * 10
        x = torch.log1p(raw.clamp(max=1e4)) - 2.0
        return x, int((x[:4].sum() > 0) + 2 * (x[4:8].sum() > 0)) % self.classes


def moe(size: int = 65536, features: int = 64, hidden: int = 128, experts: int = 8, classes: int = 4) -> Workload:
    """A mixture-of-experts classifier on tabular rows: top-1 routing, gathers and scatters per expert."""

    def loss(model, batch):
        logits, balance = model(batch[0])
        return nn.functional.cross_entropy(logits, batch[1]) + 0.01 * balance

    return Workload(model=lambda: MixtureOfExperts(features, hidden, experts, classes),
                    dataset=lambda: Events(size, features, classes), loss=loss,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


class Views(Dataset):
    """Self-supervised pairs: each read makes an image (random blobs and stripes) and two
    views of it, each with its own random resized crop, flip, colour jitter and blur, as a
    contrastive pipeline (SimCLR's) does: twice the augmentation per sample."""

    def __init__(self, size: int, image: int, view: int):
        self.size, self.image, self.view = size, image, view
        self.ys, self.xs = torch.meshgrid(torch.linspace(-1, 1, image), torch.linspace(-1, 1, image), indexing="ij")

    def __len__(self) -> int:
        return self.size

    def _view(self, img: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        side = int(torch.randint(self.view, self.image + 1, (), generator=g))
        top, left = (int(v) for v in torch.randint(0, self.image - side + 1, (2,), generator=g))
        crop = nn.functional.interpolate(img[None, :, top:top + side, left:left + side], size=self.view,
                                         mode="bilinear", align_corners=False)[0]
        if torch.rand((), generator=g) < 0.5:
            crop = crop.flip(-1)
        crop = crop * (0.6 + 0.8 * torch.rand(3, 1, 1, generator=g)) + 0.2 * torch.randn(3, 1, 1, generator=g)
        if torch.rand((), generator=g) < 0.5:
            crop = nn.functional.avg_pool2d(crop[None], 3, stride=1, padding=1, count_include_pad=False)[0]
        return crop

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        freq, phase = torch.rand(3, 2, generator=g) * 8, torch.rand(3, 1, 1, generator=g) * 6.28
        img = torch.sin(freq[:, :1, None] * self.xs + freq[:, 1:, None] * self.ys + phase)
        img = img + 0.3 * torch.randn(3, self.image, self.image, generator=g)
        return self._view(img, g), self._view(img, g)


def contrastive(size: int = 4096, image: int = 40, view: int = 32, width: int = 32, temperature: float = 0.2
                ) -> Workload:
    """SimCLR-style self-supervision: a small conv encoder and projection head on two views per image, NT-Xent loss."""

    def model():
        return nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                             nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, 128), nn.ReLU(),
                             nn.Linear(128, 64))

    def loss(model, batch):
        a, b = batch
        z = nn.functional.normalize(model(torch.cat([a, b])), dim=1)
        sim = z @ z.T / temperature
        n = len(a)
        sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=sim.device), float("-inf"))
        target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(sim.device)
        return nn.functional.cross_entropy(sim, target)

    return Workload(model=model, dataset=lambda: Views(size, image, view), loss=loss)


class NoisyClips(Dataset):
    """Speech enhancement pairs: a clean waveform (a few gliding tones under an envelope)
    and the same mixed with noise at a random signal-to-noise ratio, cropped at random:
    the raw samples, no spectrogram."""

    def __init__(self, size: int, rate: int, seconds: float):
        self.size, self.rate, self.length = size, rate, int(rate * seconds)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        n = 2 * self.length
        t = torch.arange(n) / self.rate
        f0 = 100 + 400 * torch.rand(3, 1, generator=g)
        glide = 1 + 0.3 * torch.rand(3, 1, generator=g) * t
        clean = (torch.sin(2 * torch.pi * f0 * glide * t) * torch.rand(3, 1, generator=g)).sum(0)
        clean = clean * torch.sigmoid(10 * torch.sin(2 * torch.pi * 2 * t + torch.rand((), generator=g) * 6.28))
        start = int(torch.randint(0, n - self.length, (), generator=g))
        clean = clean[start:start + self.length]
        noise = torch.randn(self.length, generator=g)
        snr = 10 ** (-(torch.rand((), generator=g) * 15) / 20)
        noisy = clean + snr * noise * clean.std() / noise.std()
        return noisy[None], clean[None]


def denoise(size: int = 4096, rate: int = 8000, seconds: float = 0.25, width: int = 16) -> Workload:
    """Speech enhancement on raw waveforms: a 1-D conv encoder-decoder, an L1 loss on the clean signal."""

    def model():
        return nn.Sequential(nn.Conv1d(1, width, 9, stride=2, padding=4), nn.GELU(),
                             nn.Conv1d(width, 2 * width, 9, stride=2, padding=4), nn.GELU(),
                             nn.Conv1d(2 * width, 2 * width, 9, padding=4), nn.GELU(),
                             nn.ConvTranspose1d(2 * width, width, 4, stride=2, padding=1), nn.GELU(),
                             nn.ConvTranspose1d(width, 1, 4, stride=2, padding=1))

    return Workload(model=model, dataset=lambda: NoisyClips(size, rate, seconds),
                    loss=lambda model, batch: nn.functional.l1_loss(model(batch[0]), batch[1]),
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))


class Textures(Dataset):
    """Super-resolution pairs: a procedural image (oriented sine textures and a few sharp
    rectangles), cropped, flipped and turned at random, and the crop downsampled with an
    antialiased bicubic filter in the loading process: the low-resolution input and its
    high-resolution target."""

    def __init__(self, size: int, image: int, crop: int, scale: int):
        self.size, self.image, self.crop, self.scale = size, image, crop, scale
        self.ys, self.xs = torch.meshgrid(torch.linspace(-1, 1, image), torch.linspace(-1, 1, image), indexing="ij")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        angle, freq = torch.rand(3, generator=g) * 3.14, 4 + 20 * torch.rand(3, generator=g)
        img = torch.stack([torch.sin(f * (self.xs * a.cos() + self.ys * a.sin())) for a, f in zip(angle, freq, strict=True)])
        for _ in range(3):
            y0, x0 = (int(v) for v in torch.randint(0, self.image - 8, (2,), generator=g))
            h, w = (int(v) for v in torch.randint(4, self.image // 3, (2,), generator=g))
            img[:, y0:y0 + h, x0:x0 + w] = torch.rand(3, 1, 1, generator=g) * 2 - 1
        top, left = (int(v) for v in torch.randint(0, self.image - self.crop + 1, (2,), generator=g))
        hr = img[:, top:top + self.crop, left:left + self.crop]
        hr = torch.rot90(hr, int(torch.randint(0, 4, (), generator=g)), (1, 2))
        if torch.rand((), generator=g) < 0.5:
            hr = hr.flip(-1)
        lr = nn.functional.interpolate(hr[None], scale_factor=1 / self.scale, mode="bicubic", antialias=True,
                                       align_corners=False)[0]
        return lr.contiguous(), hr.contiguous()


def superres(size: int = 4096, image: int = 80, crop: int = 48, scale: int = 2, width: int = 48) -> Workload:
    """Single-image super-resolution (ESPCN): convolutions at low resolution, a sub-pixel
    shuffle up to the target, an L1 loss."""

    def model():
        return nn.Sequential(nn.Conv2d(3, width, 5, padding=2), nn.Tanh(),
                             nn.Conv2d(width, width // 2, 3, padding=1), nn.Tanh(),
                             nn.Conv2d(width // 2, 3 * scale * scale, 3, padding=1), nn.PixelShuffle(scale))

    return Workload(model=model, dataset=lambda: Textures(size, image, crop, scale),
                    loss=lambda model, batch: nn.functional.l1_loss(model(batch[0]), batch[1]),
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))


class Lines(Dataset):
    """Lines of text of varying length, as character ids: each line drawn on read by a
    first-order Markov chain over a small alphabet, a Python loop per character (the
    loading work grows with the line, as a tokenizer's does)."""

    def __init__(self, size: int, vocab: int, shortest: int, longest: int):
        self.size, self.vocab, self.shortest, self.longest = size, vocab, shortest, longest
        g = torch.Generator().manual_seed(0)
        self.next = torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1).cumsum(1).tolist()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        import bisect
        import random

        rng = random.Random(i)
        n = rng.randint(self.shortest, self.longest)
        ids, c = [], rng.randrange(1, self.vocab)
        for _ in range(n):
            c = min(self.vocab - 1, max(1, bisect.bisect(self.next[c], rng.random())))
            ids.append(c)
        return torch.tensor(ids)


def pad_lines(items: list) -> torch.Tensor:
    """Lines padded with 0 to the longest of the batch."""
    return nn.utils.rnn.pad_sequence(items, batch_first=True, padding_value=0)


class CharLM(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.gru = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(ids))
        return self.head(out)


def charlm(size: int = 8192, vocab: int = 96, shortest: int = 32, longest: int = 256, dim: int = 32,
           hidden: int = 128) -> Workload:
    """A character-level GRU language model on lines of varying length, padded per batch;
    the padding is masked out of the next-character loss."""

    def loss(model, ids):
        logits = model(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                           ignore_index=0)

    return Workload(model=lambda: CharLM(vocab, dim, hidden), dataset=lambda: Lines(size, vocab, shortest, longest),
                    loss=loss, collate=pad_lines, optimizer=lambda p: torch.optim.AdamW(p, lr=2e-3))


class Poses(Dataset):
    """Keypoint heatmaps: an image of blobs at random keypoints, warped by a random
    rotation, scale and shift (an affine grid sampled per image), and a Gaussian heatmap
    per keypoint rendered at the warped point at a quarter of the image's resolution: the
    per-sample warp and rendering of a pose-estimation pipeline."""

    def __init__(self, size: int, image: int, keypoints: int, sigma: float):
        self.size, self.image, self.keypoints, self.sigma = size, image, keypoints, sigma
        self.ys, self.xs = torch.meshgrid(torch.linspace(-1, 1, image), torch.linspace(-1, 1, image), indexing="ij")
        q = image // 4
        self.qy, self.qx = torch.meshgrid(torch.linspace(-1, 1, q), torch.linspace(-1, 1, q), indexing="ij")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        points = torch.rand(self.keypoints, 2, generator=g) * 1.2 - 0.6
        img = 0.2 * torch.randn(3, self.image, self.image, generator=g)
        for k, (x, y) in enumerate(points.tolist()):
            img[k % 3] += torch.exp(-((self.xs - x) ** 2 + (self.ys - y) ** 2) / 0.01)
        angle = (torch.rand((), generator=g) - 0.5) * 1.0
        scale = 0.8 + 0.4 * torch.rand((), generator=g)
        shift = (torch.rand(2, generator=g) - 0.5) * 0.2
        rot = torch.stack([torch.stack([angle.cos(), -angle.sin()]), torch.stack([angle.sin(), angle.cos()])]) * scale
        theta = torch.cat([rot, shift[:, None]], dim=1)
        grid = nn.functional.affine_grid(theta[None], (1, 3, self.image, self.image), align_corners=False)
        img = nn.functional.grid_sample(img[None], grid, align_corners=False)[0]
        # the grid maps output to input: a keypoint p of the input lands at rot^-1 (p - shift)
        warped = (points - shift) @ torch.linalg.inv(rot).T
        d = (self.qx[None] - warped[:, :1, None]) ** 2 + (self.qy[None] - warped[:, 1:, None]) ** 2
        return img, torch.exp(-d / (2 * self.sigma ** 2))


def pose(size: int = 2048, image: int = 64, keypoints: int = 8, width: int = 32, sigma: float = 0.08) -> Workload:
    """Keypoint estimation: a small conv net downsampling 4x to one heatmap per keypoint, an MSE loss."""

    def block(cin, cout, stride=1):
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    def model():
        return nn.Sequential(*block(3, width, 2), *block(width, width), *block(width, 2 * width, 2),
                             *block(2 * width, 2 * width), nn.Conv2d(2 * width, keypoints, 1))

    return Workload(model=model, dataset=lambda: Poses(size, image, keypoints, sigma),
                    loss=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]))


def _grid(image: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The y and x coordinates of an image's pixels, from -1 to 1: what a procedural
    image is drawn on."""
    return torch.meshgrid(torch.linspace(-1, 1, image), torch.linspace(-1, 1, image), indexing="ij")


def _crop_flip(x: torch.Tensor, image: int, crop: int, g: torch.Generator) -> torch.Tensor:
    """A random ``crop`` x ``crop`` window of the last two dimensions, flipped left to right
    half the time (the draws in that order, from ``g``)."""
    top, left = (int(v) for v in torch.randint(0, image - crop + 1, (2,), generator=g))
    x = x[..., top:top + crop, left:left + crop]
    return x.flip(-1) if torch.rand((), generator=g) < 0.5 else x


class Videos(Dataset):
    """Short video clips: frames of a drifting, rotating pattern; a random window of frames,
    a random spatial crop and flip, normalised per clip."""

    def __init__(self, size: int, frames: int, window: int, image: int, crop: int, classes: int):
        self.size, self.frames, self.window, self.image, self.crop, self.classes = \
            size, frames, window, image, crop, classes
        self.ys, self.xs = _grid(image)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = i % self.classes
        speed, freq = 0.05 + 0.05 * label, 3 + 6 * torch.rand(3, 1, 1, 1, generator=g)
        t = torch.arange(self.frames).view(1, -1, 1, 1) * speed
        clip = torch.sin(freq * (self.xs + t) + torch.rand(3, 1, 1, 1, generator=g) * 6.28) * torch.cos(freq * self.ys - t)
        clip = clip + 0.1 * torch.randn(3, self.frames, self.image, self.image, generator=g)
        start = int(torch.randint(0, self.frames - self.window + 1, (), generator=g))
        clip = _crop_flip(clip[:, start:start + self.window], self.image, self.crop, g)
        return ((clip - clip.mean()) / (clip.std() + 1e-6)).contiguous(), label


def video(size: int = 2048, frames: int = 16, window: int = 8, image: int = 40, crop: int = 32, classes: int = 8,
          width: int = 16) -> Workload:
    """A 3-D conv clip classifier: two Conv3d blocks over time and space, pooled, a linear head."""

    def model():
        return nn.Sequential(nn.Conv3d(3, width, 3, padding=1), nn.BatchNorm3d(width), nn.ReLU(),
                             nn.MaxPool3d((1, 2, 2)), nn.Conv3d(width, 2 * width, 3, padding=1),
                             nn.BatchNorm3d(2 * width), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                             nn.Linear(2 * width, classes))

    return Workload(model=model, dataset=lambda: Videos(size, frames, window, image, crop, classes),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


class Pairs(Dataset):
    """Sentence pairs for translation: a source sentence of words drawn on read, split and
    looked up in a word vocabulary (a word-level tokenizer's work, a Python loop per
    word), and its target: the words mapped and in reverse order, between begin and end
    marks. Ids 0-2 are padding, begin and end."""

    def __init__(self, size: int, vocab: int, shortest: int, longest: int):
        self.size, self.vocab, self.shortest, self.longest = size, vocab, shortest, longest
        self.index = {f"w{i}": i + 3 for i in range(vocab)}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import random

        rng = random.Random(i)
        text = " ".join(f"w{rng.randrange(self.vocab)}" for _ in range(rng.randint(self.shortest, self.longest)))
        source = [self.index[w] for w in text.split()]
        target = [1] + [(t * 7) % self.vocab + 3 for t in reversed(source)] + [2]
        return torch.tensor(source), torch.tensor(target)


def pad_pairs(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Sources and targets, each padded with 0 to the longest of the batch."""
    sources, targets = zip(*items, strict=True)
    return (nn.utils.rnn.pad_sequence(sources, batch_first=True),
            nn.utils.rnn.pad_sequence(targets, batch_first=True))


class Seq2Seq(nn.Module):
    """An encoder-decoder transformer (``nn.Transformer``) with learned positions; padding
    masked in both sequences, the decoder causal."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab + 3, dim, padding_idx=0)
        self.position = nn.Embedding(512, dim)
        self.core = nn.Transformer(dim, heads, layers, layers, 4 * dim, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, vocab + 3)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        def embed(ids: torch.Tensor) -> torch.Tensor:
            return self.embed(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))

        n = target.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=target.device), 1)
        out = self.core(embed(source), embed(target), tgt_mask=causal, src_key_padding_mask=source == 0,
                        tgt_key_padding_mask=target == 0, memory_key_padding_mask=source == 0)
        return self.head(out)


def translate(size: int = 8192, vocab: int = 4000, shortest: int = 8, longest: int = 48, dim: int = 128,
              heads: int = 4, layers: int = 2) -> Workload:
    """Sequence-to-sequence translation: teacher forcing, label smoothing, the padding left
    out of the loss."""

    def loss(model, batch):
        source, target = batch
        logits = model(source, target[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1),
                                           ignore_index=0, label_smoothing=0.1)

    return Workload(model=lambda: Seq2Seq(vocab, dim, heads, layers),
                    dataset=lambda: Pairs(size, vocab, shortest, longest), loss=loss, collate=pad_pairs,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=5e-4))


class Swatches(Dataset):
    """Labelled images: a sum of oriented waves whose frequency band is the label, with
    a random colour cast, then a random crop, flip and noise in the loading process."""

    def __init__(self, size: int, image: int, crop: int, classes: int):
        self.size, self.image, self.crop, self.classes = size, image, crop, classes
        self.ys, self.xs = _grid(image)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g, label = torch.Generator().manual_seed(i), i % self.classes
        angles = torch.rand(4, 1, 1, generator=g) * 3.14
        freqs = (2 + 3 * label) * (1 + 0.2 * torch.rand(4, 1, 1, generator=g))
        waves = torch.sin(freqs * (self.xs * angles.cos() + self.ys * angles.sin())).sum(0)
        img = waves * (0.5 + torch.rand(3, 1, 1, generator=g))
        img = _crop_flip(img, self.image, self.crop, g)
        return (img + 0.1 * torch.randn(img.shape, generator=g)).contiguous(), label


def _convnet(width: int, classes: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, classes))


class Distilled(nn.Module):
    """A small student conv net beside a frozen teacher four times as wide: the teacher's
    forward runs without gradients, in eval mode, in every step."""

    def __init__(self, width: int, classes: int):
        super().__init__()
        self.teacher = _convnet(4 * width, classes).eval().requires_grad_(False)
        self.student = _convnet(width, classes)

    def train(self, mode: bool = True) -> Distilled:
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            teacher = self.teacher(x)
        return self.student(x), teacher


def distill(size: int = 4096, image: int = 40, crop: int = 32, classes: int = 10, width: int = 16,
            temperature: float = 4.0) -> Workload:
    """Knowledge distillation: the student's loss is the KL divergence from the teacher's
    softened outputs plus the labels' cross-entropy."""

    def loss(model, batch):
        x, y = batch
        student, teacher = model(x)
        soft = nn.functional.kl_div(nn.functional.log_softmax(student / temperature, -1),
                                    nn.functional.log_softmax(teacher / temperature, -1),
                                    reduction="batchmean", log_target=True)
        return soft * temperature ** 2 + nn.functional.cross_entropy(student, y)

    return Workload(model=lambda: Distilled(width, classes), dataset=lambda: Swatches(size, image, crop, classes),
                    loss=loss)


class Tiles(Swatches):
    """Textured tiles made on each read: a random crop and flip, a brightness and contrast
    jitter, normalised per image (an augmentation pipeline's cheap per-sample work)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g, label = torch.Generator().manual_seed(i), i % self.classes
        phase = torch.rand(3, 1, 1, generator=g) * 6.28
        img = torch.cos((1 + label) * self.xs + phase) * torch.sin((2 + label) * self.ys - phase)
        img = _crop_flip(img, self.image, self.crop, g)
        img = img * (0.7 + 0.6 * torch.rand((), generator=g)) + 0.2 * torch.rand((), generator=g)
        return ((img - img.mean()) / (img.std() + 1e-6)).contiguous(), label


class InvertedResidual(nn.Module):
    """MobileNetV2's block: a 1x1 expansion, a 3x3 depthwise conv, a 1x1 projection; the
    input added back where the shapes match."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        mid = cin * expand
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.skip else self.body(x)


def mobilenet(size: int = 4096, image: int = 72, crop: int = 64, classes: int = 10, width: int = 16) -> Workload:
    """A MobileNetV2-style net: depthwise-separable convolutions, whose depthwise layers move
    much memory for little arithmetic (unlike the dense convolutions of the other conv
    workloads), with BatchNorm after every conv."""

    def model():
        blocks, cin = [], width
        for cout, stride in ((width, 1), (2 * width, 2), (2 * width, 1), (4 * width, 2), (4 * width, 1),
                             (8 * width, 2)):
            blocks.append(InvertedResidual(cin, cout, stride, expand=4))
            cin = cout
        return nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                             nn.ReLU6(), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    return Workload(model=model, dataset=lambda: Tiles(size, image, crop, classes),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


_WORDS = ("a", "the", "red", "blue", "green", "small", "large", "striped", "dotted", "round", "square", "cat", "dog",
          "car", "tree", "house", "boat", "bird", "on", "under", "beside", "near", "grass", "water", "road", "sky",
          "sitting", "running", "parked", "flying", "old", "new", "bright", "dark", "two", "three", "with", "and")


class Captioned(Dataset):
    """Image-text pairs, as a CLIP-style pipeline reads them: each read draws an image (a
    random blend of waves), crops and flips it, and writes a caption of 6-40 words that
    a Python tokenizer (lower-casing, splitting, a hashed vocabulary) turns into ids."""

    def __init__(self, size: int, image: int, crop: int, vocab: int):
        self.size, self.image, self.crop, self.vocab = size, image, crop, vocab
        self.ys, self.xs = _grid(image)

    def __len__(self) -> int:
        return self.size

    def _tokens(self, text: str) -> torch.Tensor:
        ids = [1 + (sum(ord(c) * 31 ** j for j, c in enumerate(w)) % (self.vocab - 1))
               for w in text.lower().replace(",", " ").split()]
        return torch.tensor(ids, dtype=torch.long)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        freq, phase = torch.rand(3, 2, generator=g) * 6, torch.rand(3, 1, 1, generator=g) * 6.28
        img = torch.sin(freq[:, :1, None] * self.xs + freq[:, 1:, None] * self.ys + phase)
        img = _crop_flip(img, self.image, self.crop, g)
        n = int(torch.randint(6, 41, (), generator=g))
        picks = torch.randint(0, len(_WORDS), (n,), generator=g).tolist()
        text = " ".join(_WORDS[p].capitalize() if k % 7 == 0 else _WORDS[p] for k, p in enumerate(picks))
        return img.contiguous(), self._tokens(text)


def pad_captions(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's images stacked and its captions padded to the longest (0 pads)."""
    images, tokens = zip(*items, strict=True)
    return torch.stack(images), nn.utils.rnn.pad_sequence(list(tokens), batch_first=True)


class DualEncoder(nn.Module):
    """A conv image tower and a transformer text tower (padding masked, mean-pooled) into
    one embedding space."""

    def __init__(self, vocab: int, width: int, dim: int, heads: int):
        super().__init__()
        self.image = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.BatchNorm2d(4 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, dim))
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.position = nn.Parameter(torch.zeros(64, dim))
        self.text = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0,
                                                                     batch_first=True), 2)
        self.scale = nn.Parameter(torch.tensor(2.6))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pad = tokens == 0
        t = self.text(self.embed(tokens) + self.position[: tokens.shape[1]], src_key_padding_mask=pad)
        t = (t * ~pad[..., None]).sum(1) / (~pad).sum(1, keepdim=True)
        return (nn.functional.normalize(self.image(images), dim=1), nn.functional.normalize(t, dim=1),
                self.scale.exp())


def captions(size: int = 4096, image: int = 56, crop: int = 48, vocab: int = 4096, width: int = 24,
             dim: int = 96, heads: int = 4) -> Workload:
    """CLIP-style contrastive pretraining on image-caption pairs: two towers, the
    symmetric InfoNCE loss over the batch."""

    def loss(model, batch):
        images, tokens = batch
        a, b, scale = model(images, tokens)
        logits = scale * a @ b.T
        target = torch.arange(len(a), device=logits.device)
        return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target)) / 2

    return Workload(model=lambda: DualEncoder(vocab, width, dim, heads),
                    dataset=lambda: Captioned(size, image, crop, vocab), loss=loss, collate=pad_captions)


class Shapes(Dataset):
    """Detection scenes: a noisy background with 1-12 filled rectangles of random size,
    colour and class drawn on it, each with its box; flipped half the time. The boxes
    are a list of varied length per image."""

    def __init__(self, size: int, image: int, classes: int):
        self.size, self.image, self.classes = size, image, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        s = self.image
        img = 0.2 * torch.randn(3, s, s, generator=g)
        n = int(torch.randint(1, 13, (), generator=g))
        boxes = []
        for _ in range(n):
            w, h = (int(v) for v in torch.randint(s // 10, s // 3, (2,), generator=g))
            x, y = int(torch.randint(0, s - w, (), generator=g)), int(torch.randint(0, s - h, (), generator=g))
            label = int(torch.randint(0, self.classes, (), generator=g))
            img[:, y:y + h, x:x + w] = torch.rand(3, 1, 1, generator=g) * (1 + label) / self.classes
            boxes.append([x / s, y / s, (x + w) / s, (y + h) / s, label])
        target = torch.tensor(boxes)
        if torch.rand((), generator=g) < 0.5:
            img = img.flip(-1)
            target[:, [0, 2]] = 1 - target[:, [2, 0]]
        return img, target


def box_lists(items: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The images stacked; the boxes kept as a list (each image has its own number)."""
    images, targets = zip(*items, strict=True)
    return torch.stack(images), list(targets)


def detect(size: int = 4096, image: int = 64, classes: int = 4, width: int = 24) -> Workload:
    """A one-stage detector on a grid (as YOLO and CenterNet assign boxes): a conv backbone
    to a grid of stride 8, each cell predicting objectness, class and box; the targets
    are built in the loss, per image, from each box's centre cell."""
    cells = image // 8

    def block(cin: int, cout: int, stride: int = 1) -> list:
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.SiLU()]

    def model():
        return nn.Sequential(*block(3, width, 2), *block(width, width), *block(width, 2 * width, 2),
                             *block(2 * width, 2 * width), *block(2 * width, 4 * width, 2),
                             *block(4 * width, 4 * width), nn.Conv2d(4 * width, 5 + classes, 1))

    def loss(model, batch):
        images, targets = batch
        out = model(images)  # (batch, 5 + classes, cells, cells)
        obj = torch.zeros(out.shape[0], cells, cells, device=out.device)
        box_loss, cls_loss, hits = out.new_zeros(()), out.new_zeros(()), 0
        for b, t in enumerate(targets):
            t = t.to(out.device)
            cx, cy = (t[:, 0] + t[:, 2]) / 2, (t[:, 1] + t[:, 3]) / 2
            gx, gy = (cx * cells).long().clamp(0, cells - 1), (cy * cells).long().clamp(0, cells - 1)
            obj[b, gy, gx] = 1.0
            pred = out[b, :, gy, gx].T.float()  # (boxes, 5 + classes)
            wanted = torch.stack([cx * cells - gx, cy * cells - gy, t[:, 2] - t[:, 0], t[:, 3] - t[:, 1]], 1)
            box_loss = box_loss + nn.functional.smooth_l1_loss(pred[:, 1:5].sigmoid(), wanted, reduction="sum")
            cls_loss = cls_loss + nn.functional.cross_entropy(pred[:, 5:], t[:, 4].long(), reduction="sum")
            hits += len(t)
        obj_loss = nn.functional.binary_cross_entropy_with_logits(out[:, 0].float(), obj)
        return obj_loss + (box_loss + cls_loss) / max(hits, 1)

    return Workload(model=model, dataset=lambda: Shapes(size, image, classes), loss=loss, collate=box_lists)


_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "vo", "re", "pi", "du", "gan", "tel", "sor", "min", "bra", "ex")


class Sentences(Dataset):
    """Sentences of made-up words, written as text on each read and tokenized there by a
    pure-Python greedy longest-match word-piece tokenizer (as a slow Hugging Face
    tokenizer does in a dataset's ``__getitem__``): loading is Python, held by the GIL."""

    def __init__(self, size: int, shortest: int, longest: int, pieces: dict[str, int], classes: int):
        self.size, self.shortest, self.longest, self.pieces, self.classes = size, shortest, longest, pieces, classes
        self.widest = max(len(p) for p in pieces)

    def __len__(self) -> int:
        return self.size

    def _text(self, i: int) -> str:
        import random

        rng = random.Random(i)
        words = [("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
                 for _ in range(rng.randint(self.shortest, self.longest))]
        return " ".join(w.capitalize() if rng.random() < 0.1 else w for w in words) + "."

    def _tokens(self, text: str) -> list[int]:
        ids = [1]  # [CLS]
        for word in text.lower().replace(".", " .").split():
            start, first = 0, True
            while start < len(word):
                for end in range(min(len(word), start + self.widest), start, -1):
                    piece = word[start:end] if first else "##" + word[start:end]
                    if piece in self.pieces:
                        ids.append(self.pieces[piece])
                        start, first = end, False
                        break
                else:
                    ids.append(2)  # [UNK]
                    start, first = start + 1, False
        return ids

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._tokens(self._text(i))
        return torch.tensor(ids[:256]), torch.tensor(len(ids) % self.classes)


def pad_tokens(items: list) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = zip(*items, strict=True)
    return nn.utils.rnn.pad_sequence(ids, batch_first=True), torch.stack(labels)


def tokenize(size: int = 8192, shortest: int = 8, longest: int = 64, dim: int = 48, heads: int = 2,
             classes: int = 4) -> Workload:
    """A text classifier whose data is tokenized in Python on each read: a word-piece
    vocabulary of the syllables and their pairs, a one-layer transformer encoder, the
    mean over the padded tokens, a linear head."""
    import itertools

    vocab = ["[PAD]", "[CLS]", "[UNK]", "."] + list(_SYLLABLES) + ["##" + s for s in _SYLLABLES]
    vocab += ["".join(p) for p in itertools.product(_SYLLABLES[:8], repeat=2)]
    pieces = {p: i for i, p in enumerate(vocab)}

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(len(vocab), dim, padding_idx=0)
            self.encoder = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
            self.head = nn.Linear(dim, classes)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            pad = ids == 0
            h = self.encoder(self.embed(ids), src_key_padding_mask=pad)
            keep = (~pad).unsqueeze(-1).to(h.dtype)
            return self.head((h * keep).sum(1) / keep.sum(1).clamp(min=1))

    def loss(model, batch):
        ids, labels = batch
        return nn.functional.cross_entropy(model(ids).float(), labels)

    return Workload(model=Encoder, dataset=lambda: Sentences(size, shortest, longest, pieces, classes), loss=loss,
                    collate=pad_tokens)


class Volumes(Dataset):
    """Single-channel 3-D scans (a sphere of a class's texture in noise), made on each read
    with a random crop, flips on each axis and an intensity jitter, as medical-imaging
    pipelines (MONAI's RandSpatialCrop, RandFlip, RandScaleIntensity) augment on the CPU."""

    def __init__(self, size: int, side: int, crop: int, classes: int):
        self.size, self.side, self.crop, self.classes = size, side, crop, classes
        axis = torch.linspace(-1, 1, side)
        z, y, x = torch.meshgrid(axis, axis, axis, indexing="ij")
        self.radius = (x * x + y * y + z * z).sqrt()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        label = int(torch.randint(0, self.classes, (), generator=g))
        scan = torch.randn(self.side, self.side, self.side, generator=g) * 0.3
        texture = torch.sin(self.radius * (4 + 3 * label) * torch.pi)
        scan = scan + (self.radius < 0.7).float() * texture
        o = torch.randint(0, self.side - self.crop + 1, (3,), generator=g).tolist()
        scan = scan[o[0]:o[0] + self.crop, o[1]:o[1] + self.crop, o[2]:o[2] + self.crop]
        flips = [d for d in range(3) if torch.rand((), generator=g) < 0.5]
        if flips:
            scan = scan.flip(flips)
        scan = scan * (0.9 + 0.2 * torch.rand((), generator=g))
        return scan.unsqueeze(0).contiguous(), torch.tensor(label)


def volumes(size: int = 2048, side: int = 40, crop: int = 24, classes: int = 3, width: int = 8) -> Workload:
    """A 3-D convolutional classifier (a small 3-D ResNet-like stack: Conv3d, BatchNorm3d,
    ReLU, strided down twice) on augmented scans."""

    def block(cin: int, cout: int, stride: int) -> list:
        return [nn.Conv3d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm3d(cout), nn.ReLU()]

    def model():
        return nn.Sequential(*block(1, width, 1), *block(width, 2 * width, 2), *block(2 * width, 2 * width, 1),
                             *block(2 * width, 4 * width, 2), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                             nn.Linear(4 * width, classes))

    def loss(model, batch):
        scans, labels = batch
        return nn.functional.cross_entropy(model(scans).float(), labels)

    return Workload(model=model, dataset=lambda: Volumes(size, side, crop, classes), loss=loss)


# 5x3 bitmaps of the digits, row by row (1: ink)
_DIGITS = ("111101101101111", "010110010010111", "111001111100111", "111001111001111", "101101111001001",
           "111100111001111", "111100111101111", "111001001001001", "111101111101111", "111101111001111")


class DigitStrings(Dataset):
    """Lines of 3 to 8 digits rendered on each read from a bitmap font (each glyph scaled,
    placed with a random gap and baseline jitter), blurred and noised: an OCR line image,
    its digits the target (labels 1-10; 0 is CTC's blank)."""

    def __init__(self, size: int, height: int, width: int):
        self.size, self.height, self.width = size, height, width
        self.glyphs = torch.tensor([[int(c) for c in d] for d in _DIGITS], dtype=torch.float32).view(10, 1, 5, 3)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(3, 9, (), generator=g))
        digits = torch.randint(0, 10, (n,), generator=g)
        scale = int(torch.randint(2, 4, (), generator=g))
        image = torch.zeros(self.height, self.width)
        x = int(torch.randint(0, 6, (), generator=g))
        for d in digits.tolist():
            glyph = nn.functional.interpolate(self.glyphs[d:d + 1], scale_factor=scale, mode="nearest")[0, 0]
            h, w = glyph.shape
            y = int(torch.randint(0, self.height - h + 1, (), generator=g))
            if x + w > self.width:
                break
            image[y:y + h, x:x + w] = torch.maximum(image[y:y + h, x:x + w], glyph)
            x += w + int(torch.randint(1, 4, (), generator=g))
        kernel = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]).view(1, 1, 3, 3) / 16
        image = nn.functional.conv2d(image.view(1, 1, self.height, self.width), kernel, padding=1)[0]
        image = image + 0.15 * torch.randn(image.shape, generator=g)
        return image, digits + 1


def ctc_batch(items: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    images, labels = zip(*items, strict=True)
    return (torch.stack(images), torch.cat(labels), torch.tensor([len(t) for t in labels]))


def ocr(size: int = 4096, height: int = 16, width: int = 96, width_mult: int = 32, hidden: int = 64) -> Workload:
    """A CRNN line recognizer: a conv stack that keeps the line's width as time steps, a
    bidirectional LSTM over them, and the CTC loss against the digits."""

    class CRNN(nn.Module):
        def __init__(self):
            super().__init__()
            c = width_mult
            self.conv = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(c, 2 * c, 3, padding=1), nn.BatchNorm2d(2 * c), nn.ReLU(),
                                      nn.MaxPool2d((2, 1)))
            self.rnn = nn.LSTM(2 * c * (height // 4), hidden, batch_first=True, bidirectional=True)
            self.head = nn.Linear(2 * hidden, 11)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            f = self.conv(images)  # (batch, channels, height / 4, width / 2)
            f = f.flatten(1, 2).transpose(1, 2)  # (batch, time, features)
            out, _ = self.rnn(f)
            return self.head(out)

    def loss(model, batch):
        images, targets, lengths = batch
        logits = model(images).float().log_softmax(-1).transpose(0, 1)  # (time, batch, classes)
        steps = torch.full((logits.shape[1],), logits.shape[0], dtype=torch.long)
        return nn.functional.ctc_loss(logits, targets, steps, lengths, zero_infinity=True)

    return Workload(model=CRNN, dataset=lambda: DigitStrings(size, height, width), loss=loss, collate=ctc_batch)


class CsvRows(Dataset):
    """Rows of a table kept as CSV text (as read from a file), parsed on each read in
    Python: numeric fields to floats, standardized by the column's statistics, a missing
    value filled; categorical fields looked up in their vocabularies."""

    CATEGORIES = (24, 7, 365, 50, 1000, 12)

    def __init__(self, size: int, numeric: int):
        import random

        rng = random.Random(0)
        self.numeric = numeric
        lines = []
        for _ in range(size):
            nums = ["" if rng.random() < 0.05 else f"{rng.gauss(10.0 * (j % 3), 1.0 + j % 5):.4f}"
                    for j in range(numeric)]
            cats = [f"c{j}_{rng.randrange(n)}" for j, n in enumerate(self.CATEGORIES)]
            lines.append(",".join(nums + cats + [str(rng.randrange(2))]))
        self.lines = lines
        self.vocab = [{f"c{j}_{k}": k for k in range(n)} for j, n in enumerate(self.CATEGORIES)]
        self.mean = [10.0 * (j % 3) for j in range(numeric)]
        self.std = [1.0 + j % 5 for j in range(numeric)]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fields = self.lines[i].split(",")
        nums = [(float(f) - m) / s if f else 0.0
                for f, m, s in zip(fields[:self.numeric], self.mean, self.std, strict=True)]
        cats = [v.get(f, 0) for f, v in zip(fields[self.numeric:-1], self.vocab, strict=True)]
        return torch.tensor(nums), torch.tensor(cats), torch.tensor(float(fields[-1]))


def csvrows(size: int = 32768, numeric: int = 40, dim: int = 16, width: int = 256) -> Workload:
    """A tabular classifier on parsed CSV rows: an embedding per categorical column,
    concatenated with the numeric fields, an MLP with a residual block, a logistic loss."""

    class Tabular(nn.Module):
        def __init__(self):
            super().__init__()
            self.embeds = nn.ModuleList(nn.Embedding(n, dim) for n in CsvRows.CATEGORIES)
            self.inp = nn.Linear(numeric + dim * len(CsvRows.CATEGORIES), width)
            self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(),
                                       nn.Linear(width, width))
            self.out = nn.Linear(width, 1)

        def forward(self, nums: torch.Tensor, cats: torch.Tensor) -> torch.Tensor:
            e = [emb(cats[:, j]) for j, emb in enumerate(self.embeds)]
            h = nn.functional.gelu(self.inp(torch.cat([nums, *e], 1)))
            return self.out(h + self.block(h)).squeeze(1)

    def loss(model, batch):
        nums, cats, labels = batch
        return nn.functional.binary_cross_entropy_with_logits(model(nums, cats).float(), labels)

    return Workload(model=Tabular, dataset=lambda: CsvRows(size, numeric), loss=loss)


class Stripes(Dataset):
    """Procedural images (oriented stripes and blobs of a random palette), each read made
    and then cropped and flipped: self-supervised pretraining data, no label."""

    def __init__(self, size: int, image: int, crop: int):
        self.size, self.image, self.crop = size, image, crop
        axis = torch.linspace(-1, 1, image)
        self.y, self.x = torch.meshgrid(axis, axis, indexing="ij")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        angle, freq = torch.rand(2, generator=g) * torch.tensor([3.1416, 12.0]) + torch.tensor([0.0, 2.0])
        stripes = torch.sin((self.x * angle.cos() + self.y * angle.sin()) * freq)
        cx, cy = torch.rand(2, generator=g) * 2 - 1
        blob = torch.exp(-((self.x - cx) ** 2 + (self.y - cy) ** 2) * 8)
        palette = torch.rand(3, 2, generator=g)
        img = palette[:, :1, None] * stripes + palette[:, 1:, None] * blob
        o = torch.randint(0, self.image - self.crop + 1, (2,), generator=g).tolist()
        img = img[:, o[0]:o[0] + self.crop, o[1]:o[1] + self.crop]
        if torch.rand((), generator=g) < 0.5:
            img = img.flip(2)
        return img.contiguous()


def mae(size: int = 4096, image: int = 40, crop: int = 32, patch: int = 4, dim: int = 64, depth: int = 2,
        heads: int = 4, mask: float = 0.75) -> Workload:
    """A masked autoencoder (MAE): a ViT encoder on the quarter of the patches a per-batch
    random mask keeps (an argsort of noise and a gather in the model), a one-layer decoder
    that fills in mask tokens, the loss on the masked patches' normalized pixels."""
    n = (crop // patch) ** 2
    keep = int(n * (1 - mask))

    class MAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3 * patch * patch, dim)
            self.pos = nn.Parameter(torch.randn(1, n, dim) * 0.02)
            layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
            self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
            self.decoder = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                                      norm_first=True)
            self.pixels = nn.Linear(dim, 3 * patch * patch)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            b = images.shape[0]
            patches = images.unfold(2, patch, patch).unfold(3, patch, patch)  # b, 3, h, w, p, p
            patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, n, -1)
            order = torch.rand(b, n, device=images.device).argsort(1)
            kept, masked = order[:, :keep], order[:, keep:]
            tokens = self.embed(patches) + self.pos
            seen = self.encoder(tokens.gather(1, kept.unsqueeze(-1).expand(-1, -1, dim)))
            full = self.mask_token.expand(b, n, dim).clone()
            full = full.scatter(1, kept.unsqueeze(-1).expand(-1, -1, dim), seen.to(full.dtype)) + self.pos
            pred = self.pixels(self.decoder(full))
            target = patches.gather(1, masked.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
            target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6).sqrt()
            guess = pred.gather(1, masked.unsqueeze(-1).expand(-1, -1, pred.shape[-1]))
            return nn.functional.mse_loss(guess.float(), target.float())

    return Workload(model=MAE, dataset=lambda: Stripes(size, image, crop), loss=lambda model, batch: model(batch))


class Neighbourhoods(Dataset):
    """The nodes of a large synthetic graph (long-tailed degrees, a feature vector per node,
    a class per node). Each read samples the node's two-hop neighbourhood from the
    adjacency lists, ``fanout`` neighbours per hop drawn with replacement, and gathers
    their features: the per-node minibatch sampling of GraphSAGE-style training."""

    def __init__(self, nodes: int, features: int, fanout: tuple[int, int], classes: int):
        g = torch.Generator().manual_seed(0)
        degree = (torch.rand(nodes, generator=g).pow(-0.7)).clamp(max=500).long()  # a long tail
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), degree.cumsum(0)])
        self.targets = torch.randint(nodes, (int(self.offsets[-1]),), generator=g)
        self.features = torch.randn(nodes, features, generator=g)
        self.labels = torch.randint(classes, (nodes,), generator=g)
        self.fanout = fanout

    def __len__(self) -> int:
        return len(self.labels)

    def _sample(self, nodes: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
        start, count = self.offsets[nodes], self.offsets[nodes + 1] - self.offsets[nodes]
        pick = (torch.rand(len(nodes), k, generator=g) * count[:, None]).long()
        return self.targets[start[:, None] + pick].flatten()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        hop1 = self._sample(torch.tensor([i]), self.fanout[0], g)
        hop2 = self._sample(hop1, self.fanout[1], g)
        return self.features[i], self.features[hop1], self.features[hop2], self.labels[i]


def neighbors(nodes: int = 100000, features: int = 128, fanout: tuple[int, int] = (10, 5), hidden: int = 512,
              classes: int = 8) -> Workload:
    """GraphSAGE node classification on sampled neighbourhoods: two layers, each a node's
    own features and the mean of its sampled neighbours', concatenated, through a linear
    layer; a cross-entropy loss on the node's class."""
    f1, f2 = fanout

    class Sage(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer1 = nn.Linear(2 * features, hidden)
            self.layer2 = nn.Linear(2 * hidden, hidden)
            self.head = nn.Linear(hidden, classes)

        def forward(self, own: torch.Tensor, hop1: torch.Tensor, hop2: torch.Tensor) -> torch.Tensor:
            b = own.shape[0]
            h1 = torch.relu(self.layer1(torch.cat([hop1, hop2.view(b, f1, f2, -1).mean(2)], -1)))
            h0 = torch.relu(self.layer1(torch.cat([own, hop1.mean(1)], -1)))
            h = torch.relu(self.layer2(torch.cat([h0, h1.mean(1)], -1)))
            return self.head(h)

    def loss(model, batch):
        own, hop1, hop2, labels = batch
        return nn.functional.cross_entropy(model(own, hop1, hop2).float(), labels)

    return Workload(model=Sage, dataset=lambda: Neighbourhoods(nodes, features, fanout, classes), loss=loss)


class Recordings(Dataset):
    """Twelve-lead ECG-like recordings held as raw int16 counts, as a device stores them:
    on each read a zero-phase Butterworth band-pass (SciPy, in NumPy on the loading
    process), a random crop and an amplitude jitter."""

    def __init__(self, size: int, leads: int, rate: int, seconds: float, crop: int, classes: int):
        import numpy as np
        from scipy import signal

        rng = np.random.default_rng(0)
        n = int(rate * seconds)
        t = (np.arange(n) / rate).astype(np.float32)
        beats = (1.0 + 0.6 * rng.random((size, 1, 1))).astype(np.float32)
        phase = (rng.random((size, leads, 1)) * 6.28).astype(np.float32)
        wave = np.sin(2 * np.pi * beats * t + phase)
        pulse = np.maximum(wave, 0) ** 8  # a sharp spike per beat, a QRS of sorts
        wander = 0.5 * np.sin(2 * np.pi * 0.2 * t + phase)  # baseline wander the band-pass removes
        noisy = pulse + wander + 0.05 * rng.standard_normal((size, leads, n), dtype=np.float32)
        self.counts = (noisy * 1000).astype(np.int16)
        self.labels = (beats[:, 0, 0] * classes / 1.6).astype(int).clip(0, classes - 1)
        self.sos = signal.butter(4, [0.5, 40.0], btype="bandpass", fs=rate, output="sos")
        self.crop = crop

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import numpy as np
        from scipy import signal

        rng = np.random.default_rng(i)
        x = signal.sosfiltfilt(self.sos, self.counts[i].astype(np.float32) / 1000.0, axis=-1)
        start = int(rng.integers(0, x.shape[-1] - self.crop))
        x = x[:, start:start + self.crop] * (0.8 + 0.4 * rng.random())
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), int(self.labels[i])


def ecg(size: int = 1024, leads: int = 12, rate: int = 250, seconds: float = 10.0, crop: int = 2000,
        width: int = 32, classes: int = 5) -> Workload:
    """Rhythm classification on 12-lead ECGs: a 1-D residual conv net (batch norm, strided
    blocks) over the filtered crop, a cross-entropy loss; the filtering is the loading
    process's work."""

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int):
            super().__init__()
            self.body = nn.Sequential(nn.Conv1d(cin, cout, 7, stride=2, padding=3), nn.BatchNorm1d(cout), nn.ReLU(),
                                      nn.Conv1d(cout, cout, 7, padding=3), nn.BatchNorm1d(cout))
            self.skip = nn.Conv1d(cin, cout, 1, stride=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x) + self.skip(x))

    def model():
        return nn.Sequential(nn.Conv1d(leads, width, 15, stride=2, padding=7), nn.BatchNorm1d(width), nn.ReLU(),
                             Block(width, width), Block(width, 2 * width), Block(2 * width, 2 * width),
                             Block(2 * width, 4 * width), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                             nn.Linear(4 * width, classes))

    return Workload(model=model, dataset=lambda: Recordings(size, leads, rate, seconds, crop, classes),
                    loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]))


class Sprites(Dataset):
    """Small images held in memory as uint8 (blobs and stripes in random colours), scaled
    to [-1, 1] and flipped at random on each read: the cheap loading of a diffusion model,
    whose work is in the step."""

    def __init__(self, size: int, image: int):
        g = torch.Generator().manual_seed(0)
        ys, xs = _grid(image)
        centres = torch.rand(size, 2, 1, 1, generator=g) * 2 - 1
        blob = torch.exp(-((xs - centres[:, :1]) ** 2 + (ys - centres[:, 1:]) ** 2) * 8)
        stripes = torch.sin(xs * (3 + 6 * torch.rand(size, 1, 1, 1, generator=g)))
        img = blob * torch.rand(size, 3, 1, 1, generator=g) + 0.3 * stripes * torch.rand(size, 3, 1, 1, generator=g)
        self.pixels = ((img.clamp(-1, 1) + 1) * 127.5).to(torch.uint8)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.pixels[i].float() / 127.5 - 1
        return x.flip(-1) if torch.rand(()) < 0.5 else x


def diffusion(size: int = 4096, image: int = 32, width: int = 16, steps: int = 1000) -> Workload:
    """A denoising diffusion model (DDPM's noise-prediction loss): each step draws a
    timestep and Gaussian noise per image on the training device, noises the batch by the
    cosine schedule, and a small U-Net with a sinusoidal time embedding and group norm
    predicts the noise."""

    class Res(nn.Module):
        def __init__(self, cin: int, cout: int, temb: int):
            super().__init__()
            self.norm1, self.conv1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.time = nn.Linear(temb, cout)
            self.norm2, self.conv2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            h = self.conv1(nn.functional.silu(self.norm1(x))) + self.time(t)[:, :, None, None]
            return self.skip(x) + self.conv2(nn.functional.silu(self.norm2(h)))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            w, temb = width, 4 * width
            self.temb = nn.Sequential(nn.Linear(w, temb), nn.SiLU(), nn.Linear(temb, temb))
            self.stem = nn.Conv2d(3, w, 3, padding=1)
            self.down1, self.down2 = Res(w, w, temb), Res(w, 2 * w, temb)
            self.mid = Res(2 * w, 2 * w, temb)
            self.up2, self.up1 = Res(4 * w, w, temb), Res(2 * w, w, temb)
            self.out = nn.Sequential(nn.GroupNorm(8, w), nn.SiLU(), nn.Conv2d(w, 3, 3, padding=1))

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            half = width // 2
            freqs = torch.exp(-torch.arange(half, device=x.device) * (9.21 / half))  # 10,000 ** (-k / half)
            angles = t[:, None].float() * freqs
            emb = self.temb(torch.cat([angles.sin(), angles.cos()], -1))
            h0 = self.stem(x)
            h1 = self.down1(h0, emb)
            h2 = self.down2(nn.functional.avg_pool2d(h1, 2), emb)
            m = self.mid(nn.functional.avg_pool2d(h2, 2), emb)
            u2 = self.up2(torch.cat([nn.functional.interpolate(m, scale_factor=2), h2], 1), emb)
            u1 = self.up1(torch.cat([nn.functional.interpolate(u2, scale_factor=2), h1], 1), emb)
            return self.out(u1)

    def loss(model, x):
        t = torch.randint(0, steps, (x.shape[0],), device=x.device)
        alpha_bar = torch.cos((t.float() / steps + 0.008) / 1.008 * torch.pi / 2) ** 2
        a = alpha_bar[:, None, None, None]
        noise = torch.randn_like(x)
        noised = a.sqrt() * x + (1 - a).sqrt() * noise
        return nn.functional.mse_loss(model(noised, t).float(), noise)

    return Workload(model=UNet, dataset=lambda: Sprites(size, image), loss=loss,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=2e-4))
