"""A Hugging Face model on a tokenized dataset built here: a small BERT classifier, a
word-level tokenizer trained on the file's own corpus (no download), batches padded per
batch by the collator, the loss from the model's output.

    pip install -e ".[hf]"
    python -m tuner run examples/hf/space.yaml
    python -m tuner export results/example-hf --format hf
"""

import random

import torch

from tuner.hf import hf_workload

POSITIVE = ["good", "great", "fine", "lovely", "bright", "calm", "happy", "warm"]
NEGATIVE = ["bad", "poor", "dull", "grim", "cold", "sad", "harsh", "weak"]
FILLER = ["the", "a", "film", "day", "meal", "room", "song", "was", "felt", "very", "quite", "and", "but", "it"]


def corpus(size: int, seed: int = 0) -> list[tuple[str, int]]:
    """Sentences of varied length, labelled by which kind of word they hold more of."""
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        label = rng.randint(0, 1)
        words = rng.choices(FILLER, k=rng.randint(4, 40))
        for _ in range(rng.randint(1, 4)):
            words.insert(rng.randrange(len(words) + 1), rng.choice(POSITIVE if label else NEGATIVE))
        out.append((" ".join(words), label))
    return out


def tokenizer():
    """A word-level tokenizer trained on the vocabulary above: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(POSITIVE + NEGATIVE + FILLER)],
                            trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


class Reviews(torch.utils.data.Dataset):
    """Tokenized once, here; items are dicts of lists, padded per batch by the collator."""

    def __init__(self, size: int = 4096):
        tok = tokenizer()
        rows = corpus(size)
        enc = tok([t for t, _ in rows], truncation=True, max_length=64)
        self.items = [{"input_ids": ids, "attention_mask": mask, "labels": label}
                      for ids, mask, (_, label) in zip(enc["input_ids"], enc["attention_mask"], rows, strict=True)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def make(size: int = 4096):
    from transformers import AutoModelForSequenceClassification, BertConfig, DataCollatorWithPadding

    tok = tokenizer()
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=256, max_position_embeddings=64, num_labels=2)
    return hf_workload(config, dataset=lambda: Reviews(size), model_class=AutoModelForSequenceClassification,
                       collate=DataCollatorWithPadding(tok))
