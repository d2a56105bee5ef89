"""The runtime directory for sockets is refused unless it is this user's own and closed to other users."""

import os

import pytest

from kvshare.paths import UnsafeDirectory, runtime_dir


@pytest.fixture
def xdg(tmp_path, monkeypatch):
    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    return base


def test_a_fresh_runtime_dir_is_private(xdg):
    path = runtime_dir()
    assert path == str(xdg / "kvshare")
    assert os.stat(path).st_mode & 0o777 == 0o700


def test_a_runtime_dir_others_may_write_is_refused(xdg):
    """Fails when the mode check is removed from check_private_dir: runtime_dir returns the open directory."""
    (xdg / "kvshare").mkdir()
    os.chmod(xdg / "kvshare", 0o777)
    with pytest.raises(UnsafeDirectory, match=r"may be written by other users \(mode 777\): chmod 700 .*kvshare"):
        runtime_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root")
def test_a_runtime_dir_of_another_user_is_refused(xdg):
    """Fails when the owner check is removed from check_private_dir: runtime_dir returns uid 4242's directory."""
    (xdg / "kvshare").mkdir(mode=0o700)
    os.chown(xdg / "kvshare", 4242, 4242)
    with pytest.raises(UnsafeDirectory, match="belongs to uid 4242, not to you"):
        runtime_dir()


def test_a_link_in_place_of_the_runtime_dir_is_refused(xdg, tmp_path):
    """Fails when the lstat check is removed: the link is followed to a directory someone else chose."""
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", xdg / "kvshare")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        runtime_dir()
