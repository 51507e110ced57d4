#!/usr/bin/env python
"""Apply (or revert) the DSV patch set to a Megatron-LM checkout at a pinned tag.

    python tools/apply_patches.py /path/to/Megatron-LM            # apply
    python tools/apply_patches.py /path/to/Megatron-LM --check    # say what would happen, change nothing
    python tools/apply_patches.py /path/to/Megatron-LM --revert   # back to the pristine tag

Pinned tags (``PINNED``): core_v0.16.1 and core_v0.19.0, one series each in
patches/megatron-lm/<tag>/NNNN-*.patch, applied in name order. The tag is found from the
checkout's HEAD commit (``--tag`` insists on one). The patches only call into megatron_dsv;
patches/README.md says what each one does. Before touching anything the tool checks that HEAD
is a pinned commit and that no tracked file differs from it, except when the tree is exactly the
patched state (then applying again does nothing and --revert restores the tag). ``git apply
--check`` of the whole series runs before ``git apply``, and git applies a series atomically: a
failure leaves the tree as it was. Untracked files are ignored (they do not affect the patched
files).

Exit codes:
    0  done, or nothing to do (already applied / nothing to revert)
    1  a git command failed unexpectedly
    2  bad usage: not a git work tree, no patches found, unknown --tag (argparse errors also exit 2)
    3  wrong Megatron-LM version (HEAD is not a pinned commit, or not the one --tag names)
    4  dirty tree: tracked files differ from both the pinned commit and the patched state
    5  the patches do not apply (git apply --check failed)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import List, Optional, Sequence

# tag -> commit of every Megatron-LM release the patch sets target (the first is the default pin)
PINNED = {
    "core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
    "core_v0.19.0": "5be9626709af2722333bf54797c954c09edeada3",
}
PINNED_TAG = "core_v0.16.1"
PINNED_COMMIT = PINNED[PINNED_TAG]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH_ROOT = os.path.join(ROOT, "patches", "megatron-lm")
PATCH_DIR = os.path.join(PATCH_ROOT, PINNED_TAG)

EXIT_OK, EXIT_GIT, EXIT_USAGE, EXIT_VERSION, EXIT_DIRTY, EXIT_APPLY = 0, 1, 2, 3, 4, 5

__all__ = ["PINNED", "PINNED_TAG", "PINNED_COMMIT", "PATCH_DIR", "patch_dir_for", "patch_files", "touched_files",
           "main"]


class ToolError(Exception):
    """A refusal with its exit code; the message is printed as is."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _git(repo: str, *args: str, env: Optional[dict] = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise ToolError(EXIT_GIT, f"'git {' '.join(args)}' failed in {repo}:\n{proc.stderr.strip()}")
    return proc


def patch_dir_for(tag: str) -> str:
    """The folder of ``tag``'s series (patches/megatron-lm/<tag>)."""
    return os.path.join(PATCH_ROOT, tag)


def patch_files(patch_dir: str = PATCH_DIR) -> List[str]:
    """The series, in application order (NNNN-name.patch, sorted by name)."""
    if not os.path.isdir(patch_dir):
        return []
    names = sorted(n for n in os.listdir(patch_dir) if re.fullmatch(r"\d{4}-[\w.-]+\.patch", n))
    return [os.path.join(patch_dir, n) for n in names]


