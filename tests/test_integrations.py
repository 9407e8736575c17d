"""Where teams already look: TensorBoard and MLflow through Ray Tune's logger
callbacks, the study's figures as Optuna user attributes, and optuna-dashboard on it.
A real search (real Ray, Optuna, torch) writes them; each is read back with its own
format or API."""

import json
import os
import re
import socket
import struct
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, space_lines
from tuner import spec
from tuner.search import run_search

# one worker runs these tests (`--dist loadgroup`), so that their module's search runs once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("integrations")]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """One small search, logged to TensorBoard and MLflow."""
    tmp = tmp_path_factory.mktemp("integrations")
    p = tmp / "space.yaml"
    p.write_text(textwrap.dedent(f"""\
        name: logged
        workload: {FIXTURES}:linear
        knobs:
          micro_batch_size: [4, 8, 16]
        budget: {{trials: 2, trial_timeout_s: 120}}
        confirm: {{top: 0, repeats: 0}}
        log_to: [tensorboard, mlflow]
        """) + space_lines(max_timed_s=4))
    run_search(spec.load(p), results_root=tmp / "results", quiet=True)
    return tmp / "results" / "logged"


def _tfevent_tags(path: Path) -> set[str]:
    """The scalar tags of a TensorBoard event file (TFRecord framing: length, its CRC,
    the Event proto, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    tags, data = set(), path.read_bytes()
    i = 0
    while i + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        event = Event.FromString(data[i + 12:i + 12 + n])
        tags |= {v.tag for v in event.summary.value}
        i += 12 + n + 4
    return tags


def test_tensorboard_events_hold_each_trials_figures(searched):
    files = list((searched / "ray").glob("*/events.out.tfevents*"))
    # one per measurement: the baseline's and the two configs'
    assert len(files) == 3, files
    assert len([f for f in files if "_search_" in f.parent.name]) == 2, files
    for f in files:
        tags = _tfevent_tags(f)
        assert any(t.endswith("samples_per_sec") for t in tags), tags
        assert any(t.endswith("peak_host_memory_mb") for t in tags), tags


def test_mlflow_store_holds_a_run_per_trial(searched):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{searched / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["logged"])
    assert sorted(runs["params.phase"]) == ["baseline", "search", "search"]  # one per measurement
    assert (runs["metrics.samples_per_sec"] > 0).all()
    assert set(runs["params.knobs/micro_batch_size"]) <= {"4", "8", "16"}


def test_optuna_trials_carry_figures_as_user_attributes(searched):
    import optuna

    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(searched / "optuna.journal")))
    study = optuna.load_study(study_name="logged", storage=storage)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2
    records = {json.loads(x)["config"]["micro_batch_size"]: json.loads(x)
               for x in (searched / "trials.jsonl").read_text().splitlines() if '"search"' in x}
    for t in done:
        rec = records[t.params["micro_batch_size"]]
        assert t.user_attrs["status"] == "ok"
        assert t.user_attrs["samples_per_sec"] == pytest.approx(rec["samples_per_sec"])
        assert t.user_attrs["peak_host_memory_mb"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_serves_the_study_on_loopback(searched):
    pytest.importorskip("optuna_dashboard")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuner", "dashboard", str(searched), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert f"http://127.0.0.1:{port}/dashboard/" in proc.stdout.readline()
        deadline, studies = time.time() + 60, None
        while studies is None and time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=5) as r:
                    studies = json.load(r)["study_summaries"]
            except OSError:
                time.sleep(0.5)
        assert studies is not None, "the dashboard never answered"
        study = next(s for s in studies if s["study_name"] == "logged")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{study['study_id']}?after=0",
                                    timeout=10) as r:
            trials = json.load(r)["trials"]
        attrs = [{a["key"] for a in t["user_attrs"]} for t in trials if t["state"] == "Complete"]
        assert attrs and all({"samples_per_sec", "status"} <= a for a in attrs)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, "SIGTERM did not end the dashboard cleanly"


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_dashboard_page_in_headless_chromium_shows_the_study(searched, tmp_path):
    pytest.importorskip("optuna_dashboard")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuner", "dashboard", str(searched), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+/dashboard/", proc.stdout.readline()).group(0)
        _wait_for(f"http://127.0.0.1:{port}/api/studies")
        browser = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                   "--window-size=1280,900", "--virtual-time-budget=15000", f"--user-data-dir={tmp_path / 'profile'}"]
        study = next(st for st in json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies"))
                     ["study_summaries"] if st["study_name"] == "logged")
        page = f"{url}studies/{study['study_id']}/trials"  # the study's trial list
        shot = tmp_path / "dashboard.png"
        subprocess.run([*browser, f"--screenshot={shot}", page], capture_output=True, timeout=120)
        assert shot.is_file() and shot.stat().st_size > 10_000  # a rendered page, not a blank one
        text = _text(subprocess.run([*browser, "--dump-dom", page], capture_output=True, text=True,
                                    timeout=120).stdout)
        assert "logged" in text and re.search(r"\b2 Trials\b", text), text[:2000]
        assert "samples_per_sec" in text and "peak_host_memory_mb" in text  # the user attributes
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, "SIGTERM did not end the dashboard cleanly"


def _wait_for(url: str, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} never answered")


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", " ", re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", html, flags=re.S))


def test_dashboard_without_a_study_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "trials.jsonl").write_text("")
    (tmp_path / "empty" / "space.yaml").write_text("name: empty\nworkload: conv\n")
    out = subprocess.run([sys.executable, "-m", "tuner", "dashboard", str(tmp_path / "empty")],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "optuna.journal" in out.stderr


def test_this_module_s_tests_are_one_group_for_xdist(request):
    """Under `-n` with `--dist loadgroup` (pyproject's addopts) xdist sends a group's tests
    to one worker by the `@group` it appends to their node ids. A pytest whose node ids it
    cannot append to (9.2, beside xdist 3.8) ran this module's search once per worker and
    the `alone` tests on both workers, each waiting the other out: nothing failed, the
    suite only slowed. This says so where it happens."""
    if not getattr(request.config.option, "loadgroup", False):  # set in xdist's workers
        pytest.skip("not run by xdist workers under --dist loadgroup")
    assert request.node.nodeid.endswith("@integrations"), (
        f"pytest {pytest.__version__} node ids carry no xdist group: {request.node.nodeid}")
