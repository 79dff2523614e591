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
        "import infer.cluster.workload, infer.cluster.disagg\n"
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


def test_disaggregation_flags_are_checked_before_anything_starts():
    cases = [
        (["--prefill-replicas", "1"], "needs both --prefill-replicas and --decode-replicas"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--data-parallel-size", "3"],
         "--data-parallel-size 3 but --prefill-replicas 1 + --decode-replicas 1 = 2"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--tensor-parallel-size", "2"],
         "does not combine with --tensor-parallel-size"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-cache-backend",
          "contiguous"], "needs the paged KV cache"),
    ]  # fmt: skip
    for flags, message in cases:
        out = _run(
            "import sys\n"
            "from infer.server.cli import main\n"
            f"sys.exit(main(['--model', 'unused', *{flags!r}]))\n"
        )
        assert out.returncode == 2, (flags, out.stderr)
        assert message in out.stderr, (flags, out.stderr)
