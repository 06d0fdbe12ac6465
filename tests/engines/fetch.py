"""Fetch the pinned engine releases the engine tests run against, into an ignored cache.

    python tests/engines/fetch.py [sglang|vllm|all]      (make engines / make engines-vllm)

Each release is downloaded with ``pip download --no-deps`` and only its Python sources are unpacked to
``.engines/<name>-<version>/`` (``GUARDLINT_ENGINES`` moves the cache). Nothing of them is committed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GUARDLINT_ENGINES", ROOT / ".engines"))

# name -> (package, version, kind): a wheel is fetched as a binary, an sdist as source.
RELEASES = {
    "sglang-0.5.23": ("sglang", "0.5.23", "wheel"),
    "sglang-0.5.10.post1": ("sglang", "0.5.10.post1", "sdist"),
    "vllm-0.33.0": ("vllm", "0.33.0", "wheel"),
}
GROUPS = {"sglang": ("sglang-0.5.23", "sglang-0.5.10.post1"), "vllm": ("vllm-0.33.0",)}
GROUPS["all"] = GROUPS["sglang"] + GROUPS["vllm"]


def release_dir(name: str) -> Path:
    """The unpacked sources of one release (``<dir>/sglang/...``); exists once fetched."""
    return CACHE / name


def _unpack(archive: Path, package: str, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                if member.startswith(package + "/") and member.endswith(".py"):
                    zf.extract(member, tmp)
    else:
        with tarfile.open(archive) as tf:
            prefix = None
            for member in tf.getmembers():
                parts = member.name.split("/")
                if len(parts) > 2 and parts[1] == package and member.isfile() and member.name.endswith(".py"):
                    prefix = parts[0]
                    member.name = "/".join(parts[1:])
                    if hasattr(tarfile, "data_filter"):
                        tf.extract(member, tmp, filter="data")
                    else:
                        tf.extract(member, tmp)
            if prefix is None:
                raise SystemExit(f"{archive.name}: no {package}/ sources inside")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)  # only a complete tree ever has the final name


def fetch(name: str) -> Path:
    dest = release_dir(name)
    if (dest / RELEASES[name][0]).is_dir():
        return dest
    package, version, kind = RELEASES[name]
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        binary = ["--only-binary=:all:"] if kind == "wheel" else ["--no-binary=:all:"]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *binary, "-d", tmp,
               f"{package}=={version}"]
        print(f"fetching {package}=={version} ({kind}) ...", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
        archive = next(Path(tmp).iterdir())
        _unpack(archive, package, dest)
    return dest


def main(argv: list) -> int:
    group = argv[1] if len(argv) > 1 else "sglang"
    if group not in GROUPS:
        print(f"usage: fetch.py [{'|'.join(GROUPS)}]", file=sys.stderr)
        return 2
    for name in GROUPS[group]:
        print(f"{name}: {fetch(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
