"""dejavu.provenance.tree_commit on a scratch git repository: the commit, marked when tracked files differ."""
import shutil
import subprocess

import pytest

from dejavu.provenance import CHANGED, tree_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_the_commit_and_a_changed_tree(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert tree_commit(repo, short=False) == head
    assert head.startswith(tree_commit(repo / "a.py")) and len(tree_commit(repo)) < len(head)
    (repo / "new.txt").write_text("untracked files leave the tree as committed\n")
    assert tree_commit(repo, short=False) == head
    (repo / "a.py").write_text("x = 2\n")
    assert tree_commit(repo, short=False) == head + CHANGED


def test_outside_a_checkout_is_none(tmp_path):
    assert tree_commit(tmp_path) is None
