"""The built-in model cache: where it lives, building once (across threads and processes), in a
process of its own, and never using an interrupted build. Builds are real toy trainings of a few
steps."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import infer.builtin.cache as cache
from infer.bench.pyspy import child_pids
from infer.builtin import RECIPE_VERSION, builtin_dir, cache_root, ensure_builtin_model
from infer.builtin.train import MANIFEST, sha256_file

STEPS = 3


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("INFER_CACHE_DIR", str(root))
    monkeypatch.delenv("INFER_BUILTIN_STEPS", raising=False)
    return root


@pytest.fixture
def count_builds(monkeypatch) -> list[Path]:
    """Records every real training run that the cache starts."""
    calls: list[Path] = []
    real = cache.train_in_child

    def counting(name, out, **kwargs):
        calls.append(Path(out))
        return real(name, out, **kwargs)

    monkeypatch.setattr(cache, "train_in_child", counting)
    return calls


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("INFER_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "infer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "infer"


def test_path_names_everything_the_weights_depend_on(cache_dir, monkeypatch):
    path = builtin_dir("small", seed=3, steps=7)
    assert path.parent == cache_dir / "builtin"
    name = path.name
    assert name.startswith("small-") and f"r{RECIPE_VERSION}" in name
    assert "seed3" in name and "steps7" in name
    assert f"py{sys.version_info.major}.{sys.version_info.minor}" in name
    assert builtin_dir("small", seed=4, steps=7) != path
    monkeypatch.setenv("INFER_BUILTIN_STEPS", "11")
    assert "steps11" in builtin_dir("toy").name


def test_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match="toy, small"):
        ensure_builtin_model("gpt-5")


def _ensure_in_threads(n: int) -> list[Path]:
    """``ensure_builtin_model`` from ``n`` threads at once; their answers."""
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def worker():
        barrier.wait()
        try:
            results.append(ensure_builtin_model("toy", progress=False, steps=STEPS))
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    return results


def test_threads_build_once_over_a_dead_builds_leftovers_then_reuse(cache_dir, count_builds,
                                                                    capsys):  # fmt: skip
    # (one test, as each build is a training process of ~10 s here, mostly imports)
    final = builtin_dir("toy", steps=STEPS)
    final.parent.mkdir(parents=True)
    # A build killed half-way: a temp folder with some files, and a folder at the final path
    # that lacks its manifest (as if copied in by hand and cut short).
    stale = final.parent / (final.name + ".tmp-dead")
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    final.mkdir()
    (final / "config.json").write_text("{}")
    assert not cache.is_complete(final)

    # Two threads ask at once: one builds, the other waits for it.
    assert _ensure_in_threads(2) == [final, final]
    assert cache.is_complete(final)
    assert len(count_builds) == 1
    assert not stale.exists()
    assert json.loads((final / MANIFEST).read_text())["steps"] == STEPS
    err = capsys.readouterr().err
    assert err.count("infer: building the built-in 'toy' model") == 1
    digest = sha256_file(final / "model.safetensors")
    # and then it is found, not built again
    assert ensure_builtin_model("toy", progress=False, steps=STEPS) == final
    assert len(count_builds) == 1
    assert "building" not in capsys.readouterr().err
    assert sha256_file(final / "model.safetensors") == digest
    assert [p.name for p in final.parent.iterdir() if ".tmp-" in p.name] == []


def _child(code: str, cache_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "INFER_CACHE_DIR": str(cache_dir)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


ENSURE = """
import sys
from infer.builtin import ensure_builtin_model
print(ensure_builtin_model("toy", progress=False, steps=30))
print("torch" in sys.modules)
"""


def test_concurrent_processes_build_once(cache_dir):
    procs = [_child(ENSURE, cache_dir) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # The training ran in a process of its own: neither asker imported torch.
    assert [out.split()[1] for out, _ in outs] == ["False", "False"], outs
    paths = {out.split()[0] for out, _ in outs}
    assert paths == {str(builtin_dir("toy", steps=30))}
    notices = "".join(err for _, err in outs)
    assert notices.count("infer: building the built-in 'toy' model") == 1
    assert cache.is_complete(Path(paths.pop()))


# Trains for real, then hangs just before the atomic rename: the worst moment to be killed,
# since the temp folder then looks like a finished model.
KILLED_BUILD = f"""
import sys, time
import infer.builtin.cache as cache
real = cache.train_in_child
def train_then_hang(name, out, **kw):
    real(name, out, **kw)
    print("TRAINED", out, flush=True)
    time.sleep(600)
