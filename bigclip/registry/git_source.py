"""Publishing from a git repository at a ref, through the git command-line tool.

    git+https://github.com/org/weights.git@v1.0
    git+file:///srv/repos/weights@3f2c1a9#checkpoints/step_00001000
    git+ssh://git@host/org/weights.git              (no ref: the remote's default branch)

The ref (branch, tag or commit) is fetched with depth 1 into a temporary folder (a full fetch if
the server refuses a shallow fetch of a bare commit), checked out, and its `.git` removed; the
tree (or the sub-folder after `#`) is then published as a local folder would be, so a bigclip
checkpoint inside it is recognised. The source recorded is `git+URL@<full commit hash>`: the
publication says exactly which commit it holds, whatever the ref later points to. Git LFS files
are fetched with `git lfs pull` when git-lfs is installed; an LFS pointer left in the tree is
refused with what to install. The temporary clone is deleted once its files were read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bigclip.errors import StorageError
from bigclip.storage.redact import redact_text

GIT_PREFIX = "git+"
_LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"


def parse_git(src: str) -> tuple[str, str, str]:
    """'git+URL@REF#SUB' -> (URL, REF or '', SUB or ''). A ref follows the last '@' of the path."""
    rest, _, subdir = src[len(GIT_PREFIX) :].partition("#")
    head, at, tail = rest.rpartition("@")
    scheme_rest = head.partition("://")[2]
    if at and "/" in scheme_rest and ":" not in tail:  # not the user@ of git+ssh://git@host/...
        return head, tail, subdir.strip("/")
    return rest, "", subdir.strip("/")


def _git(*args: str, cwd: Path | None = None) -> str:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # never wait for a password on a terminal
    try:
        done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as e:
        last = (e.stderr.strip().splitlines() or ["no output"])[-1]
        raise StorageError(f"git {args[0]} failed: {redact_text(last)}") from e
    return done.stdout.strip()


def _checkout(url: str, ref: str, into: Path) -> str:
    """Fetch `ref` of `url` into `into` and check it out; returns the commit hash."""
    _git("init", "-q", str(into))
    _git("remote", "add", "origin", url, cwd=into)
    try:
        _git("fetch", "-q", "--depth", "1", "origin", ref or "HEAD", cwd=into)
    except StorageError as shallow:
        if not ref:
            raise
        _git("fetch", "-q", "--tags", "origin", cwd=into)  # a commit some servers only serve in full
        try:
            _git("rev-parse", "--verify", "-q", f"{ref}^{{commit}}", cwd=into)
        except StorageError:
            raise StorageError(
                f"{redact_text(url)} has no branch, tag or commit {ref!r} ({shallow})"
            ) from None
        _git("update-ref", "FETCH_HEAD", ref, cwd=into)
    _git("checkout", "-q", "FETCH_HEAD", cwd=into)
    return _git("rev-parse", "HEAD", cwd=into)


def _lfs(into: Path) -> None:
    pointers = [p for p in into.rglob("*") if p.is_file() and ".git" not in p.parts and _is_pointer(p)]
    if not pointers:
        return
    if shutil.which("git-lfs") is None:
        raise StorageError(
            f"{pointers[0].relative_to(into)} is a Git LFS pointer and git-lfs is not installed; install "
            "git-lfs (e.g. apt-get install git-lfs) to publish this repository"
        )
    _git("lfs", "pull", cwd=into)


def _is_pointer(path: Path) -> bool:
    if path.stat().st_size > 1024:
        return False
    with open(path, "rb") as f:
        return f.read(len(_LFS_POINTER)) == _LFS_POINTER


def git_source(src: str, *, expand: Callable[[Path], tuple[Any, Iterator[Any]]]) -> tuple[Any, Iterator[Any]]:
    """(SourceInfo, files) of the tree at the ref; `expand` publishes a local folder."""
    if shutil.which("git") is None:
        raise StorageError(f"{src}: publishing from git needs the git command-line tool; install git")
    url, ref, subdir = parse_git(src)
    tmp = Path(tempfile.mkdtemp(prefix="bigclip-git-"))
    try:
        commit = _checkout(url, ref, tmp)
        _lfs(tmp)
        shutil.rmtree(tmp / ".git")
        root = (tmp / subdir).resolve()
        if not root.is_relative_to(tmp.resolve()) or not root.exists():
            raise StorageError(f"{src}: no {subdir!r} in the repository at {commit[:12]}")
        info, files = expand(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info.uri = f"{GIT_PREFIX}{redact_text(url)}@{commit}" + (f"#{subdir}" if subdir else "")
    return info, _then_delete(files, tmp)


def _then_delete(files: Iterator[Any], tmp: Path) -> Iterator[Any]:
    try:
        yield from files
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
