"""A token file readable by other users is warned about; one readable by this process's own
group is not (Kubernetes mounts a 0400 Secret as 0440 for the pod's fsGroup)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from paramserver.security.tokens import _warn_if_shared

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("mode", "warned"), [(0o600, False), (0o400, False), (0o440, False), (0o444, True)]
)
def test_own_group_is_fine_others_are_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: int, warned: bool
) -> None:
    path = tmp_path / "token"
    path.write_text("t" * 32)
    os.chmod(path, mode)
    with caplog.at_level(logging.WARNING, logger="paramserver.security.tokens"):
        _warn_if_shared(str(path), "token file")
    assert ("readable by other users" in caplog.text) == warned


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's group needs root")
def test_a_group_this_process_is_not_in_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_text("t" * 32)
    foreign = max({os.getegid(), *os.getgroups()}) + 4242
    os.chown(path, -1, foreign)
    os.chmod(path, 0o440)
    with caplog.at_level(logging.WARNING, logger="paramserver.security.tokens"):
        _warn_if_shared(str(path), "token file")
    assert "readable by other users" in caplog.text