cache.train_in_child = train_then_hang
cache.ensure_builtin_model("toy", progress=False, steps={STEPS})
"""


def test_killed_build_is_never_used(cache_dir, count_builds, capsys):
    proc = _child(KILLED_BUILD, cache_dir)
    try:
        line = proc.stdout.readline()
        assert line.startswith("TRAINED"), proc.stderr.read() if proc.poll() is not None else line
        tmp = Path(line.split(maxsplit=1)[1].strip())
        assert cache.is_complete(tmp)  # complete-looking, but never renamed into place
        final = builtin_dir("toy", steps=STEPS)
        assert not final.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The dead builder's lock is gone with it: the next caller builds afresh, without waiting.
    path = ensure_builtin_model("toy", progress=False, steps=STEPS)
    assert path == final and cache.is_complete(path)
    assert len(count_builds) == 1
    assert not tmp.exists()
    assert "waiting for another process" not in capsys.readouterr().err


def test_a_failed_training_process_is_an_error_and_leaves_nothing(cache_dir, monkeypatch,
                                                                  capsys):  # fmt: skip
    def failing(name, out, **kwargs):
        return [sys.executable, "-c", "import sys; print('out of disk', file=sys.stderr); exit(3)"]

    monkeypatch.setattr(cache, "child_command", failing)
    with pytest.raises(
        RuntimeError, match=r"(?s)built-in 'toy' model failed.*status 3.*out of disk"
    ):
        ensure_builtin_model("toy", progress=False, steps=STEPS)
    # its output went through this process's sys.stderr (a notebook's cell shows it)
    assert "out of disk" in capsys.readouterr().err
    final = builtin_dir("toy", steps=STEPS)
    assert not final.exists()
    assert [p.name for p in final.parent.iterdir() if ".tmp-" in p.name] == []


def _alive(pid: int) -> bool:
    try:  # a zombie has no cmdline left; a live process does
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def _gone_within(pid: int, seconds: float, what: str) -> None:
    """Wait until process ``pid`` is gone; fail naming ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while _alive(pid):
        assert time.monotonic() < deadline, f"the training process outlived {what} by {seconds:g} s"
        time.sleep(0.1)


def _trainers(asker: subprocess.Popen, deadline: float) -> list[int]:
    """The training processes under ``asker``, once there is one (``asker`` must live on)."""
    while True:
        assert asker.poll() is None, asker.communicate()
        found = [p for p in child_pids(asker.pid) if b"build_child" in
                 Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
        if found:
            return found
        assert time.monotonic() < deadline, "no training process started"
        time.sleep(0.1)


def _as_a_terminal_job() -> None:
    """In the child before exec: SIGINT at its default and not blocked, as a shell's
    foreground job has it, whatever the test process inherited (an ignored or blocked SIGINT
    survives exec: a CI run once left the command deaf to Ctrl-C, training on for 60 s)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_during_a_build_says_interrupted_and_leaves_nothing(cache_dir):
    """Ctrl-C (SIGINT to the terminal's process group) while ``infer train`` builds into the
    cache: one line saying so, no traceback from either process, the command ended by SIGINT
    (as a shell expects of Ctrl-C), the training process gone and no temporary folder left."""
    # 100,000 steps: a build that provably outlasts this test.
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.cli", "train", "--preset", "toy", "--steps", "100000"],
        env={**os.environ, "INFER_CACHE_DIR": str(cache_dir)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=_as_a_terminal_job,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        trainers = _trainers(proc, deadline)
        seen = b""  # the training's progress bar, copied by the parent: it is training now
        while b"training toy" not in seen:
            assert select.select([proc.stderr], [], [], max(0.0, deadline - time.monotonic()))[0], (
                "no progress bar within 120 s: " + seen.decode(errors="replace"))  # fmt: skip
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, seen.decode(errors="replace")
            seen += chunk
        os.killpg(proc.pid, signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
        err = seen.decode(errors="replace") + rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGINT, err
    assert err.rstrip().endswith("infer train: interrupted") and "Traceback" not in err, err
    _gone_within(trainers[0], 30, "Ctrl-C")
    folder = builtin_dir("toy", steps=100_000).parent
    assert [p.name for p in folder.iterdir() if ".tmp-" in p.name] == []


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_training_process_ends_with_the_process_that_asked(cache_dir):
    # 100,000 steps: a build that provably outlasts this test.
    asker = _child("""
    from infer.builtin import ensure_builtin_model
    ensure_builtin_model("toy", progress=False, steps=100_000)
    """, cache_dir)  # fmt: skip
    try:
        trainers = _trainers(asker, time.monotonic() + 120)
    finally:
        asker.send_signal(signal.SIGKILL)
        asker.wait(timeout=30)
    _gone_within(trainers[0], 30, "its parent")


def test_the_training_process_imports_the_callers_infer(tmp_path):
    """Another ``infer`` first on the path (here one that cannot be imported): the training
    process still runs this one (its ``--help`` proves it got as far as its own parser)."""
    other = tmp_path / "elsewhere" / "infer"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise ImportError('the wrong infer')\n")
    env = {**os.environ, "PYTHONPATH": str(other.parent)}
    cmd = cache.child_command("toy", tmp_path / "out", seed=0, steps=1, progress=False)
    proc = subprocess.run([*cmd, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "infer.builtin.build_child" in proc.stdout
    # (the plain module path finds the other one)
    plain = subprocess.run([sys.executable, "-m", "infer.builtin.build_child", "--help"], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert plain.returncode != 0 and "the wrong infer" in plain.stderr
