import textwrap

import pytest

from tuner import spec
from tuner.errors import UserError


def _load(tmp_path, text):
    p = tmp_path / "space.yaml"
    p.write_text(textwrap.dedent(text))
    return spec.load(p)


GOOD = """\
name: t
workload: conv
knobs:
  precision: [fp32, bf16]
  micro_batch_size: {min: 16, max: 128, log: true}
  num_workers: 0
"""


def test_valid_space_expands_ranges_and_fixed_values(tmp_path):
    s = _load(tmp_path, GOOD)
    assert s.domain["micro_batch_size"] == [16, 32, 64, 128]
    assert s.searched.keys() == {"precision", "micro_batch_size"}
    assert s.fixed == {"num_workers": 0}
    assert s.size() == 8
    assert s.model.sampler == "guided" and s.model.budget.trials == 12


BAD_SPACES = [
    ("name: t\nworkload: conv\nknobz: {}\n", r"space.yaml:3: knobz: unknown field 'knobz'"),
    ("name: t\nworkload: conv\nbudget:\n  trails: 3\n",
     r"space.yaml:4: budget.trails: unknown field 'trails' \(did you mean 'trials'\?\) \(allowed: trials,"),
    ("name: t\nworkload: conv\nbudget:\n  trials: many\n", r"space.yaml:4: budget.trials: .*integer"),
    ("name: t\nworkload: conv\nknobs:\n  num_workerz: [1]\n",
     r"space.yaml:4: knobs.num_workerz: unknown knob 'num_workerz' \(did you mean 'num_workers'\?\); known knobs"),
    ("name: t\nworkload: conv\nknobs:\n  precision: []\n", r"space.yaml:4: knobs.precision: empty list"),
    ("name: t\nworkload: conv\nknobs:\n  precision: [fp32,\n    fp8]\n", r"space.yaml:5: knobs.precision.1: .*fp8"),
    ("workload: conv\n", r"name: required field is missing"),
    ("name: t\nworkload: conv\nknobs:\n  micro_batch_size: [24, 40]\nconstraints:\n"
     "  effective_batch_size: 64\n", r"space.yaml:6: constraints.effective_batch_size: 64 is not a multiple"),
    ("name: t\nworkload: conv\nobjective: {metric: loss}\n", r"objective.metric"),
    ("name: t\nworkload: conv\nmeasure:\n  idle_limit_s: 0\n", r"space.yaml:4: measure.idle_limit_s: .*greater than 0"),
    ("name: t\nworkload: conv\nknobs: [a\n", r"space.yaml:\d+: not valid YAML: expected"),
    ("name: t\nworkload: conv\nknobs:\n  micro_batch_size: {min: 0, max: 8, log: true}\n",
     r"space.yaml:4: knobs.micro_batch_size.min: .*0 is below the minimum 1"),
    ("name: t\nworkload: conv\nknobs:\n  num_workers: {min: 0, max: 4, step: 0.5}\n",
     r"space.yaml:4: knobs.num_workers: step must be an integer >= 1"),
]


@pytest.mark.parametrize("text,match", BAD_SPACES)
def test_bad_space_names_field_and_line(tmp_path, text, match):
    with pytest.raises(UserError, match=match):
        _load(tmp_path, text)


def test_effective_batch_derives_accumulation(tmp_path):
    s = _load(tmp_path, "name: t\nworkload: conv\nknobs:\n  micro_batch_size: [16, 24, 32]\n"
                        "constraints:\n  effective_batch_size: 64\n")
    assert s.domain["micro_batch_size"] == [16, 32]
    assert s.derive({"micro_batch_size": 16})["grad_accum_steps"] == 4
    assert s.baseline_config() == {"micro_batch_size": 64, "grad_accum_steps": 1}


def test_missing_workload_is_caught_before_running(tmp_path):
    s = _load(tmp_path, "name: t\nworkload: nowhere.py:make\n")
    with pytest.raises(UserError, match=r"space.yaml:2: workload 'nowhere.py:make': file .* not found"):
        spec.check_workload(s)
    s = _load(tmp_path, "name: t\nworkload: conv\nworkload_args: {colour: red}\n")
    with pytest.raises(UserError, match="workload_args.*colour"):
        spec.check_workload(s)


def test_shipped_spaces_are_valid():
    from pathlib import Path

    spaces = sorted((Path(__file__).parent.parent / "search_spaces").glob("*.yaml"))
    assert len(spaces) >= 4
    for path in spaces:
        s = spec.load(path)
        spec.check_workload(s)


