"""Exports a user runs as they are: a plain PyTorch script, Hugging Face and Lightning kwargs."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import FIXTURES
from tuner.cli import main


def _results(tmp_path, workload, args, config, hardware=None, base_dir=None):
    folder = tmp_path / "results" / "r"
    folder.mkdir(parents=True)
    (folder / "space.yaml").write_text(json.dumps({"name": "r", "workload": workload, "workload_args": args}))
    (folder / "meta.json").write_text(json.dumps({"base_dir": str(base_dir or tmp_path)}))
    (folder / "trials.jsonl").write_text(json.dumps(
        {"phase": "search", "key": "k", "config": config, "status": "ok", "samples_per_sec": 100.0,
         "hardware": hardware or {"cpu": "test", "gpu": None, "torch": "x"}}) + "\n")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("workload, args, config", [
    ("conv", {"size": 128}, {"precision": "bf16", "micro_batch_size": 8, "num_workers": 1,
                             "persistent_workers": True, "channels_last": True, "torch_threads": 1,
                             "fused_optimizer": True, "grad_accum_steps": 2, "gc_freeze": True}),
    ("multisource", {"size": 96}, {"micro_batch_size": 8, "batch_grouping": "by_source"}),
    # a workload file beside the space; its clipping and EMA
    ("linear", {"size": 64, "clip": 0.5, "ema": True}, {"micro_batch_size": 8}),
    ("stream", {"size": 64}, {"micro_batch_size": 8, "num_workers": 2}),  # an iterable dataset: no shuffle
    # the input pipeline's knobs: the cache filled by the workers, the augment on the device
    ("decoded", {"size": 64, "decode_s": 0.0, "augment": True},
     {"micro_batch_size": 8, "num_workers": 1, "dataset_cache": True, "augment_on": "device"}),
    # batches by length, the lengths read of the dataset the cache was filled from
    ("padded", {"size": 128}, {"micro_batch_size": 8, "group_by_length": True, "dataset_cache": True}),
])
def test_the_exported_script_trains_as_it_is(tmp_path, workload, args, config):
    ref = f"{FIXTURES.name}:{workload}" if workload in ("linear", "decoded", "stream", "padded") else workload
    folder = _results(tmp_path, ref, args, config, base_dir=FIXTURES.parent)
    script = tmp_path / "train.py"
    assert main(["export", str(folder), "--format", "python", "-o", str(script)]) == 0
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout and "optimizer steps" in r.stdout
    r = subprocess.run([sys.executable, str(script), "--steps", "3"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "samples/sec:" in r.stdout, r.stderr


def _snippet(tmp_path, fmt, config, gpu=None):
    folder = _results(tmp_path, "conv", {}, config, hardware={"cpu": "t", "gpu": gpu, "torch": "x"})
    out = tmp_path / f"{fmt}.py"
    assert main(["export", str(folder), "--format", fmt, "-o", str(out)]) == 0
    return out.read_text()


@pytest.mark.slow
def test_hugging_face_training_arguments_accept_the_export(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    text = _snippet(tmp_path, "hf", {"precision": "bf16", "micro_batch_size": 16, "grad_accum_steps": 2,
                                     "num_workers": 2, "persistent_workers": True, "prefetch_factor": 4,
                                     "channels_last": True, "torch_threads": 1, "group_by_length": True})
    ns: dict = {}
    exec(compile(text, "hf.py", "exec"), ns)  # builds TrainingArguments(**training_args)
    args = ns["args"]
    assert args.bf16 and args.per_device_train_batch_size == 16 and args.gradient_accumulation_steps == 2
    assert args.dataloader_num_workers == 2 and args.dataloader_persistent_workers
    assert args.dataloader_prefetch_factor == 4
    assert args.train_sampling_strategy == "group_by_length"  # the Trainer's own sampler
    assert "channels_last" in text and "torch.set_num_threads(1)" in text  # said, not dropped


def test_hf_export_names_the_trainers_batch_lookahead_only_where_workers_pay_it():
    # With workers, the Trainer's loader waits for a second batch at every epoch start;
    # without them the main process loads both either way, and the comment would mislead.
    from tuner.results import framework_snippet

    def snippet(workers: int) -> str:
        return framework_snippet({"config": {"precision": "fp32", "micro_batch_size": 32, "num_workers": workers},
                                  "workload": {"ref": "conv", "args": {}}, "base_dir": ".", "hardware": {},
                                  "measured": {}, "speedup_vs_baseline": None}, "hf")

    assert "reads one batch ahead" in snippet(1) and "max_grad_norm" in snippet(1)
    assert "reads one batch ahead" not in snippet(0) and "max_grad_norm" in snippet(0)


def test_the_workload_s_clipping_goes_into_the_framework_exports():
    # measured with the workload's clipping: the Trainer clips at that norm (its own default
    # is 1.0, which the figure does not hold otherwise), Lightning with gradient_clip_val
    from tuner.results import framework_snippet, hf_kwargs, lightning_kwargs

    payload = {"config": {"precision": "fp32", "micro_batch_size": 32}, "workload": {"ref": "conv", "args": {}},
               "base_dir": ".", "hardware": {}, "measured": {}, "speedup_vs_baseline": None}
    assert "max_grad_norm" not in hf_kwargs(payload)[0] and "gradient_clip_val" not in lightning_kwargs(payload)[0]
    clipped = {**payload, "clip_grad_norm": 0.5}
    assert hf_kwargs(clipped)[0]["max_grad_norm"] == 0.5 and lightning_kwargs(clipped)[0]["gradient_clip_val"] == 0.5
    assert "gradient clipping (max_grad_norm=1.0" in framework_snippet(payload, "hf")
    assert "gradient clipping (max_grad_norm=1.0" not in framework_snippet(clipped, "hf")
    stepped = {**payload, "has_after_step": True}
    assert "on_step_end" in framework_snippet(stepped, "hf") and "on_step_end" not in framework_snippet(payload, "hf")
    assert "on_train_batch_end" in framework_snippet(stepped, "lightning")


def test_lightning_trainer_accepts_the_export(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    text = _snippet(tmp_path, "lightning", {"precision": "bf16", "micro_batch_size": 16, "grad_accum_steps": 4,
                                            "num_workers": 1, "persistent_workers": True})
    ns: dict = {"dataset": list(range(64))}
    exec(compile(text, "lightning.py", "exec"), ns)
    trainer = ns["trainer"]
    assert trainer.accumulate_grad_batches == 4 and "bf16" in str(trainer.precision)
    loader = ns["train_loader"]
    assert loader.batch_size == 16 and loader.num_workers == 1 and loader.persistent_workers


DDP = {"world_size": 2, "micro_batch_size": 8, "grad_accum_steps": 2, "ddp_bucket_cap_mb": 50,
       "ddp_gradient_as_bucket_view": True, "ddp_comm_hook": "fp16_compress", "ddp_no_sync_accumulation": True}


@pytest.mark.slow
def test_the_exported_data_parallel_script_trains_under_torchrun(tmp_path):
    folder = _results(tmp_path, f"{FIXTURES.name}:linear", {"size": 64}, DDP, base_dir=FIXTURES.parent)
    script = tmp_path / "train.py"
    assert main(["export", str(folder), "--format", "python", "-o", str(script)]) == 0
    alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert alone.returncode != 0 and "torchrun --nproc_per_node 2" in alone.stderr
    r = _torchrun(script, tmp_path, "--steps", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("samples/sec:") == 1  # rank 0 speaks for both


@pytest.mark.slow
@pytest.mark.alone  # it loads every core itself
def test_the_exported_data_parallel_script_exits_cleanly_with_the_cores_busy(tmp_path):
    """A rank that trained must not abort at exit (a process group or DataLoader workers
    left to the interpreter's teardown did, 3 runs in 5, with the cores busy)."""
    from tests.helpers import spin
    from tuner.trial import kill_tree

    config = {**DDP, "num_workers": 1, "persistent_workers": True}
    folder = _results(tmp_path, f"{FIXTURES.name}:linear", {"size": 64}, config, base_dir=FIXTURES.parent)
    script = tmp_path / "train.py"
    assert main(["export", str(folder), "--format", "python", "-o", str(script)]) == 0
    ctx = __import__("multiprocessing").get_context("spawn")
    hogs = [ctx.Process(target=spin, args=(600,)) for _ in range(os.cpu_count() or 2)]
    for h in hogs:
        h.start()
    runs = []
    try:
        # at once: each run's exit meets the others' start-up and training, as well as the spinners
        for n, args in enumerate((["--steps", "3"], [], ["--steps", "3"], [], ["--steps", "3"])):
            (tmp_path / f"run{n}").mkdir()
            runs.append(_torchrun(script, tmp_path / f"run{n}", *args, wait=False))
        for n, run in enumerate(runs):
            run.wait(timeout=300)
            assert run.returncode == 0, f"run {n + 1}: {(tmp_path / f'run{n}' / 'stderr').read_text()[-2000:]}"
    finally:
        for p in [*hogs, *runs]:
            kill_tree(p.pid)


def _torchrun(script, cwd, *args, wait=True):
    # its logs in the test's folder: by default torchrun makes a temp dir per run and leaves it
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--log-dir", str(cwd / "torchrun"), str(script), *args]
    if not wait:
        # stderr to a file: runs read one after another must not block on a full pipe
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(cwd / "stderr", "w"), cwd=cwd)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_data_parallel_knobs_reach_hugging_face_and_lightning(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    text = _snippet(tmp_path, "hf", DDP)
    ns: dict = {}
    exec(compile(text, "hf.py", "exec"), ns)
    args = ns["args"]
    assert args.ddp_bucket_cap_mb == 50 and args.ddp_static_graph is False
    assert "torchrun --nproc_per_node 2" in text and "ddp_comm_hook=fp16_compress" in text
    (tmp_path / "results").rename(tmp_path / "hf-results")
    text = _snippet(tmp_path, "lightning", DDP)
    assert "DDPStrategy(bucket_cap_mb=50, gradient_as_bucket_view=True" in text
    ns = {"dataset": list(range(64))}
    exec(compile(text, "lightning.py", "exec"), ns)
    strategy = ns["trainer"].strategy
    assert type(strategy).__name__ == "DDPStrategy" and strategy._ddp_kwargs["bucket_cap_mb"] == 50
    assert strategy._ddp_comm_hook.__name__ == "fp16_compress_hook"


def test_the_input_pipelines_knobs_reach_the_snippets(tmp_path):
    config = {"micro_batch_size": 8, "num_workers": 2, "dataset_cache": True, "augment_on": "device"}
    for fmt in ("hf", "lightning"):
        text = _snippet(tmp_path / fmt, fmt, config)
        assert "tuner.data.cached(train_dataset, workers=2)" in text and "augment_on=device" in text, text


def test_gc_freeze_reaches_the_snippets_before_the_framework_s_loop(tmp_path):
    for fmt in ("hf", "lightning"):  # set in the user's own script, before the framework's loop
        text = _snippet(tmp_path / f"gc-{fmt}", fmt, {"micro_batch_size": 8, "gc_freeze": True})
        assert "gc.collect(); gc.freeze()" in text and ("trainer.train()" in text or "trainer.fit" in text), text


def test_the_yaml_export_says_where_each_knob_goes_in_a_loop_of_one_s_own(tmp_path, capsys):
    """Every knob the config sets has a line of plain PyTorch in ``in_your_loop``, and the
    DataLoader line is code that builds the loader: malloc_retain, set in the
    environment, was in no export but the script and the framework snippets."""
    import yaml

    from tuner import knobs

    config = {"precision": "bf16", "micro_batch_size": 16, "num_workers": 2, "persistent_workers": True,
              "channels_last": True, "fused_optimizer": True, "torch_threads": 1, "malloc_retain": True,
              "compile": "max-autotune-no-cudagraphs", "grad_accum_steps": 2, "gc_freeze": True,
              "group_by_length": True}
    folder = _results(tmp_path, "conv", {}, config)
    assert main(["export", str(folder), "-o", str(tmp_path / "best.yaml")]) == 0
    lines = yaml.safe_load((tmp_path / "best.yaml").read_text())["in_your_loop"]
    said = "\n".join(lines)
    for knob in set(config) - {"micro_batch_size", "num_workers", "persistent_workers"}:
        assert f"{knob}=" in said, knob
    assert " ".join(f"{k}={v}" for k, v in knobs.MALLOC_RETAIN_ENV.items()) in said
    assert "torch.compile(model, mode='max-autotune-no-cudagraphs')" in said
    assert "gc.collect(); gc.freeze()" in said
    call = next(x for x in lines if x.startswith("DataLoader(")).split(" (")[0]
    loader = eval(call, {"DataLoader": __import__("torch").utils.data.DataLoader, "dataset": list(range(64))})
    assert (loader.batch_size, loader.num_workers, loader.persistent_workers) == (16, 2, True)
    # PyTorch's defaults: nothing to say
    plain = _results(tmp_path / "plain", "conv", {}, {"micro_batch_size": 32})
    assert main(["export", str(plain), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["in_your_loop"] == []


def test_the_exported_script_batches_by_length_as_the_trial_did(tmp_path):
    import importlib.util

    folder = _results(tmp_path, "conv", {}, {"micro_batch_size": 8, "group_by_length": True})
    script = tmp_path / "train.py"
    assert main(["export", str(folder), "--format", "python", "-o", str(script)]) == 0
    spec = importlib.util.spec_from_file_location("exported_train", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lengths = [2 + (i * 7919) % 39 for i in range(800)]
    shards = [module.Batches([list(range(800))], lengths, 8, rank=r, world=2) for r in range(2)]
    epochs = [[list(s) for s in shards], [list(s) for s in shards]]
    for shard in epochs[0] + epochs[1]:
        flat = [i for b in shard for i in b]
        assert len(flat) == len(set(flat)) == 400
        padded = sum(len(b) * max(lengths[i] for i in b) for b in shard)
        assert 1 - sum(lengths[i] for i in flat) / padded < 0.1
    assert not {i for b in epochs[0][0] for i in b} & {i for b in epochs[0][1] for i in b}
    assert all(max(lengths[i] for i in shard[0]) == max(lengths) for shard in epochs[0])  # the peak first
    assert epochs[0][0] != epochs[1][0]
