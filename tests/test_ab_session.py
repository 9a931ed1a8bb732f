"""tools/ab_session.sh without a GPU: --prepare exports a branch into the git-ignored .exp/b, and a
dry run (DRY_RUN=1, passed on to tools/h200_session.sh) runs the steps in the branch's tree, the
checked-out tree, then the branch's again while the deadline allows, all packed into ab.tgz."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(any(shutil.which(t) is None for t in ("bash", "git", "timeout")),
                                reason="needs bash, git and coreutils' timeout")


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A git repository holding the two scripts, with a branch `exp` that adds a marker file."""
    r = tmp_path / "repo"
    (r / "tools").mkdir(parents=True)
    (r / "docs").mkdir()
    for name in ("ab_session.sh", "h200_session.sh"):
        shutil.copy(ROOT / "tools" / name, r / "tools" / name)
    (r / "docs" / "x.md").write_text("docs\n")
    _git(r, "init", "-q", "-b", "main")
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "base")
    _git(r, "checkout", "-q", "-b", "exp")
    (r / "marker").write_text("the branch\n")
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "exp")
    _git(r, "checkout", "-q", "main")
    return r


def _ab(repo: Path, tmp_path: Path, *args: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "DRY_RUN": "1", **env}
    return subprocess.run(["bash", "tools/ab_session.sh", *args], cwd=repo, env=full, capture_output=True,
                          text=True, timeout=120)


def test_prepare_exports_the_branch_into_an_ignored_folder(repo, tmp_path):
    p = _ab(repo, tmp_path, "--prepare", "exp")
    assert p.returncode == 0, p.stderr
    assert (repo / ".exp" / "b" / "marker").read_text() == "the branch\n"
    assert not (repo / ".exp" / "b" / "docs").exists()          # what the runs do not read
    assert not (repo / "marker").exists()                         # the checkout is untouched
    assert "/.exp/" in (repo / ".git" / "info" / "exclude").read_text().split()
    assert _git(repo, "status", "--porcelain") == ""              # nothing that would travel untracked
    again = _ab(repo, tmp_path, "--prepare", "exp")               # idempotent: one exclude line
    assert again.returncode == 0
    assert (repo / ".git" / "info" / "exclude").read_text().split().count("/.exp/") == 1


def test_unknown_branch_and_missing_export_are_refused(repo, tmp_path):
    p = _ab(repo, tmp_path, "--prepare", "nosuchbranch")
    assert p.returncode == 2 and "no commit 'nosuchbranch'" in p.stderr
    p = _ab(repo, tmp_path, "cupybwd")
    assert p.returncode == 2 and "--prepare BRANCH" in p.stderr
    p = _ab(repo, tmp_path)
    assert p.returncode == 2 and "usage" in p.stderr


def test_dry_run_times_branch_then_tree_then_branch_again(repo, tmp_path):
    assert _ab(repo, tmp_path, "--prepare", "exp").returncode == 0
    p = _ab(repo, tmp_path, "cupybwd", AB_RUN_S="30")
    assert p.returncode == 0, p.stderr
    order = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("== ") and "done at" in line]
    assert order == ["b", "a", "b2"]
    with tarfile.open(tmp_path / "out" / "ab.tgz") as tar:
        names = set(tar.getnames())
    for run in ("b", "a", "b2"):
        assert f"./{run}/summary.txt" in names and f"./{run}/log" in names
    # the last lines are the runs' summaries, in order
    heads = [line for line in p.stdout.splitlines() if line.startswith("==================== ") and
             "h200_session" not in line]
    assert [h.split()[1] for h in heads] == ["b", "a", "b2"]


def test_no_second_branch_run_past_the_deadline(repo, tmp_path):
    assert _ab(repo, tmp_path, "--prepare", "exp").returncode == 0
    p = _ab(repo, tmp_path, "cupybwd", AB_RUN_S="30", AB_DEADLINE_S="0")
    assert p.returncode == 0, p.stderr
    order = [line.split()[1] for line in p.stdout.splitlines() if line.startswith("== ") and "done at" in line]
    assert order == ["b", "a"]
