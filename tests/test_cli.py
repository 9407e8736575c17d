"""The command line as a user meets it: real subprocesses, exit codes, one-line errors."""

import contextlib
import json
import re
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from tests.helpers import FIXTURES, space_lines
from tests.test_spec import BAD_SPACES

FAST = space_lines()


def tuner(*args, cwd=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def in_process(*args, cwd, capsys, monkeypatch):
    """``python -m tuner ARGS`` as ``__main__`` runs it, in this process: for inputs refused
    before a search starts (a bench's trial still runs in its own process), where a fresh
    interpreter per case (1-2 s each here) checks nothing more. The entry point itself is
    run as a subprocess by every other test here."""
    from tuner.cli import main

    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "1")  # main() sets it; undone after the test
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's refusals exit
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def _space(tmp_path, workload, extra="", lines=FAST):
    p = tmp_path / "space.yaml"
    p.write_text(f"name: t\nworkload: {workload}\n" + lines + textwrap.dedent(extra))
    return p


def test_help_is_fast():
    t = time.perf_counter()
    r = tuner("--help")
    assert r.returncode == 0 and "bench" in r.stdout
    assert time.perf_counter() - t < 3.0  # no torch import (~2 s here) for --help


@pytest.mark.slow
def test_bench_json_has_the_documented_fields(tmp_path):
    space = _space(tmp_path, "conv", "workload_args: {size: 256}\nknobs:\n  micro_batch_size: [16]\n")
    r = tuner("bench", str(space), "--json", "--set", "precision=bf16", "--set", "num_workers=1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("samples_per_sec", "samples_per_sec_spread", "step_time_ms", "data_wait_fraction",
                "compile_s", "warmup_s", "peak_host_memory_mb", "peak_device_memory_mb",
                "loss_finite", "projected_run_s", "config", "workload", "hardware"):
        assert key in out, key
    assert out["config"]["precision"] == "bf16" and out["config"]["num_workers"] == 1
    assert out["config"]["micro_batch_size"] == 16
    assert out["samples_per_sec"] > 0 and out["peak_device_memory_mb"] is None
    assert out["workload"]["ref"] == "conv" and out["hardware"]["cpu_count"] >= 1


@pytest.mark.slow
def test_bench_baseline_table(tmp_path):
    space = _space(tmp_path, "conv", "workload_args: {size: 256}\nknobs:\n  micro_batch_size: [16]\n")
    r = tuner("bench", str(space), "--baseline")
    assert r.returncode == 0, r.stderr
    assert "samples/sec (sustained)" in r.stdout and "num_workers=0" in r.stdout
    assert "precision=fp32" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args,workload,match", [
    (["--set", "num_wrkers=2"], "conv", "unknown knob 'num_wrkers'"),
    (["--set", "precision=fp8"], "conv", "precision.*fp8"),
    (["--set", "prefetch_factor=4", "--set", "num_workers=0"], "conv", "prefetch_factor=4.*num_workers > 0"),
    (["--set", "pin_memory=true"], "conv", "pin_memory.*GPU knob"),
    ([], "missing_mod_xyz:make", "module 'missing_mod_xyz' not found"),
    ([], f"{FIXTURES}:raises", "raised: RuntimeError: my dataset path does not exist"),
    ([], f"{FIXTURES}:raises_in_loss", "KeyError"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, workload, match, capsys, monkeypatch):
    import re

    r = in_process("bench", str(_space(tmp_path, workload)), *args, cwd=tmp_path, capsys=capsys,
                   monkeypatch=monkeypatch)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert re.search(match, lines[0]), lines[0]
    assert "Traceback" not in r.stderr


def test_debug_shows_the_traceback(tmp_path):
    r = tuner("--debug", "bench", str(_space(tmp_path, f"{FIXTURES}:raises")))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_knobs_lists_the_table():
    r = tuner("knobs")
    assert r.returncode == 0
    from tuner.knobs import KNOBS

    for name in KNOBS:
        assert name in r.stdout


