"""paramserver.integrations.ray without a cluster: the job config's checks, and the CLI's lazy
import of Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_paramserver_help_lists_ray_launch_without_importing_ray() -> None:
    """`paramserver --help` (and every other command) must not pay for, or need, Ray."""
    code = (
        "import sys; from paramserver.cli.main import build_parser; p = build_parser(); "
        "assert 'ray-launch' in p._subparsers._group_actions[0].choices; "
        "print('ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"num_shards": 0}, "num_shards"),
        ({"base_port": 65535, "num_shards": 2}, "base_port"),
        ({"strategy": "SCATTER"}, "strategy"),
        ({"worker_failure": "ignore"}, "worker_failure"),
        ({"shard_max_restarts": -1}, "shard_max_restarts"),
        ({"job_timeout_s": 0}, "job_timeout_s"),
        ({"serve_args": ("--consistency", "bsp", "--port", "1")}, "--port"),
        ({"serve_args": ("--checkpoint-dir=/x",)}, "--checkpoint-dir"),
    ],
)
def test_job_config_refuses_bad_values(changes: dict[str, object], complaint: str) -> None:
    pytest.importorskip(
        "ray", reason="paramserver.integrations.ray needs Ray: pip install 'paramserver[ray]'"
    )
    from paramserver.errors import InvalidArgument
    from paramserver.integrations.ray import RayJobConfig

    with pytest.raises(InvalidArgument, match=complaint):
        RayJobConfig(**changes)  # type: ignore[arg-type]


def test_ray_launch_names_the_flag_of_a_bad_value() -> None:
    """A bad value ends `paramserver ray-launch` with exit 2 and one line naming the flag,
    before any connection to a cluster."""
    pytest.importorskip(
        "ray", reason="paramserver.integrations.ray needs Ray: pip install 'paramserver[ray]'"
    )
    out = subprocess.run(
        [sys.executable, "-m", "paramserver", "ray-launch", "--shards", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "--shards and --workers must be >= 1, got 0 and 4" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
