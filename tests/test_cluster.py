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

from tests.helpers import FIXTURES, space_lines, torch_default_threads
from tuner.trial import kill_tree


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_head() -> tuple[subprocess.Popen, str, dict, str]:
    """A real token-auth head, as a child of this test: (process, dashboard address, env, temp dir).
    Its output goes to ``head.log`` in the temp dir, for the message if it does not come up."""
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths have a length limit
    dash = _free_port()
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    with open(Path(temp_dir) / "head.log", "wb") as log:
        head = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--temp-dir={temp_dir}",
             f"--port={_free_port()}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2",
             "--num-gpus=0", "--include-dashboard=true", "--disable-usage-stats",
             # the job agent's HTTP port is 52365 unless told: with another Ray on this
             # machine (a developer's own), this head would have no job agent
             f"--dashboard-agent-listen-port={_free_port()}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return head, f"http://127.0.0.1:{dash}", env, temp_dir


def _head_up(head: subprocess.Popen, address: str, env: dict, within_s: float) -> bool:
    """Whether the head's jobs API answers, polled with the token (an HTTP header: this test
    process's Ray has cached its own auth mode, so its client would not pick the token up).
    False once ``within_s`` has passed or the head has exited."""
    import urllib.error
    import urllib.request

    deadline = time.time() + within_s
    while time.time() < deadline and head.poll() is None:
        req = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    return False


def _stop_head(head: subprocess.Popen, temp_dir: str) -> None:
    import shutil

    kill_tree(head.pid)  # the head we started and every descendant, by id (never by name)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def ray_head(tmp_path):
    # A head that exits at once most likely lost a port picked free to another test's
    # process in the moment between; a second head takes fresh ports. One slow to come
    # up is given minutes: with the suite's other worker busy, a 2-core machine takes them.
    for attempt in range(2):
        head, address, env, temp_dir = _start_head()
        if _head_up(head, address, env, within_s=240):
            break
        code = head.poll()
        log = (Path(temp_dir) / "head.log").read_text(errors="replace").strip().splitlines()[-15:]
        _stop_head(head, temp_dir)
        if code is None or attempt == 1:
            pytest.fail(f"the Ray head did not come up ({'exited ' + str(code) if code is not None else 'no answer in 240 s'}):\n"
                        + "\n".join(log))
    try:
        yield address, env
    finally:
        _stop_head(head, temp_dir)


def _user_folder(workdir: Path) -> None:
    """A user's folder: a workload file that imports its workload from a package beside it,
    an unrelated module it does not import, and data."""
    (workdir / "mine").mkdir(parents=True)
    (workdir / "mine" / "__init__.py").write_text("")
    (workdir / "mine" / "impl.py").write_text(Path(FIXTURES).read_text())
    (workdir / "my_workload.py").write_text("from mine.impl import sleepy  # noqa: F401\n")
    (workdir / "unused.py").write_text("raise SystemExit('not imported by the workload')\n")
    (workdir / "data.bin").write_bytes(b"x" * 1024)


def test_stage_ships_the_modules_the_workload_file_imports(tmp_path, monkeypatch):
    """From the user's own folder, as a user submits: modules whose ``__file__`` is a bare
    name that is no file (torch's ``torch.classes`` says ``_classes.py``) read as files of
    that folder, and staging failed copying them."""
    import sys
    import types

    from tuner import cluster, spec

    workdir = tmp_path / "user"
    _user_folder(workdir)
    monkeypatch.chdir(workdir)
    fake = types.ModuleType("tuner_test_namespace")
    fake.__file__ = "_namespace.py"  # as torch.classes and torch.ops say
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    (workdir / "space.yaml").write_text("name: staged\nworkload: my_workload.py:sleepy\n"
                                        "knobs: {micro_batch_size: [4]}\n")
    space = spec.load(workdir / "space.yaml")
    spec.check_workload(space)  # as `submit` does: the workload loads here first
    staging = tmp_path / "staging"
    staging.mkdir()
    assert cluster.stage(space, staging) == "space.yaml"
    shipped = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    assert shipped == ["mine/__init__.py", "mine/impl.py", "my_workload.py", "space.yaml"], shipped
    assert "workload: my_workload.py:sleepy" in (staging / "space.yaml").read_text()


@pytest.mark.slow
def test_submit_to_a_running_head_with_token_auth(ray_head, tmp_path):
    address, env = ray_head
    workdir = tmp_path / "user"
    _user_folder(workdir)
    (workdir / "space.yaml").write_text(textwrap.dedent("""\
        name: submitted
        workload: my_workload.py:sleepy
        workload_args: {step_s: 0.01}
        knobs:
          micro_batch_size: [4, 8]
        budget: {trials: 2, trial_timeout_s: 60}
        confirm: {top: 0}
        """) + space_lines(max_windows=3))
    results = tmp_path / "cluster-results"
    # Submit from another folder: the job must carry the space, the workload file and the
    # package it imports from beside it.
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
    # the job's driver runs with the OMP_NUM_THREADS Ray gives its job supervisor; the
    # trials run with PyTorch's own threads, at most the head's 2 CPUs, as a user's run would
    threads = {r["intra_op_threads"] for r in map(json.loads, (out / "trials.jsonl").read_text().splitlines())}
    assert threads == {min(2, torch_default_threads())}, threads


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


