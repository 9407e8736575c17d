"""tuner.lightning: a Workload from a real LightningModule and LightningDataModule, whose
training_step runs inside the module that compile and DDP wrap."""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers import space_lines
from tuner.errors import UserError, WorkloadError
from tuner.lightning import lightning_workload

# found, not imported: importing lightning takes seconds, which each xdist worker would
# spend collecting (the tests import it where they run)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")

MODULE = '''\
import lightning as L
import torch


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return {"x": x, "y": x.sum(0, keepdim=True)}


class Regression(L.LightningModule):
    def __init__(self, steps_return="loss"):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.steps_return = steps_return

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self(batch["x"].to(self.device)), batch["y"])
        self.log("train_loss", loss)
        return {"loss": loss} if self.steps_return == "dict" else (None if self.steps_return == "none" else loss)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}


class Data(L.LightningDataModule):
    def setup(self, stage):
        self.train = Pairs()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train, batch_size=4, shuffle=True)


def make(steps_return="loss"):
    from tuner.lightning import lightning_workload

    return lightning_workload(Regression(steps_return), datamodule=Data())


class Hooked(Regression):
    """Per-batch hooks that a LightningModule overrides (an EMA of the weights in
    on_train_batch_end), and one between backward and the step."""

    events = []  # (hook, batch_idx or None, what it saw)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {"loss": loss, "size": batch["x"].shape[0]}

    def on_train_batch_start(self, batch, batch_idx):
        self.events.append(("start", batch_idx, float(self.net[0].weight.detach().sum())))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.events.append(("end", batch_idx, (outputs["loss"].requires_grad, outputs["size"], len(batch["x"]),
                                               float(self.net[0].weight.detach().sum()))))

    def on_before_zero_grad(self, optimizer):
        self.events.append(("zero_grad", None, type(optimizer).__name__))

    def on_after_backward(self):
        self.events.append(("after_backward", None, None))


def make_hooked(after_step=None):
    from tuner.lightning import lightning_workload

    return lightning_workload(Hooked, datamodule=Data(), after_step=after_step)
'''


@pytest.fixture
def lit(tmp_path, monkeypatch):
    (tmp_path / "lit_workload.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import lit_workload

    yield importlib.reload(lit_workload)
    sys.modules.pop("lit_workload", None)


def _batch(workload, n=4):
    ds = workload.dataset()
    return torch.utils.data.default_collate([ds[i] for i in range(n)])


def test_training_step_runs_inside_the_compiled_module_and_trains_with_its_own_optimizer(lit):
    from torch._dynamo.testing import CompileCounter

    w = lit.make("dict")
    model = w.model()
    opt = w.make_optimizer(model.parameters())
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    batch = _batch(w)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    before = [p.detach().clone() for p in model.parameters()]
    loss = w.loss(compiled, batch)
    loss.backward()
    opt.step()
    assert counter.frame_count >= 1, "training_step ran outside the compiled module"
    assert torch.isfinite(loss) and any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    # What the wrapper is for: the method called on the compiled module runs eager.
    torch._dynamo.reset()
    naive = CompileCounter()
    torch.compile(model.module, backend=naive).training_step(batch, 0)
    assert naive.frame_count == 0


def test_moving_the_wrapper_moves_the_modules_recorded_device_and_format(lit):
    model = lit.make().model()
    moved = model.to(torch.device("cpu"), dtype=torch.float64)
    assert moved is model and model.module.dtype == torch.float64
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_a_training_step_without_a_loss_and_manual_optimization_are_one_line_errors(lit):
    w = lit.make("none")
    with pytest.raises(WorkloadError, match="training_step returned NoneType"):
        w.loss(w.model(), _batch(w))

    module = lit.Regression()
    module.automatic_optimization = False
    with pytest.raises(UserError, match="manual optimization"):
        lightning_workload(module, dataset=lit.Pairs()).model()

    class TwoOptimizers(lit.Regression):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())]

    w = lightning_workload(TwoOptimizers, dataset=lit.Pairs())
    model = w.model()
    with pytest.raises(UserError, match="returned 2 optimizers"):
        w.make_optimizer(model.parameters())
    with pytest.raises(UserError, match="a datamodule or a dataset"):
        lightning_workload(lit.Regression)
    # the Trainer's gradient_clip_val the module trains with
    assert lightning_workload(lit.Regression, dataset=lit.Pairs(), clip_grad_norm=0.5).clip_grad_norm == 0.5


def test_the_module_s_batch_hooks_run_where_lightning_calls_them_and_the_record_says_which_do_not(lit, tmp_path):
    """A module's on_train_batch_start/end and on_before_zero_grad are part of its step (an
    EMA): the loop calls them where Lightning does, an accumulation's earlier micro-batch
    ended after its backward and the last after the optimizer's step; a hook between
    backward and the step is not called, and the trial's notes say so. The module's hooks
    are no after_step of the user's for an export to carry; the user's own still is."""
    from tuner.loop import Trainer
    from tuner.trial import make_request, resolve_config
    from tuner.workloads import users_after_step

    req = make_request(workload=f"{tmp_path / 'lit_workload.py'}:make_hooked", device="cpu",
                       config={"micro_batch_size": 4, "grad_accum_steps": 2})
    config, _, workload, device = resolve_config(req)
    t = Trainer(workload, config, device)
    events = t.eager_model.module.events  # the class as the trial loaded it from the file
    events.clear()
    t.start()
    t.step()
    t.step()
    assert [(e[0], e[1]) for e in events] == [
        ("start", 0), ("end", 0), ("start", 1), ("zero_grad", None), ("end", 1),
        ("start", 2), ("end", 2), ("start", 3), ("zero_grad", None), ("end", 3)]
    ends = {e[1]: e[2] for e in events if e[0] == "end"}
    starts = {e[1]: e[2] for e in events if e[0] == "start"}
    assert all(seen[:3] == (False, 4, 4) for seen in ends.values())  # outputs as Lightning hands them
    assert ends[0][3] == starts[0] and ends[1][3] != starts[0]  # the step ran between batch 1's start and end
    assert events[3][2] == "SGD"
    assert "on_before_zero_grad, on_train_batch_end, on_train_batch_start ran at each batch" in " ".join(t.notes)
    assert any("overrides on_after_backward" in n and "not in the figure" in n for n in t.notes)
    assert users_after_step(workload) is None and lit.make().after_step is not None
    own = lit.make_hooked(after_step=lambda model, optimizer: None)
    assert users_after_step(own) is own.after_step.users is not None
    # a module that overrides no hook calls none, and says nothing of them
    plain = lit.make()
    plain.loss(plain.model(), _batch(plain))
    assert not any("ran at each batch" in n or "overrides" in n for n in plain.model().tuner_notes)


@pytest.mark.slow
def test_bench_trains_a_lightning_module_from_its_datamodule_in_dataloader_workers(tmp_path):
    (tmp_path / "lit_workload.py").write_text(MODULE)
    space = tmp_path / "space.yaml"
    space.write_text(textwrap.dedent("""\
        name: lit
        workload: lit_workload.py:make
        knobs:
          micro_batch_size: [8]
          num_workers: [1]
        """) + space_lines())
    r = subprocess.run([sys.executable, "-m", "tuner", "bench", str(space), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["samples_per_sec"] > 0 and out["loss_finite"] is True
    assert out["config"]["micro_batch_size"] == 8 and out["config"]["num_workers"] == 1
