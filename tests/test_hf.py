"""tuner.hf: a Workload from a transformers model built from a config, and a dataset of
dicts, through the real command line (no download: the model comes from a config)."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import space_lines

pytest.importorskip("transformers")

WORKLOAD = '''\
import torch
from transformers import GPT2Config

from tuner.hf import hf_workload


def tokens(n=64, seq=16, vocab=256):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (seq,), generator=g),
             "attention_mask": torch.ones(seq, dtype=torch.long)} for _ in range(n)]


def make(labels_from="input_ids", as_module=False):
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    if as_module:
        from transformers import GPT2LMHeadModel

        return hf_workload(GPT2LMHeadModel(config), dataset=tokens, labels_from=labels_from)
    return hf_workload(config, dataset=tokens(), labels_from=labels_from)
'''


def _bench(tmp_path, args="", *flags):
    (tmp_path / "my_workload.py").write_text(WORKLOAD)
    space = tmp_path / "space.yaml"
    space.write_text(textwrap.dedent(f"""\
        name: hf
        workload: my_workload.py:make
        workload_args: {{{args}}}
        knobs:
          micro_batch_size: [8]
        """) + space_lines())
    return subprocess.run([sys.executable, "-m", "tuner", "bench", str(space), "--json", *flags],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("args, flags", [
    ("", ()),  # a config and a list of dicts, in the trial's process
    ("as_module: true", ("--set", "num_workers=1")),  # a module copied per trial; a DataLoader worker
])
def test_a_model_from_a_config_trains_with_its_own_loss(tmp_path, args, flags):
    r = _bench(tmp_path, args, *flags)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["samples_per_sec"] > 0 and out["loss_finite"] is True
    assert out["config"]["micro_batch_size"] == 8


def test_the_trainers_clipping_and_the_rest_of_its_step_reach_the_workload():
    # the Trainer clips at 1.0 by default: a figure of its training passes it
    import torch

    from tuner.hf import hf_workload

    after = lambda model, optimizer: None  # noqa: E731
    wl = hf_workload(torch.nn.Linear(2, 2), [{"x": torch.zeros(2)}], clip_grad_norm=1.0, after_step=after)
    assert wl.clip_grad_norm == 1.0 and wl.after_step is after
    assert hf_workload(torch.nn.Linear(2, 2), [{"x": torch.zeros(2)}]).clip_grad_norm is None


def test_lengths_by_key_read_each_item_s_tokens_or_the_dataset_s_column():
    # as the Trainer's own length-grouped sampler reads input_ids
    import torch

    from tuner.hf import hf_workload

    items = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (3, 7, 5)]
    wl = hf_workload(torch.nn.Linear(2, 2), items, lengths="input_ids")
    assert wl.lengths(items) == [3, 7, 5]

    class Columns(list):  # a datasets.Dataset answers a column's name with the column
        column_names = ["input_ids"]

        def __getitem__(self, key):
            return [x["input_ids"] for x in self] if key == "input_ids" else super().__getitem__(key)

    assert wl.lengths(Columns(items)) == [3, 7, 5]
    own = lambda ds: [1, 1, 1]  # noqa: E731
    assert hf_workload(torch.nn.Linear(2, 2), items, lengths=own).lengths is own


@pytest.mark.slow
def test_a_model_that_returns_no_loss_is_one_line_naming_the_fix(tmp_path):
    r = _bench(tmp_path, "labels_from: null")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "returned no loss" in lines[0] and "labels_from" in lines[0], r.stderr
