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
