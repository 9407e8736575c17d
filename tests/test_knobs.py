import pytest
import torch

from tuner import apply, knobs
from tuner.errors import UserError

CPU = knobs.Context(device="cpu", cpu_count=2)
GPU = knobs.Context(device="cuda", cpu_count=16)


def test_table_defaults_are_valid_values():
    for name, value in knobs.defaults().items():
        assert knobs.check_value(name, value) == value


@pytest.mark.parametrize("ctx", [CPU, GPU, knobs.Context("cpu", 8, has_groups=True)])
def test_recommended_config_resolves(ctx):
    config, _ = knobs.resolve(knobs.recommended(ctx), ctx, strict=False)
    assert config["num_workers"] >= 1 and config["persistent_workers"] is True


def test_check_value_errors_name_the_knob():
    with pytest.raises(UserError, match=r"unknown knob 'num_wrkers' \(did you mean 'num_workers'\?\)"):
        knobs.check_value("num_wrkers", 2)
    with pytest.raises(UserError, match=r"unknown knob 'speed'; known knobs: precision,"):  # nothing close
        knobs.check_value("speed", 2)
    with pytest.raises(UserError, match="precision.*fp8"):
        knobs.check_value("precision", "fp8")
    with pytest.raises(UserError, match="num_workers.*minimum 0"):
        knobs.check_value("num_workers", -1)
    with pytest.raises(UserError, match="not an integer"):
        knobs.check_value("micro_batch_size", 2.5)
    assert knobs.check_value("pin_memory", "true") is True
    assert knobs.check_value("compile", False) == "off"  # YAML's `off`


def test_prefetch_without_workers_is_rejected_when_explicit_and_normalized_in_search():
    with pytest.raises(UserError, match="prefetch_factor=4.*num_workers > 0"):
        knobs.resolve({"num_workers": 0, "prefetch_factor": 4}, CPU, strict=True)
    config, notes = knobs.resolve({"num_workers": 0, "prefetch_factor": 4}, CPU, strict=False)
    assert config["prefetch_factor"] is None
    assert any("prefetch_factor=4 ignored" in n for n in notes)


def test_gpu_knobs_on_cpu():
    with pytest.raises(UserError, match="pin_memory.*GPU knob"):
        knobs.resolve({"pin_memory": True}, CPU, strict=True)
    config, _ = knobs.resolve({"pin_memory": True}, GPU, strict=True)
    assert config["pin_memory"] is True


def test_unsupported_precision_is_an_error():
    ctx = knobs.Context(device="cuda", cpu_count=4, bf16_ok=False)
    with pytest.raises(UserError, match="bf16"):
        knobs.resolve({"precision": "bf16"}, ctx, strict=False)


def test_recommended_precision_is_bf16_only_where_the_hardware_runs_it():
    # A CPU without AVX512-BF16 or AMX emulates bf16 (several times slower than fp32):
    # the guides' start there is fp32; bf16 stays searchable, and on GPUs the GPU decides.
    slow = knobs.Context(device="cpu", cpu_count=2, bf16_native=False)
    assert knobs.recommended(slow)["precision"] == "fp32"
    assert knobs.resolve({"precision": "bf16"}, slow, strict=True)[0]["precision"] == "bf16"
    assert knobs.recommended(knobs.Context(device="cpu", cpu_count=2))["precision"] == "bf16"
    assert knobs.recommended(knobs.Context(device="cuda", cpu_count=8, bf16_native=False))["precision"] == "bf16"
    assert knobs.recommended(knobs.Context(device="cuda", cpu_count=8, bf16_ok=False))["precision"] == "fp16"


def test_malloc_retain_is_recommended_where_the_libc_is_glibc():
    assert knobs.recommended(CPU)["malloc_retain"] is knobs.GLIBC
    assert knobs.defaults()["malloc_retain"] is False  # the baseline: PyTorch's default


def test_batch_grouping_needs_sources():
    with pytest.raises(UserError, match="single source"):
        knobs.resolve({"batch_grouping": "by_source"}, CPU, strict=True)


def test_fused_optimizer_rebuilds_with_same_hyperparameters():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.123, weight_decay=0.5)
    fused = apply.apply_fused_optimizer(opt, True)
    assert type(fused) is torch.optim.AdamW
    assert fused.defaults["fused"] is True
    assert fused.param_groups[0]["lr"] == 0.123 and fused.param_groups[0]["weight_decay"] == 0.5
    assert fused.param_groups[0]["fused"] is True
    assert apply.apply_fused_optimizer(opt, False) is opt


def test_fused_optimizer_without_fused_implementation():
    opt = torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(UserError, match="LBFGS has no fused"):
        apply.apply_fused_optimizer(opt, True)


def test_fused_optimizer_is_refused_for_a_model_with_sparse_gradients():
    """No fused step takes sparse gradients (Embedding(sparse=True)): PyTorch raises at the
    first step; the knob says so, naming the embeddings, before any step, and ``init``
    leaves it out."""
    from tests.fixture_workloads import SparseRec

    model = SparseRec()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError, match=r"^knob 'fused_optimizer': the model's users, items give sparse gradients"):
        apply.apply_fused_optimizer(opt, True, model)
    assert "give sparse gradients" in apply.fused_optimizer_of(opt, model)
    assert apply.fused_optimizer_of(opt, torch.nn.Linear(2, 2)) is None
    model.users.sparse = model.items.sparse = False  # dense gradients: the fused step takes them
    assert apply.fused_optimizer_of(opt, model) is None


def test_loader_kwargs():
    config = knobs.defaults() | {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": True}
    assert knobs.loader_kwargs(config, "cpu") == {
        "num_workers": 2, "persistent_workers": True, "prefetch_factor": 4}
    assert knobs.loader_kwargs(knobs.defaults(), "cpu") == {"num_workers": 0}
    kw = knobs.loader_kwargs(config | {"pin_memory": True}, "cuda")
    assert kw["pin_memory"] is True


def test_activation_checkpointing_wraps_blocks_and_keeps_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ref = torch.nn.Sequential(*[m for m in model])  # same modules, unwrapped view
    x = torch.randn(5, 4)
    ref(x).sum().backward()
    expected = [p.grad.clone() for p in ref.parameters()]
    model.zero_grad()
    assert apply.apply_activation_checkpointing(model, True) == 2
    model(x).sum().backward()
    for g, e in zip([p.grad for p in model.parameters()], expected, strict=True):
        torch.testing.assert_close(g, e)


def test_autocast_context_and_scaler():
    cpu = torch.device("cpu")
    with apply.autocast_context(cpu, "bf16")():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with apply.autocast_context(cpu, "fp32")():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert apply.grad_scaler(cpu, "fp16") is not None
    assert apply.grad_scaler(cpu, "bf16") is None