def test_the_baseline_runs_at_the_spaces_first_world_size(tmp_path):
    # at world_size N > 1 the baseline is a plain DDP loop with PyTorch's defaults
    s = _load(tmp_path, "name: t\nworkload: conv\nknobs:\n  world_size: [2, 4]\n  micro_batch_size: [8]\n")
    assert s.baseline_config() == {"micro_batch_size": 8, "world_size": 2}
    s = _load(tmp_path, "name: t\nworkload: conv\nknobs:\n  world_size: [1, 2]\n")
    assert "world_size" not in s.baseline_config()
    s = _load(tmp_path, "name: t\nworkload: conv\nknobs:\n  world_size: [2]\nbaseline: {world_size: 1}\n")
    assert s.baseline_config()["world_size"] == 1


@pytest.mark.parametrize(("extra", "search", "confirm"), [
    ("", 12, 16),  # 12 configs tried, then up to 4 rounds of the top 3 and the baseline
    ("budget: {trials: 5}\n", 5, 16),
    ("budget: {trials: 1}\n", 1, 16),
    ("budget: {trials: 20}\nconfirm: {top: 2, repeats: 3}\n", 20, 9),
    ("confirm: {top: 0}\n", 12, 0),
    ("objective: {metric: samples_per_sec, memory: true}\n", 12, 0),  # a Pareto front: nothing to confirm
])
def test_budget_trials_counts_configs_and_the_confirm_rounds_come_on_top(tmp_path, extra, search, confirm):
    m = _load(tmp_path, GOOD + extra).model
    assert (m.search_trials(), m.confirm_measurements()) == (search, confirm)
    assert m.search_trials() == m.budget.trials


def test_the_guides_start_keeps_the_default_where_the_guides_value_is_not_in_the_space(tmp_path):
    """The guides' torch_threads is PyTorch's default (null): a space of [1, 2] must not
    turn that into 1, its first value (a single thread made the guides' start 40% slower
    on the transformer here, and the search then blamed the start's other knobs)."""
    from tuner import knobs

    s = _load(tmp_path, """\
        name: t
        workload: transformer
        knobs:
          torch_threads: [1, 2]
          num_workers: [0, 2]
          precision: [fp32, bf16]
        """)
    ctx = knobs.Context(device="cpu", cpu_count=2, bf16_native=True)
    rec, default = s.recommended_config(ctx), s.default_point(ctx)
    assert default["torch_threads"] == 2 and rec["torch_threads"] == 2
    assert knobs.recommended(ctx)["num_workers"] == 1 and rec["num_workers"] == default["num_workers"] == 0
    assert rec["precision"] == "bf16"  # where the guides' value is in the space, it is taken


