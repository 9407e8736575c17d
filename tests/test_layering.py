"""The package's layers: pure modules never import Ray, reading results never starts it,
and nothing imports the command line (no import cycle)."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "tuner"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_pure_modules_never_import_ray():
    for name in ("records", "knobs", "measure", "windows", "hostload", "ranks", "nvml", "policy", "spec", "study",
                 "batches", "errors", "settings", "scaffold"):
        assert not any(i == "ray" or i.startswith("ray.") for i in _imports(PACKAGE / f"{name}.py")), name


def test_measure_settings_have_one_definition():
    # spec validates the measure:/run: sections with the very classes measure consumes
    from tuner import settings, spec

    assert spec.Measure is settings.MeasureSettings and spec.Run is settings.RunPlan
    assert "tuner.measure" not in _imports(PACKAGE / "spec.py")
    assert settings.MeasureSettings.model_fields["window_s"].description  # documented per field


def test_nothing_imports_the_command_line():
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("cli.py", "__main__.py", "clidoc.py"):  # clidoc: the reference of the command line
            continue
        assert "tuner.cli" not in _imports(path), path


def test_show_export_report_run_without_ray_or_torch(tmp_path):
    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "space.yaml").write_text("name: r\nworkload: conv\n")
    (folder / "trials.jsonl").write_text(
        '{"phase": "search", "key": "k", "config": {"micro_batch_size": 8}, "status": "ok", '
        '"samples_per_sec": 10.0}\n')
    code = (
        "import sys, io, contextlib\n"
        "from tuner.cli import main\n"
        f"for argv in (['show', {str(folder)!r}], ['export', {str(folder)!r}],\n"
        f"             ['export', {str(folder)!r}, '--format', 'lightning']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        assert main(argv) == 0, argv\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
        # reading results is a fraction of a second, not the two seconds of importing torch
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_process_that_runs_trials_never_imports_torch(tmp_path):
    """The worker that measures (the baseline's, to which Tune's trials hand their
    configs) only hands each config to a fresh process: importing torch itself (about a
    second) would hold up a search's first measurement. Outside Ray it starts no Ray to
    learn its node."""
    code = (
        "import sys\n"
        "from tests.helpers import FAST_MEASURE, ref\n"
        "from tuner.spec import Constraints\n"
        "from tuner.remote import TrialJob, measure_config\n"
        "job = TrialJob(workload=ref('sleepy'), workload_args={'step_s': 0.01}, base_dir='.', device='cpu',\n"
        "               measure=FAST_MEASURE, run={}, seed=0, trial_timeout_s=60, constraints=Constraints(),\n"
        "               cpus_per_trial=lambda c: 1, gpus_per_rank=0,\n"
        f"               hush_dir={str(tmp_path)!r})\n"
        "record = measure_config({'micro_batch_size': 4}, job)\n"
        "assert record['status'] == 'ok' and record['samples_per_sec'] > 0, record\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'ray.tune' not in sys.modules, 'ray.tune was imported'\n"
        "import ray\n"
        "assert not ray.is_initialized(), 'outside Ray, measuring started one'\n"
        "print('ok')\n")
    r = _python(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_a_search_does_not_import_every_logger_integration_to_count_its_callbacks():
    """Tune counts a run's callbacks for its usage report by importing each logger
    integration it knows (MLflow's imports MLflow, where it is installed, as here), before
    every search's first trial; the search's Tune run goes without the count. Run where
    Tune's own count does import it, so the test fails if the installed Ray counts some
    other way."""
    code = (
        "import sys\n"
        "from ray.tune import tune\n"
        "from ray.tune.logger import TBXLoggerCallback\n"
        "from tuner.tune_run import _callbacks_uncounted\n"
        "with _callbacks_uncounted():\n"
        "    tune.air_usage.tag_callbacks([TBXLoggerCallback()])\n"
        "print('ray.air.integrations.mlflow' in sys.modules)\n"
        "tune.air_usage.tag_callbacks([TBXLoggerCallback()])\n"
        "print('ray.air.integrations.mlflow' in sys.modules)\n")
    r = _python(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True"]


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh ``python -c``, from the repository's root."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)


def test_no_import_cycle_in_the_package():
    """Module-level and function-level imports alike: a lazy import is still a cycle."""
    modules = {p: "tuner." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py")}
    modules = {p: m.removesuffix(".__init__") for p, m in modules.items()}
    known = set(modules.values())
    graph = {}
    for path, name in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = (deps & known) - {name, "tuner"}

    def reaches(start: str) -> set:
        seen, stack = set(), [start]
        while stack:
            for d in graph.get(stack.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return seen

    assert not [m for m in graph if m in reaches(m)]


def test_no_import_cycle_among_the_benchmarks():
    """The scripts in benchmarks/ import each other by name (their folder is on the path
    when one runs): a shared helper lives in benchmarks/common.py, never in a script that
    imports back."""
    bench = PACKAGE.parent / "benchmarks"
    names = {p.stem for p in bench.glob("*.py")}
    graph = {p.stem: (_imports(p) & names) - {p.stem} for p in bench.glob("*.py")}

    def reaches(start: str) -> set:
        seen, stack = set(), [start]
        while stack:
            for d in graph.get(stack.pop(), ()):
                if d not in seen:
                    seen.add(d)
                    stack.append(d)
        return seen

    assert "common" in names and not [m for m in graph if m in reaches(m)]