def touched_files(patch: str) -> List[str]:
    """Paths a patch changes, from its ``diff --git a/X b/Y`` headers (post-image names)."""
    with open(patch, encoding="utf-8") as f:
        return [m.group(2) for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", f.read(), re.M)]


def _toplevel(path: str) -> str:
    if not os.path.isdir(path):
        raise ToolError(EXIT_USAGE, f"{path} is not a directory")
    proc = _git(path, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0:
        raise ToolError(EXIT_USAGE, f"{path} is not a git work tree (a Megatron-LM clone is needed): "
                                    f"{proc.stderr.strip()}")
    return proc.stdout.strip()


def _check_version(repo: str, tag: Optional[str] = None) -> str:
    """The pinned tag whose commit is HEAD (``tag``: that one only); a ToolError otherwise."""
    if tag is not None and tag not in PINNED:
        raise ToolError(EXIT_USAGE, f"--tag must be one of {', '.join(PINNED)}; got {tag!r}")
    wanted = {tag: PINNED[tag]} if tag else dict(PINNED)
    head = _git(repo, "rev-parse", "HEAD", check=False).stdout.strip()
    for name, commit in wanted.items():
        if head == commit:
            return name
    described = _git(repo, "describe", "--tags", "--always", check=False).stdout.strip() or "no commit"
    expected = " or ".join(f"{name} (commit {commit})" for name, commit in wanted.items())
    first = next(iter(wanted))
    raise ToolError(EXIT_VERSION,
                    f"wrong Megatron-LM version in {repo}: found {described} (commit {head or '?'}), "
                    f"expected {expected}.\n"
                    f"  fix: git -C {repo} fetch --tags && git -C {repo} checkout {first}")


def _changed_files(repo: str) -> List[str]:
    """Tracked files whose index or work-tree content differs from HEAD (untracked ignored)."""
    out = _git(repo, "status", "--porcelain", "--untracked-files=no").stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def _is_patched_state(repo: str, patches: Sequence[str]) -> bool:
    """True when tracked files equal HEAD with the whole series applied, byte for byte.

    Builds that tree in a throw-away index (``git apply --cached``) and compares the work tree
    with it, so any extra edit, even inside a patched file, makes the answer False.
    """
    if _git(repo, "diff", "--cached", "--quiet", "HEAD", check=False).returncode != 0:
        return False  # staged changes: the real index is not HEAD's
    with tempfile.TemporaryDirectory(prefix="dsv-apply-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        _git(repo, "read-tree", "HEAD", env=env)
        if _git(repo, "apply", "--cached", *patches, env=env, check=False).returncode != 0:
            return False
        _git(repo, "update-index", "-q", "--refresh", env=env, check=False)
        return _git(repo, "diff", "--quiet", env=env, check=False).returncode == 0


def _dirty_error(repo: str, changed: List[str], revert: bool, tag: str) -> ToolError:
    wanted = "the patched state (the series applied, nothing else)" if revert else f"a clean {tag} tree"
    listing = "\n".join(f"    {name}" for name in changed)
    return ToolError(EXIT_DIRTY, f"dirty tree in {repo}: {'--revert' if revert else 'applying'} needs {wanted}; "
                                 f"these tracked files differ:\n{listing}\n"
                                 f"  fix: commit or stash them, or 'git -C {repo} checkout -- <file>' to drop them")


def _git_apply(repo: str, patches: Sequence[str], reverse: bool, check_only: bool) -> None:
    args = ["apply"] + (["-R"] if reverse else []) + (["--check"] if check_only else [])
    series = list(reversed(patches)) if reverse else list(patches)
    proc = _git(repo, *args, *series, check=False)
    if proc.returncode != 0:
        what = "revert" if reverse else "apply"
        raise ToolError(EXIT_APPLY, f"the patches do not {what} cleanly to {repo} "
                                    f"('git {' '.join(args)}' failed):\n{proc.stderr.strip()}")


def _describe_series(patches: Sequence[str]) -> str:
    return "\n".join(f"    {os.path.basename(p)}: {', '.join(touched_files(p))}" for p in patches)


def run(repo_dir: str, revert: bool = False, check: bool = False, patch_dir: Optional[str] = None,
        tag: Optional[str] = None) -> str:
    """Do the work; returns the report to print, raises :class:`ToolError` on refusal.

    ``patch_dir`` defaults to the series of the tag HEAD is pinned at; ``tag`` insists on one tag.
    """
    repo = _toplevel(repo_dir)
    tag = _check_version(repo, tag)
    patch_dir = patch_dir or patch_dir_for(tag)
    patches = patch_files(patch_dir)
    if not patches:
        raise ToolError(EXIT_USAGE, f"no NNNN-*.patch files in {patch_dir}")
    changed = _changed_files(repo)
    patched = bool(changed) and _is_patched_state(repo, patches)
    if changed and not patched:
        raise _dirty_error(repo, changed, revert, tag)
    series = _describe_series(patches)
    if not revert and patched:
        return f"{repo}: already patched ({len(patches)} patches on {tag}); nothing to do"
    if revert and not changed:
        return f"{repo}: clean {tag} tree; nothing to revert"
    _git_apply(repo, patches, reverse=revert, check_only=True)
    verb = "revert" if revert else "apply"
    if check:
        return f"{repo}: {tag}; the {len(patches)} patches would {verb} cleanly (--check: nothing changed):\n{series}"
    _git_apply(repo, patches, reverse=revert, check_only=False)
    if revert and _changed_files(repo):
        raise ToolError(EXIT_GIT, f"reverted, but tracked files still differ from {tag}: "
                                  f"{', '.join(_changed_files(repo))}")
    if not revert and not _is_patched_state(repo, patches):
        raise ToolError(EXIT_GIT, f"applied, but {repo} does not match the patched state")
    done = "reverted" if revert else "applied"
    return f"{repo}: {done} {len(patches)} patches on {tag}:\n{series}"


def build_parser() -> argparse.ArgumentParser:
    pins = ", ".join(f"{tag} (commit {commit[:12]})" for tag, commit in PINNED.items())
    parser = argparse.ArgumentParser(
        prog="apply_patches.py",
        description=f"Apply the megatron_dsv patch set to a Megatron-LM checkout at a pinned tag ({pins}), "
                    "or revert it. The tag is read from the checkout's HEAD.",
        epilog="exit codes: 0 done or nothing to do; 1 git failed unexpectedly; 2 bad usage (not a git "
               "work tree, no patches, unknown --tag); 3 wrong Megatron-LM version; 4 dirty tree (tracked files "
               "differ from both the tag and the patched state; listed); 5 the patches do not apply cleanly.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("megatron_lm_dir", metavar="MEGATRON_LM_DIR",
                        help=f"Megatron-LM git clone with one of {', '.join(PINNED)} checked out")
    parser.add_argument("--revert", action="store_true",
                        help="remove the patches (the tree must be exactly in the patched state)")
    parser.add_argument("--check", action="store_true",
                        help="verify version, tree state and 'git apply --check'; change nothing")
    parser.add_argument("--tag", default=None,
                        help=f"insist on this pinned tag (one of {', '.join(PINNED)}; default: the one HEAD is at)")
    parser.add_argument("--patch-dir", default=None,
                        help=f"folder of NNNN-*.patch files (default: {PATCH_ROOT}/<tag>)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(run(args.megatron_lm_dir, revert=args.revert, check=args.check, patch_dir=args.patch_dir,
                  tag=args.tag))
    except ToolError as e:
        print(f"apply_patches.py: error: {e}", file=sys.stderr)
        return e.code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
