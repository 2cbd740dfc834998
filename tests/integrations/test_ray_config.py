"""paramserver.integrations.ray without a cluster: the job config's checks, each job's own state
directory, the warning about a cluster without token authentication, and the CLI's lazy import
of Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

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
        ({"server": {"consistency": "bsp", "port": 1}}, "server: port is set by the launcher"),
        ({"server": {"checkpoint_dir": "/x"}}, "checkpoint_dir is set by the launcher"),
        ({"server": {"consistency": "tsp"}}, "consistency"),
        ({"server": {"no_such_field": 1}}, "'no_such_field' is not a ServerConfig field"),
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


def test_serve_args_become_the_server_config_fields_they_set() -> None:
    """ray-launch hands the shards ServerConfig fields (the integration's config API), read
    from its --serve-args with serve's own parser: only what the flags set."""
    from paramserver.cli.ray_launch import server_settings

    text = "--consistency ssp --staleness 2 --lease-ms 5000 --no-wal-fsync"
    assert server_settings(text) == {
        "consistency": "ssp",
        "staleness": 2,
        "lease_ms": 5000,
        "wal_fsync": False,
    }
    assert server_settings("") == {}


def test_ray_launch_names_the_serve_flag_the_launcher_sets() -> None:
    pytest.importorskip(
        "ray", reason="paramserver.integrations.ray needs Ray: pip install 'paramserver[ray]'"
    )
    out = subprocess.run(
        [sys.executable, "-m", "paramserver", "ray-launch", "--serve-args", "--port 7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "--serve-args: port is set by the launcher for each shard" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_two_launches_with_default_settings_do_not_share_state(tmp_path: Path) -> None:
    """Each launch with the default settings keeps its shards' state in a directory of its own
    (a second job must never restore the first one's model); a given --state-dir is used as
    it is, so passing the same one again resumes a job."""
    pytest.importorskip(
        "ray", reason="paramserver.integrations.ray needs Ray: pip install 'paramserver[ray]'"
    )
    from paramserver.cli.main import build_parser
    from paramserver.cli.ray_launch import _job_config
    from paramserver.integrations.ray import RayJobConfig, RayShardGroup

    cli_default = _job_config(build_parser().parse_args(["ray-launch"]), RayJobConfig)
    for config in (RayJobConfig(), cli_default):
        first, second = RayShardGroup(config), RayShardGroup(config)
        a, b = Path(first.state_dir), Path(second.state_dir)
        assert a != b and a not in b.parents and b not in a.parents
        for d in (a, b):
            assert d.parent == Path(tempfile.gettempdir()) / "paramserver-ray"
            assert d.name.startswith(f"{config.name}-")
        assert first.job_id != second.job_id
    given = RayJobConfig(state_dir=str(tmp_path))
    assert RayShardGroup(given).state_dir == RayShardGroup(given).state_dir == str(tmp_path)


@pytest.mark.parametrize(("mode", "warned"), [("disabled", True), ("token", False)])
def test_the_launcher_warns_once_when_the_cluster_has_no_token_auth(
    mode: str, warned: bool
) -> None:
    """A driver that joined its cluster with Ray's token authentication off found an open
    cluster (one with it refuses such a driver): one warning line. RAY_AUTH_MODE is read when
    Ray loads, hence a fresh process per mode."""
    pytest.importorskip(
        "ray", reason="paramserver.integrations.ray needs Ray: pip install 'paramserver[ray]'"
    )
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
        "from paramserver.integrations.ray.placement import warn_without_token_auth; "
        "print(warn_without_token_auth())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "RAY_AUTH_MODE": mode},
    )
    assert out.stdout.strip() == str(warned)
    lines = [line for line in out.stderr.splitlines() if "no token authentication" in line]
    assert len(lines) == (1 if warned else 0), out.stderr
    if warned:
        assert "RAY_AUTH_MODE=token" in lines[0]
