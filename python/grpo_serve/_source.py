"""The digest of the sources a grpo_serve build is made from: python/ and proto/.

One definition for the three places that compare it: the build (setup.py writes it into the
installed package as ``grpo_serve._build_info.SOURCE_DIGEST``), ``deploy/setup.sh`` (reinstalls
when the tree's digest differs from the installed one) and the tests (they fail when the venv's
package was built from other sources than the tree under test).

Runs as a script without the package being importable: ``python _source.py REPO_ROOT`` prints
the digest. Standard library only.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

# What a build reads, relative to the repository root.
_PACKAGE_DIR = "python/grpo_serve"
_BUILD_FILES = ("python/pyproject.toml", "python/setup.py")
_PROTO_DIR = "proto"
_PACKAGE_SUFFIXES = (".py", ".typed")
_SKIPPED_DIRS = {"__pycache__", "_proto"}


def source_files(root: Path) -> list[str]:
    """The files a build reads, as sorted POSIX paths relative to `root`."""
    out: list[str] = [f for f in _BUILD_FILES if (root / f).is_file()]
    for top, suffixes in ((_PACKAGE_DIR, _PACKAGE_SUFFIXES), (_PROTO_DIR, (".proto",))):
        for dirpath, dirnames, filenames in os.walk(root / top):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
            for name in filenames:
                if name.endswith(suffixes) and name != "_build_info.py":
                    out.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(out)


def source_digest(root: Path) -> str:
    """SHA-256 over each source file's path and content hash (hex)."""
    outer = hashlib.sha256()
    for rel in source_files(root):
        inner = hashlib.sha256((root / rel).read_bytes()).hexdigest()
        outer.update(f"{inner}  {rel}\n".encode())
    return outer.hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: _source.py REPO_ROOT")
    print(source_digest(Path(sys.argv[1]).resolve()))