def test_the_guides_start_leaves_the_workers_their_cores(tmp_path):
    """On a CPU, intra-op threads and DataLoader workers share the cores: the guides' 1
    worker on 2 cores comes with 1 thread, not PyTorch's 2 (that start read 0.69 of the
    best on an input-bound set here); on a GPU machine the threads stay."""
    from tuner import knobs

    s = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          torch_threads: [1, 2, 4]
          num_workers: [0, 1, 2]
        """)
    rec = s.recommended_config(knobs.Context(device="cpu", cpu_count=2))
    assert (rec["num_workers"], rec["torch_threads"]) == (1, 1)
    rec = s.recommended_config(knobs.Context(device="cpu", cpu_count=8))
    assert (rec["num_workers"], rec["torch_threads"]) == (0, 4)  # the guides' 4 workers are not in the space


def test_on_a_cpu_the_guides_start_takes_the_largest_micro_batch_listed(tmp_path):
    """The search's starts: PyTorch's defaults at the first micro-batch listed, then the
    guides' advice at the largest (on a GPU, where it may not fit, at the guides' 32);
    with a fixed effective batch, accumulation follows."""
    from tuner import knobs

    s = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          micro_batch_size: [16, 32, 128]
          torch_threads: [1, 2]
          num_workers: [0, 1]
        """)
    cpu = knobs.Context(device="cpu", cpu_count=2)
    starts = s.start_points(cpu)
    assert [p["micro_batch_size"] for p in starts] == [16, 128, 128]
    assert s.recommended_config(cpu)["micro_batch_size"] == 32  # bench's config is the guides' own
    gpu = s.start_points(knobs.Context(device="cuda", cpu_count=2))
    assert [p["micro_batch_size"] for p in gpu] == [16, 32]
    fixed = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          micro_batch_size: [16, 64]
        constraints: {effective_batch_size: 128}
        """)
    assert [(p["micro_batch_size"], p["grad_accum_steps"]) for p in fixed.start_points(cpu)] == [(16, 8), (64, 2)]


def test_on_a_cpu_the_starts_cover_each_split_of_the_cores(tmp_path):
    """Threads and DataLoader workers share the cores, and which split wins depends on the
    workload: after the guides' split (its workers, the threads they leave), the search
    starts the fewest workers listed and the most (workers tolerate sharing cores: a conv
    net's best on 2 cores had 2), each with the threads its workers leave, on any number
    of cores."""
    from tuner import knobs

    s = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          torch_threads: [1, 2]
          num_workers: [0, 1, 2]
        """)
    starts = s.start_points(knobs.Context(device="cpu", cpu_count=2))
    # the fewest workers with every core to threads is PyTorch's defaults here: not twice
    assert [(p["torch_threads"], p["num_workers"]) for p in starts] == [(2, 0), (1, 1), (1, 2)]
    no_more = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          torch_threads: [1, 2]
          num_workers: [0, 1]
        """)
    assert len(no_more.start_points(knobs.Context(device="cpu", cpu_count=2))) == 2  # both splits already in
    many = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          torch_threads: [2, 4, 8, 14]
          num_workers: [0, 2, 4, 8]
          micro_batch_size: [32, 128]
        """)
    splits = [(p["torch_threads"], p["num_workers"]) for p in many.start_points(knobs.Context(device="cpu",
                                                                                               cpu_count=16))]
    # the guides' 4 workers and the 8 threads they leave; then 0 workers and every core
    # listed to threads; then 8 workers and the 8 cores they leave (not 2 threads: 6 idle)
    assert splits == [(14, 0), (8, 4), (14, 0), (8, 8)]  # the first: PyTorch's defaults at 32
    # the last two are the splits, which the sampler re-splits by the cores workers use
    ctx16 = knobs.Context(device="cpu", cpu_count=16)
    assert many.split_starts(ctx16) == many.start_points(ctx16)[2:]
    assert no_more.split_starts(knobs.Context(device="cpu", cpu_count=2)) == []  # both are the first two starts
    # a worker count the space holds fixed shares the cores as a searched one does
    fixed = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          torch_threads: [2, 4, 8, 14]
          num_workers: 12
        """)
    assert fixed.recommended_config(knobs.Context(device="cpu", cpu_count=16))["torch_threads"] == 4


def test_on_a_cpu_the_guides_bf16_start_is_paired_with_the_same_in_fp32(tmp_path):
    """Whether bf16 autocast beats fp32 on a CPU depends on the host beyond its flags: the
    guides' bf16 start is followed by the same config in fp32. Not where the advice is
    fp32 already (no bf16 in hardware), and not on a GPU."""
    from tuner import knobs

    s = _load(tmp_path, """\
        name: t
        workload: conv
        knobs:
          precision: [fp32, bf16]
          torch_threads: [1, 2]
          num_workers: [0, 1]
        """)
    starts = s.start_points(knobs.Context(device="cpu", cpu_count=2, bf16_native=True))
    assert starts[1]["precision"] == "bf16"
    assert starts[2] == {**starts[1], "precision": "fp32"}
    assert [p["precision"] for p in starts[3:]] == ["bf16"]  # the split: bf16 until the pair says
    no_bf16 = s.start_points(knobs.Context(device="cpu", cpu_count=2, bf16_native=False))
    assert [p["precision"] for p in no_bf16] == ["fp32", "fp32"]  # the splits are the two before
    gpu = s.start_points(knobs.Context(device="cuda", cpu_count=2))
    assert [p["precision"] for p in gpu] == ["fp32", "bf16"]


def test_threads_and_workers_beyond_the_cores_are_named(tmp_path):
    """A space written for a larger machine: the values past the trial's cores are named,
    per knob (the search measures them as written, and says so); values within the cores,
    and a space without those knobs, say nothing."""
    p = tmp_path / "space.yaml"
    p.write_text("name: t\nworkload: conv\nknobs:\n  torch_threads: [1, 4, 8, 16]\n  num_workers: [0, 2, 9]\n")
    said = spec.load(p).beyond_cores(8)
    assert said == ["knobs.torch_threads: 16 intra-op threads (more than the 8 cores a trial has)",
                    "knobs.num_workers: 9 DataLoader workers (more than the 8 cores a trial has)"]
    assert spec.load(p).beyond_cores(2)[0].startswith("knobs.torch_threads: 4, 8, 16 intra-op threads")
    assert spec.load(p).beyond_cores(16) == []
    assert spec.beyond_cores({"torch_threads": [None, 2]}, 1) == [
        "knobs.torch_threads: 2 intra-op threads (more than the 1 core a trial has)"]


def test_workers_past_a_gpu_trial_s_share_of_the_node_are_named():
    """A trial per GPU at once: a trial that reserves more than its share of the node's
    cores (itself and its workers) keeps another GPU's trial waiting."""
    domain = {"num_workers": [0, 4, 7, 8, 16]}
    assert spec.beyond_share(domain, 64, 8) == [
        "knobs.num_workers: 8, 16 DataLoader workers need more than a trial's share of the node's cores "
        "(64 over 8 trials at once: 8 each, one for the step)"]
    assert spec.beyond_share(domain, 64, 1) == [] and spec.beyond_share({"precision": ["fp32"]}, 2, 4) == []