def test_doctor_says_when_the_temp_folder_leaves_dataloader_workers_no_room(temp_dir):
    """DataLoader workers hand batches over through sockets under TMPDIR: the doctor checks
    there is room for their paths, and where there is not, says to shorten it."""
    import os

    tmpdir = temp_dir / ("t" * 100)
    tmpdir.mkdir()
    lines = {}
    for name, env in (("short", os.environ), ("long", {**os.environ, "TMPDIR": str(tmpdir)})):
        r = subprocess.run([sys.executable, "-m", "tuner", "doctor"], capture_output=True, text=True, timeout=120,
                           env=env)
        assert r.returncode == 0
        lines[name] = next(ln for ln in r.stdout.splitlines() if ln[5:].startswith("workers "))
    assert lines["short"].startswith("OK ")
    assert lines["long"].startswith("FIX ") and "set TMPDIR to a shorter folder" in lines["long"] \
        and lines["long"].endswith(str(tmpdir))


def test_doctor_names_a_debugging_switch_left_in_the_environment(monkeypatch):
    import io

    from tuner.cluster import doctor
    from tuner.hardware import DEBUG_ENV, debug_env

    for name in DEBUG_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("TORCH_COMPILE_DEBUG", "0")  # off, as PyTorch reads it
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert [d.split("=")[0] for d in debug_env(gpu=True)] == ["CUDA_LAUNCH_BLOCKING", "TORCHDYNAMO_DISABLE"]
    assert [d.split("=")[0] for d in debug_env(gpu=False)] == ["TORCHDYNAMO_DISABLE"]  # a CPU run's only
    out = io.StringIO()
    doctor(out=out)
    line = next(ln for ln in out.getvalue().splitlines() if ln[5:].startswith("debug env"))
    assert line.startswith("FIX ") and "TORCHDYNAMO_DISABLE=1" in line and "unset it" in line
    monkeypatch.delenv("TORCHDYNAMO_DISABLE")
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING")
    out = io.StringIO()
    doctor(out=out)
    assert next(ln for ln in out.getvalue().splitlines() if ln[5:].startswith("debug env")).startswith("OK ")


@pytest.mark.slow
def test_doctor_checks_each_node_of_a_cluster_where_its_trials_would_run(temp_dir):
    """``doctor --address`` asks every node what its trials would meet there: a node whose
    Ray workers have a TMPDIR too long for DataLoader workers' sockets, and which Ray says
    has GPUs where no NVIDIA driver answers, is flagged with both fixes; the other is OK.
    A real two-node Ray (``ray.cluster_utils.Cluster``): the GPUs are Ray's logical ones,
    and this machine has no NVIDIA driver."""
    import torch
    from ray.cluster_utils import Cluster

    tmpdir = temp_dir / ("t" * 100)
    tmpdir.mkdir()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1, num_gpus=2, env_vars={"TMPDIR": str(tmpdir)})
        r = subprocess.run([sys.executable, "-m", "tuner", "doctor", "--address", cluster.address],
                           capture_output=True, text=True, timeout=300)
    finally:
        cluster.shutdown()
    assert r.returncode == 0, r.stderr
    nodes = sorted((ln for ln in r.stdout.splitlines() if ln[5:].startswith("node ")), key=lambda ln: ln[:4])
    assert len(nodes) == 2, r.stdout
    fix, ok = nodes
    assert fix.startswith("FIX ") and ok.startswith("OK "), nodes
    assert "cores (Ray: 1 CPU), 0 GPU(s), /dev/shm" in ok and ok.endswith(f"torch {torch.__version__}")
    assert "set TMPDIR to a shorter folder" in fix and str(tmpdir) in fix
    assert fix.endswith("Ray offers 2 GPU(s) here and no NVIDIA driver answers: check the driver (nvidia-smi), "
                        "or start the node's Ray with --num-gpus=0")
    assert not any(ln.startswith("FIX  nodes' torch") for ln in r.stdout.splitlines())


