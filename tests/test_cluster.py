"""Ray cluster submission against a real `ray start --head` (token auth), and doctor."""

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import FIXTURES
from tuner.trial import kill_tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths have a length limit
    dash = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--temp-dir={temp_dir}", f"--port={_free_port()}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2", "--num-gpus=0",
         "--include-dashboard=true", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        # Poll the jobs API with the token (an HTTP header: this test process's Ray has
        # cached its own auth mode, so its client would not pick the token up).
        import urllib.error
        import urllib.request

        deadline = time.time() + 120
        while True:
            req = urllib.request.Request(f"{address}/api/jobs/",
                                         headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline or head.poll() is not None:
                pytest.fail("the Ray head did not come up")
            time.sleep(1)
        yield address, env
    finally:
        kill_tree(head.pid)  # the head we started and every descendant, by id (never by name)
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_submit_to_a_running_head_with_token_auth(ray_head, tmp_path):
    address, env = ray_head
    workdir = tmp_path / "user"
    workdir.mkdir()
    (workdir / "my_workload.py").write_text(Path(FIXTURES).read_text())
    (workdir / "space.yaml").write_text(textwrap.dedent("""\
        name: submitted
        workload: my_workload.py:sleepy
        workload_args: {step_s: 0.01}
        knobs:
          micro_batch_size: [4, 8]
        budget: {trials: 2, trial_timeout_s: 60}
        confirm: {top: 0}
        measure: {warmup_steps: 2, window_s: 0.2, min_windows: 3, max_windows: 3}
        """))
    results = tmp_path / "cluster-results"
    # Submit from another folder: the job must carry the space and the workload file itself.
    r = subprocess.run([sys.executable, "-m", "tuner", "submit", str(workdir / "space.yaml"), "--address", address,
                        "--results-dir", str(results), "--wait"], env=env, capture_output=True, text=True,
                       timeout=500, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "submitted job" in r.stdout and "SUCCEEDED" in r.stdout
    out = results / "submitted"
    assert (out / "summary.json").is_file() and (out / "trials.jsonl").is_file()
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert summary["trials"] == 2 and summary["best"]["config"]["micro_batch_size"] in (4, 8)


@pytest.mark.slow
def test_submit_without_the_token_is_refused(ray_head, tmp_path):
    address, env = ray_head
    (tmp_path / "space.yaml").write_text("name: x\nworkload: conv\n")
    bad = dict(env, RAY_AUTH_TOKEN="wrong" + env["RAY_AUTH_TOKEN"][5:])
    r = subprocess.run([sys.executable, "-m", "tuner", "submit", str(tmp_path / "space.yaml"), "--address", address],
                       env=bad, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0


def test_doctor_says_plainly_there_is_no_gpu():
    r = subprocess.run([sys.executable, "-m", "tuner", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert any(ln.startswith(("OK", "--", "FIX")) for ln in lines)
    import torch

    if not torch.cuda.is_available():
        assert any("cuda" in ln and "there is no GPU here" in ln for ln in lines)
    assert any("compile" in ln for ln in lines) and any("cpus" in ln for ln in lines)


def test_unreachable_address_is_one_line(tmp_path):
    (tmp_path / "space.yaml").write_text("name: x\nworkload: conv\n")
    r = subprocess.run([sys.executable, "-m", "tuner", "submit", str(tmp_path / "space.yaml"), "--address",
                        f"http://127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: --address") and len(r.stderr.strip().splitlines()) == 1