def _results_folder(tmp_path):
    """A minimal results folder, as `tuner run` leaves one."""
    folder = tmp_path / "results" / "r"
    folder.mkdir(parents=True)
    (folder / "space.yaml").write_text("name: r\nworkload: conv\n")
    (folder / "trials.jsonl").write_text(json.dumps(
        {"phase": "search", "key": "k", "config": {"micro_batch_size": 8}, "status": "ok",
         "samples_per_sec": 10.0}) + "\n")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("args, says", [
    (["run", "{space}", "--name", "../x"], "name '../x'"),
    (["run", "{space}", "--time-budget", "-5"], "--time-budget -5.0"),
    (["run", "{space}", "--trials", "0"], "--trials 0"),
    (["run", "{space}", "--address", "ray://127.0.0.1:10001"], "Ray Client (ray://) is not supported"),
    (["resume", "{results}", "--trials", "-3"], "--trials -3"),
    (["submit", "{space}", "--address", "http://127.0.0.1:1", "--trials", "-3"], "--trials -3"),
    (["bench", "{space}", "--timeout", "-1"], "--timeout -1.0"),
    (["bench", "{space}", "--timeout", "nan"], "--timeout nan"),
    (["profile", "{space}", "--steps", "0"], "--steps 0"),
    (["show", "{results}", "--limit", "-1"], "--limit -1"),
    (["export", "{results}", "--pick", "fastest-under-memory", "nan"], "must be a number of MB > 0"),
    (["export", "{results}", "-o", "{tmp}/missing-dir/x.yaml"], "does not exist"),
    (["bench", "{tmp}"], "a folder, not a space file"),
    (["bench", "train.py:make"], "space file train.py:make not found (a workload: `python -m tuner init train.py:make`"),
    # argparse's own refusals: one line naming the flag, not the whole usage
    (["run", "{space}", "--time-budget", "abc"], "--time-budget: invalid float value: 'abc'"),
    (["run", "{space}", "--trials", "many"], "--trials: invalid int value"),
    (["run", "{space}", "--trails", "3"], "unrecognized arguments: --trails 3"),
    (["export", "{results}", "--format", "toml"], "--format: invalid choice: 'toml'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "required: command"),
])
def test_flags_are_checked_in_one_place(tmp_path, args, says, capsys, monkeypatch):
    space = _space(tmp_path, "conv")
    results = _results_folder(tmp_path)
    argv = [a.format(space=space, results=results, tmp=tmp_path) for a in args]
    r = in_process(*argv, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], r.stderr
    assert not (tmp_path / "results" / "t").exists() and not (tmp_path.parent / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("text,match", BAD_SPACES)
def test_every_bad_space_through_the_command_line(tmp_path, text, match, capsys, monkeypatch):
    """What a user sees for each broken space: exit 2, at most 3 lines, no traceback,
    nothing written."""
    import re

    (tmp_path / "space.yaml").write_text(text)
    r = in_process("run", str(tmp_path / "space.yaml"), "--results-dir", str(tmp_path / "results"), cwd=tmp_path,
                   capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert 1 <= len(lines) <= 3 and "Traceback" not in r.stderr and re.search(match, r.stderr), r.stderr
    assert not (tmp_path / "results").exists()


def test_debug_is_accepted_anywhere_and_shows_the_traceback(tmp_path):
    space = _space(tmp_path, "conv")
    r = tuner("bench", str(space), "--set", "num_workerz=2", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["summary.json", "meta.json", "space.yaml", "trials.jsonl"])
def test_a_torn_results_file_is_one_line_naming_it(tmp_path, broken, capsys, monkeypatch):
    folder = _results_folder(tmp_path)
    (folder / "summary.json").write_text("{}")
    (folder / "meta.json").write_text("{}")
    (folder / broken).write_text({"summary.json": '{"best": ', "meta.json": "[1]",
                                  "space.yaml": "name: [unclosed\n",
                                  "trials.jsonl": "{}\n{}\n"}[broken])
    for command in (["show", str(folder)], ["export", str(folder)], ["report", str(folder)]):
        r = in_process(*command, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
        assert r.returncode == 2, (command, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and broken in lines[0], (command, r.stderr)


@pytest.mark.slow
def test_an_infeasible_bench_exits_3_and_a_workload_that_raises_2_with_the_users_message(tmp_path):
    space = _space(tmp_path, f"{FIXTURES}:nan_in", "workload_args: {precision_dtype: float16}\n")
    r = tuner("bench", str(space), "--set", "precision=fp16", "--set", "micro_batch_size=4")
    assert r.returncode == 3 and "non-finite" in r.stderr, r.stderr
    # the dataset raised in a DataLoader worker: the workload's error, as a loss that raises
    space = _space(tmp_path, f"{FIXTURES}:raises_in_worker")
    r = tuner("bench", str(space), "--set", "num_workers=1", "--set", "micro_batch_size=4")
    assert r.returncode == 2, r.stderr
    import re

    line = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: workload data raised in a DataLoader worker: ValueError: sample \d+ is corrupt",
                        line), r.stderr


@pytest.mark.slow
def test_two_runs_on_one_name_one_runs_one_is_refused(tmp_path):
    # threads past the cores (never run here: the one config tried is PyTorch's default,
    # the listed value nearest the cores) are named in a note; --no-hot-path overrides
    # the space's hot_path: true, and is kept for a resume
    space = _space(tmp_path, f"{FIXTURES}:sleepy", "budget: {trials: 1}\nconfirm: {top: 0}\n"
                   "knobs: {torch_threads: [1, 4096]}\n", lines=space_lines(hot_path=True))
    first = subprocess.Popen([sys.executable, "-m", "tuner", "run", str(space), "--quiet", "--no-hot-path"],
                             cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "results" / "t" / ".lock.json").exists() and time.time() < deadline:
            time.sleep(0.1)
        second = tuner("run", str(space), "--quiet", cwd=tmp_path)
        assert second.returncode == 2 and "another search is writing here (pid" in second.stderr, second.stderr
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
    records = [json.loads(x) for x in (tmp_path / "results" / "t" / "trials.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in records]
    assert phases.count("baseline") == 1 and phases.count("search") == 1  # one search's records
    assert "note: knobs.torch_threads: 4096 intra-op threads (more than the" in first.stderr.read()
    assert "hot path: not checked (hot_path: false; run `python -m tuner profile`" in first.stdout.read()
    assert yaml.safe_load((tmp_path / "results" / "t" / "space.yaml").read_text())["hot_path"] is False


@pytest.mark.parametrize("extra, workload, says", [
    ("workload_args: {size: big}\n", "conv", "workload_args.size: 'big' is not int"),
    ("", "{fixtures}:not_a_workload", "returned int, not tuner.Workload"),
])
def test_the_workload_is_checked_before_ray_and_before_any_write(tmp_path, extra, workload, says, capsys,
                                                                 monkeypatch):
    import ray

    ray.shutdown()  # none in this process: one started by the command would be seen
    space = _space(tmp_path, workload.format(fixtures=FIXTURES), extra)
    r = in_process("run", str(space), "--trials", "1", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "results").exists() and not ray.is_initialized()  # nothing written, no Ray started


def test_a_stop_swallowed_by_a_finaliser_is_delivered_again(monkeypatch):
    """SIGTERM whose handler runs inside a finaliser (seen: logging's lock release while
    Ray started) raises where Python can only print the exception: the stop must still
    end the command, not be lost while the search runs on."""
    import signal

    from tuner.cli import _stop_on_signals
    from tuner.errors import Stopped

    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "1")

    class SignalledWhileFinalised:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)
            sum(range(1000))  # the handler runs here, inside the finaliser

    restore = _stop_on_signals()
    try:
        with pytest.raises(Stopped) as caught:
            SignalledWhileFinalised()  # finalised at once
            deadline = time.time() + 5
            while time.time() < deadline:
                time.sleep(0.01)
        assert caught.value.signum == signal.SIGTERM
    finally:
        restore()


def test_a_stop_swallowed_by_an_import_ends_the_search_once_ray_is_up(tmp_path, monkeypatch):
    """SIGTERM whose handler raises inside an import that swallows the exception (a Cython
    module warns instead, and the handler turned warnings off) leaves no trace but the
    handler's record: the search reads it once Ray is up and stops before any trial,
    naming its folder. A later command in the same process starts without it."""
    import signal

    from tuner import spec
    from tuner.cli import _stop_on_signals
    from tuner.errors import Stopped
    from tuner.search import run_search

    monkeypatch.setenv("TUNE_DISABLE_SIGINT_HANDLER", "1")
    space = tmp_path / "space.yaml"
    space.write_text("name: swallowed\nworkload: conv\nworkload_args: {size: 64}\n"
                     "knobs:\n  micro_batch_size: [8, 16]\nbudget: {trials: 2}\n" + space_lines())
    restore = _stop_on_signals()
    try:
        try:
            signal.raise_signal(signal.SIGTERM)
            sum(range(1000))  # the handler raises here
        except BaseException:  # noqa: BLE001 -- what the swallowing import does
            pass
        with pytest.raises(Stopped) as caught:
            run_search(spec.load(space), results_root=tmp_path / "r", quiet=True)
        assert caught.value.signum == signal.SIGTERM and caught.value.folder == str(tmp_path / "r" / "swallowed")
        assert (tmp_path / "r" / "swallowed" / "trials.jsonl").read_text() == ""
    finally:
        restore()
    restore = _stop_on_signals()
    try:
        Stopped.check()  # no stop of this command's own
    finally:
        restore()


def test_the_same_run_again_searches_beside_the_earlier_one(tmp_path, capsys):
    from tuner.cli import _free_name

    root = tmp_path / "results"
    assert _free_name(root, "quickstart") == "quickstart"
    for name in ("quickstart", "quickstart-2"):
        (root / name).mkdir(parents=True)
        (root / name / "trials.jsonl").write_text("{}\n")
    (root / "quickstart-3").mkdir()  # a folder where nothing ran (an empty or missing trials.jsonl) is free
    assert _free_name(root, "quickstart") == "quickstart-3"
    said = capsys.readouterr().out
    assert "resume" in said and "quickstart-3" in said


@pytest.mark.slow
def test_bench_says_when_the_config_oversubscribes_the_cores(tmp_path, capsys, monkeypatch):
    import os

    space = _space(tmp_path, f"{FIXTURES}:sleepy", "device: cpu\n")
    over = (os.cpu_count() or 1) + 1
    r = in_process("bench", str(space), "--set", f"num_workers={over}", "--json", cwd=tmp_path, capsys=capsys,
                   monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    assert f"note: knobs.num_workers: {over} DataLoader workers (more than the" in r.stderr
    assert json.loads(r.stdout)["config"]["num_workers"] == over  # measured as set


def test_bench_fits_the_advice_around_what_was_set(tmp_path):
    """`bench --set num_workers=0` on a space whose advice has persistent workers measures
    the advice without them (they have no effect there) and with the threads no worker
    leaves; a knob the user set that cannot apply is still refused."""
    import os

    from tuner import spec
    from tuner.errors import UserError
    from tuner.trial import bench_request

    space = spec.load(_space(tmp_path, f"{FIXTURES}:linear", """\
        device: cpu
        knobs:
          num_workers: [0, 1, 2]
          persistent_workers: [false, true]
          torch_threads: [1, 2]
        """))
    advice = bench_request(space).config
    assert advice["num_workers"] > 0 and advice["persistent_workers"] is True
    config = bench_request(space, {"num_workers": 0}).config
    assert config["persistent_workers"] is False
    assert config["torch_threads"] == spec.threads_left([1, 2], 0, os.cpu_count())
    with pytest.raises(UserError, match="persistent_workers"):
        bench_request(space, {"num_workers": 0, "persistent_workers": True})


@pytest.mark.parametrize("length, command, says", [
    # over the sockets' limit for DataLoader workers: refused before Ray, nothing written
    (120, ["run", "space.yaml", "--results-dir", "results"],
     "error: num_workers: DataLoader workers cannot hand batches over: set TMPDIR to a shorter folder"),
    # within the workers' limit, over Ray's (its session folder adds to TMPDIR)
    (70, ["run", "space.yaml", "--results-dir", "results"],
     "error: cannot start a local Ray: set RAY_TMPDIR (or TMPDIR) to a shorter folder"),
    # a config that holds workers, measured in its own process: refused there, not hung
    (120, ["bench", "space.yaml", "--set", "num_workers=1", "--timeout", "120"],
     "error: invalid config: knob 'num_workers=1': DataLoader workers cannot hand batches over: set TMPDIR"),
])
def test_a_temp_folder_too_long_for_sockets_is_one_line_that_names_tmpdir(temp_dir, length, command, says):
    """A TMPDIR too long for a Unix socket's path: Ray cannot start, and DataLoader workers
    wait for ever for their first batch. Each is one line that says which variable to
    shorten and shows its path, exit 2, in seconds (not a trial hung until its limit, nor
    an internal error), with nothing measured and no process left behind."""
    import os

    import psutil

    tmpdir = temp_dir / ("t" * (length - len(str(temp_dir)) - 1))
    tmpdir.mkdir()
    (temp_dir / "space.yaml").write_text("name: t\nworkload: conv\nworkload_args: {size: 64}\n"
                                         "knobs:\n  num_workers: [0, 1]\n" + FAST)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"}, "TMPDIR": str(tmpdir)}
    started = time.time()
    r = subprocess.run([sys.executable, "-m", "tuner", *command], capture_output=True, text=True, cwd=temp_dir,
                       timeout=180, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and says in lines[-1] and str(tmpdir) in lines[-1], r.stderr
    assert [ln for ln in lines if ln.startswith("error:")] == lines[-1:] and "Traceback" not in r.stderr
    assert time.time() - started < 60  # the trial's limit is 120 s
    trials = temp_dir / "results" / "t" / "trials.jsonl"
    assert not trials.exists() or trials.read_text() == ""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(str(tmpdir) in part for part in proc.info["cmdline"] or []):
                left.append(proc.info["cmdline"])
    assert not left


def _with_shm(mb: int, *args: str, cwd, run: tuple = ("-m", "tuner")) -> subprocess.CompletedProcess:
    """``python -m tuner ARGS`` (``python RUN ARGS``) with a /dev/shm of ``mb`` MB, as a
    container has one (64 MB unless it was started with --shm-size): a tmpfs mounted in a
    mount namespace of the command's own, which the machine's /dev/shm never sees. Skips
    where this machine cannot make one (no root, no unshare)."""
    import shlex
    import shutil

    make = f"mount -t tmpfs -o size={mb}m tmpfs /dev/shm"
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "sh", "-c", make],
                                                         capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare -m needs root): a small /dev/shm cannot be made")
    command = " ".join(shlex.quote(a) for a in (sys.executable, *run, *args))
    return subprocess.run(["unshare", "-m", "sh", "-c", f"{make} && exec {command}"], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_workers_out_of_shared_memory_are_told_where_it_is_and_what_a_container_needs(tmp_path):
    """DataLoader workers hand batches over in /dev/shm; a container's is small. A config
    whose batches in flight do not fit is infeasible with a reason that says so, how much
    there is and what helps (not only PyTorch's 'No space left on device'), and the doctor
    flags the size beforehand."""
    (tmp_path / "space.yaml").write_text("name: t\nworkload: conv\nworkload_args: {size: 512}\n"
                                         "knobs:\n  micro_batch_size: [128]\n  num_workers: [2]\n" + FAST)
    bench = _with_shm(2, "bench", "space.yaml", "--timeout", "120", cwd=tmp_path)  # a batch is 1.5 MB
    assert bench.returncode == 3, bench.stdout + bench.stderr
    assert ("infeasible: out of shared memory: DataLoader workers hand batches over in /dev/shm, which holds 2 MB "
            "here; a container needs --shm-size=8g or --ipc=host") in bench.stderr, bench.stderr
    doctor = _with_shm(64, "doctor", cwd=tmp_path)
    line = next(ln for ln in doctor.stdout.splitlines() if ln[5:].startswith("shm "))
    assert line.startswith("FIX ") and "holds 64 MB" in line and "--shm-size" in line


def test_a_search_whose_workers_need_shared_memory_is_warned_of_a_small_one_before_it_starts(tmp_path):
    """A local search whose space runs DataLoader workers, in a container's 64 MB /dev/shm:
    one warning line before Ray starts (configs with small batches may still fit, so the
    search goes on); none where the space runs no workers."""
    check = ("import sys; from tuner import spec; from tuner.cli import _check_workers; "
             "_check_workers(spec.load(sys.argv[1]), None)")
    seen = {}
    for name, workers in (("with", "[0, 2]"), ("without", "[0]")):
        (tmp_path / f"{name}.yaml").write_text(f"name: t\nworkload: conv\nknobs:\n  num_workers: {workers}\n")
        r = _with_shm(64, f"{name}.yaml", cwd=tmp_path, run=("-c", check))
        assert r.returncode == 0, r.stderr
        seen[name] = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert seen["without"] == []
    assert seen["with"] == ["warning: /dev/shm holds 64 MB here, where DataLoader workers hand batches over: "
                            "configs that need more fail as out of shared memory; a container needs --shm-size=8g "
                            "or --ipc=host"], seen


def test_workers_out_of_file_descriptors_are_a_hang_that_names_the_limit(tmp_path):
    """DataLoader workers hand each tensor of a batch over as a file descriptor: batches of
    per-item tensors (detection targets) in flight pass a low ``ulimit -n``, a worker's
    handover fails in a thread and the loader waits for ever. The trial is hung, and its
    reason names the limit and the command that raises it."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit on open files here is {hard}: no room to show a raise")
    (tmp_path / "space.yaml").write_text(f"name: t\nworkload: {FIXTURES}:detections\n"
                                         "knobs:\n  micro_batch_size: [64]\n  num_workers: [4]\n"
                                         "  prefetch_factor: [4]\n"  # 3,072 descriptors in flight
                                         + space_lines(idle_limit_s=8.0))  # found idle sooner than by default
    r = subprocess.run([sys.executable, "-m", "tuner", "bench", "space.yaml", "--timeout", "120"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert r.returncode == 3, r.stdout + r.stderr
    why = r.stderr.strip().splitlines()[-1]
    # found idle ("no step after ..."), or, where the machine is busy enough that the trial's
    # processes never look idle for long, at the trial's time limit: either way the limit named,
    # on a line of its own (a worker's error, half written to the same stderr as it is ended,
    # does not run into it)
    assert re.match(r"infeasible: hung: (no step after|no result within the trial time limit)", why) \
        and "open files its limit allows" in why, why
    raise_to = 65536 if hard == resource.RLIM_INFINITY else hard
    assert "of the 256 open files" in why and f"raise the limit (ulimit -n {raise_to})" in why, why
