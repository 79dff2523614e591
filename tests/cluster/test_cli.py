"""Ray stays optional: plain ``infer serve`` never imports it, and asking for replicas without
it is a clear error (no ray needed for these tests)."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_plain_serve_and_the_pure_parts_do_not_import_ray():
    out = _run(
        "import sys, infer.cli, infer.server.cli, infer.server.app\n"
        "import infer.cluster, infer.cluster.policy, infer.cluster.asgi, infer.cluster.metrics\n"
        "import infer.cluster.workload\n"
        "infer.cli.build_parser()\n"
        "print('ray' in sys.modules)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_replicas_without_ray_name_the_extra():
    out = _run(
        "import sys\n"
        "sys.modules['ray'] = None  # as if it were not installed\n"
        "from infer.server.cli import main\n"
        "sys.exit(main(['--model', 'unused', '--data-parallel-size', '2']))\n"
    )
    assert out.returncode == 2, out.stderr
    assert 'pip install -e ".[ray]"' in out.stderr


def test_bad_replica_count_is_refused():
    out = _run(
        "import sys\n"
        "from infer.server.cli import main\n"
        "sys.exit(main(['--model', 'unused', '--data-parallel-size', '0']))\n"
    )
    assert out.returncode == 2
    assert "--data-parallel-size must be >= 1, got 0" in out.stderr
