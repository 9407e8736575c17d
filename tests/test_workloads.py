"""One shared test against every built-in workload."""

import pytest
import torch

from tuner import knobs
from tuner.loop import Trainer
from tuner.workloads import BUILTIN, load_workload


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_workload_trains(name):
    wl = load_workload(name, {"size": 128})
    ds = wl.dataset()
    assert len(ds) == 128
    ctx = knobs.Context("cpu", 2, has_groups=wl.groups is not None)
    config = knobs.resolve({"micro_batch_size": 8, "precision": "bf16"}, ctx, strict=True)[0]
    t = Trainer(wl, config, torch.device("cpu"))
    before = [p.detach().clone() for p in t.model.parameters()]
    t.start()
    for _ in range(3):
        t.step()
    assert t.loss_finite()
    assert any(not torch.equal(p, b) for p, b in zip(t.model.parameters(), before, strict=True))
    if wl.groups is not None:
        groups = wl.groups(ds)
        assert sorted(i for g in groups for i in g) == list(range(len(ds)))


def test_samples_are_deterministic():
    for name in BUILTIN:
        ds = load_workload(name, {"size": 16}).dataset()
        a, b = ds[3], ds[3]
        ta = a[0] if isinstance(a, tuple) and torch.is_tensor(a[0]) else (a[1] if isinstance(a, tuple) else a)
        tb = b[0] if isinstance(b, tuple) and torch.is_tensor(b[0]) else (b[1] if isinstance(b, tuple) else b)
        assert torch.equal(ta, tb)


def test_workload_reference_errors(tmp_path):
    from tuner.errors import UserError, WorkloadError

    with pytest.raises(UserError, match="expected 'file.py:function'"):
        load_workload("no_colon")
    with pytest.raises(UserError, match="module 'not_a_module_xyz' not found"):
        load_workload("not_a_module_xyz:make")
    with pytest.raises(UserError, match="no function 'nope'"):
        load_workload("tuner.workloads.builtin:nope")
    (tmp_path / "w.py").write_text("def make():\n    return 3\n")
    with pytest.raises(UserError, match=r"returned int, not tuner.Workload: return Workload\(model=\.\.\., "):
        load_workload(f"{tmp_path}/w.py:make")
    (tmp_path / "r.py").write_text("def make():\n    raise OSError('no data here')\n")
    with pytest.raises(WorkloadError, match="raised: OSError: no data here"):
        load_workload(f"{tmp_path}/r.py:make")


def test_a_workload_missing_a_package_an_extra_installs_names_the_extra(tmp_path):
    from tuner.errors import WorkloadError
    from tuner.workloads import load_workload

    wl = tmp_path / "wl.py"
    wl.write_text("raise ModuleNotFoundError(\"No module named 'transformers'\", name='transformers')\n"
                  "def make():\n    pass\n")
    with pytest.raises(WorkloadError, match=r'pip install -e "\.\[hf\]"'):
        load_workload(f"{wl}:make")


@pytest.mark.parametrize(("given", "meant"), [("collate_fn", "collate"), ("loss_fn", "loss"),
                                              ("train_dataset", "dataset"), ("sampler", None)])
def test_a_workload_given_a_field_it_lacks_names_the_field_it_has(tmp_path, given, meant):
    from tuner.errors import WorkloadError
    from tuner.workloads import load_workload

    (tmp_path / "w.py").write_text("from tuner import Workload\n"
                                   f"def make():\n    return Workload(model=None, dataset=None, loss=None, {given}=1)\n")
    with pytest.raises(WorkloadError) as raised:
        load_workload(f"{tmp_path}/w.py:make")
    message = str(raised.value)
    assert f"unexpected keyword argument '{given}'" in message and "Workload's fields: model, dataset, loss" in message
    assert ("did you mean" in message) is (meant is not None)
    if meant:
        assert f"did you mean '{meant}'?" in message


def test_a_loss_module_given_as_the_loss_says_how_the_loss_is_called(tmp_path):
    from tuner.errors import UserError

    (tmp_path / "w.py").write_text("import torch\nfrom tuner import Workload\n"
                                   "def make():\n    return Workload(model=lambda: torch.nn.Linear(4, 2), "
                                   "dataset=None, loss=torch.nn.CrossEntropyLoss())\n")
    with pytest.raises(UserError) as raised:
        load_workload(f"{tmp_path}/w.py:make")
    assert str(raised.value) == (
        f"workload '{tmp_path}/w.py:make': Workload(loss=CrossEntropyLoss()): loss is called as loss(model, batch), "
        "where CrossEntropyLoss takes the model's output and the targets; for (inputs, targets) batches: "
        "loss=lambda model, batch: CrossEntropyLoss()(model(batch[0]), batch[1])")


def test_a_model_or_dataset_given_as_an_instance_or_a_class_is_built_as_the_loop_asks():
    """``model=MyModel()`` and ``dataset=MyData()``, as a training script holds them: each
    trial's model is a fresh copy of the instance, the dataset the instance itself; a
    dataset class (which has ``__getitem__`` too) is the builder, called."""
    import torch
    from torch import nn

    from tuner.workloads import Workload

    template, data = nn.Linear(4, 2), torch.utils.data.TensorDataset(torch.randn(8, 4))
    wl = Workload(model=template, dataset=data, loss=lambda m, b: m(b[0]).sum())
    first, second = wl.model(), wl.model()
    assert first is not template and second is not first and isinstance(first, nn.Linear)
    assert torch.equal(first.weight, template.weight)
    with torch.no_grad():
        first.weight.add_(1.0)
    assert not torch.equal(first.weight, template.weight)  # a trial trains its own copy
    assert wl.dataset() is data

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(4)

    built = Workload(model=nn.Linear, dataset=Data, loss=lambda m, b: m(b).sum()).dataset()
    assert isinstance(built, Data) and len(built) == 3


def test_workload_args_the_function_does_not_take_name_what_it_takes(tmp_path):
    from tuner.errors import UserError
    from tuner.workloads import load_workload

    (tmp_path / "w.py").write_text("def make(hidden: int = 8, layers: int = 2):\n    pass\n"
                                   "def loose(**kwargs):\n    pass\n")
    with pytest.raises(UserError, match=r"'hiden' \(did you mean 'hidden'\?\) \(it takes: hidden, layers\)$"):
        load_workload(f"{tmp_path}/w.py:make", {"hiden": 3})
    with pytest.raises(UserError, match=r"'width' \(it takes: hidden, layers\)$"):
        load_workload(f"{tmp_path}/w.py:make", {"width": 3})
    with pytest.raises(UserError, match=r"returned NoneType"):  # **kwargs takes any name: it is called
        load_workload(f"{tmp_path}/w.py:loose", {"width": 3})