@pytest.mark.slow
def test_unreachable_address_is_one_line(tmp_path):
    (tmp_path / "space.yaml").write_text("name: x\nworkload: conv\n")
    r = subprocess.run([sys.executable, "-m", "tuner", "submit", str(tmp_path / "space.yaml"), "--address",
                        f"http://127.0.0.1:{_free_port()}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: --address") and len(r.stderr.strip().splitlines()) == 1


SPACE = "name: x\nworkload: conv\nbudget: {trials: 1}\n"


@pytest.mark.slow
def test_submit_the_moment_a_fresh_heads_dashboard_answers(tmp_path):
    """The submission goes out as soon as the dashboard's port accepts a connection, when
    the job agent may not be up yet ("No available agent ... try again later"): it waits
    that out. Twice, each time on a new head."""
    (tmp_path / "space.yaml").write_text(SPACE)
    for attempt in range(2):
        head, address, env, temp_dir = _start_head()
        try:
            port = int(address.rsplit(":", 1)[1])
            deadline = time.time() + 240
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline or head.poll() is not None:
                        log = (Path(temp_dir) / "head.log").read_text(errors="replace").strip().splitlines()[-15:]
                        pytest.fail("the Ray head's dashboard did not open its port:\n" + "\n".join(log))
                    time.sleep(0.1)
            r = subprocess.run([sys.executable, "-m", "tuner", "submit", str(tmp_path / "space.yaml"),
                                "--address", address, "--results-dir", str(tmp_path / "res")],
                               env=env, capture_output=True, text=True, timeout=200)
            assert r.returncode == 0, f"attempt {attempt + 1}: {r.stdout[-2000:]} {r.stderr[-2000:]}"
            assert "submitted job" in r.stdout
        finally:
            _stop_head(head, temp_dir)


class _StartingJobApi:
    """A local HTTP stub of Ray's job API that answers a submission with Ray's 500 "try
    again later" ``busy`` times, then accepts it (a deterministic starting head)."""

    def __init__(self, busy: int):
        import http.server
        import json
        import threading

        self.busy, self.posts = busy, 0
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code: int, body: object) -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # the version check; packages "already uploaded"
                if self.path.startswith("/api/version"):
                    self._send(200, {"ray_version": "2.60.0", "version": "4", "ray_commit": "x"})
                else:
                    self._send(200, {})

            def do_PUT(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._send(200, {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stub.posts += 1
                if stub.posts <= stub.busy:
                    self._send(500, "No available agent to submit job, please try again later.")
                else:
                    self._send(200, {"submission_id": "raysubmit_stub", "job_id": None})

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_submit_waits_out_a_starting_head(tmp_path, monkeypatch):
    import io

    from tuner import cluster, spec

    (tmp_path / "space.yaml").write_text(SPACE)
    sleeps: list[float] = []
    real = cluster.retrying
    monkeypatch.setattr(cluster, "retrying", lambda call, address, out, **kw: real(
        call, address, out, sleep=sleeps.append, **kw))  # the backoff recorded, not slept
    stub = _StartingJobApi(busy=2)
    try:
        out = io.StringIO()
        assert cluster.submit(spec.load(tmp_path / "space.yaml"), stub.address, "res", out=out) == 0
    finally:
        stub.close()
    assert stub.posts == 3 and sleeps == [1.0, 2.0]
    text = out.getvalue()
    assert text.count("still starting") == 1 and "submitted job raysubmit_stub" in text


def test_submit_gives_up_on_a_head_that_stays_busy(tmp_path, monkeypatch):
    from tuner import cluster, spec
    from tuner.errors import UserError

    (tmp_path / "space.yaml").write_text(SPACE)
    clock = [0.0]

    def sleep(s: float) -> None:
        clock[0] += s

    monkeypatch.setattr(cluster.time, "monotonic", lambda: clock[0])
    real = cluster.retrying
    monkeypatch.setattr(cluster, "retrying", lambda call, address, out, **kw: real(
        call, address, out, sleep=sleep, **kw))
    stub = _StartingJobApi(busy=10**6)
    try:
        with pytest.raises(UserError, match="refused the search .*try again later"), open(os.devnull, "w") as out:
            cluster.submit(spec.load(tmp_path / "space.yaml"), stub.address, "res", out=out)
    finally:
        stub.close()
    assert 55 <= clock[0] <= 60 and stub.posts > 5


@pytest.mark.alone  # the busiest process must be the test's own spinner
def test_doctor_names_the_load_beside_a_search():
    """A process outside the command (not its child: the doctor's own are not load) that
    keeps a core busy is named, with its pid."""
    import signal

    from tuner.cluster import other_load

    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"
    out = subprocess.run(["sh", "-c", f'{sys.executable} -c "{spin}" >/dev/null 2>&1 & echo $!'],
                         capture_output=True, text=True, check=True)
    pid = int(out.stdout.strip())
    try:
        time.sleep(0.5)
        busy, names = other_load(1.0)
        assert busy >= 0.7 and f"pid {pid}" in names, (busy, names)
    finally:
        os.kill(pid, signal.SIGKILL)
