"""An offline base image for the docker backend, made from the host's own binaries.

Nothing can be pulled where we train, so `FROM debian:...` has nothing to start from. This builds
a small root filesystem from host files instead: a shell, bash, coreutils, grep/sed/find/tar, and
(optionally) the host's python3 with its standard library, each binary with the shared libraries
`ldd` reports; then `docker import`s it. Task Dockerfiles are pointed at it through the docker
backend's `base_image_map` / `fallback_base_image`.

Design decisions:
- The image tag carries a hash of the file list with sizes and mtimes, so a host upgrade gives a
  new tag instead of a stale image, and an existing tag is reused without rebuilding.
- /bin, /lib, /lib64, /sbin are symlinks into /usr (merged /usr), whatever the host does.
- Files are taken from the host as they are; this is a convenience for offline tests and
  development machines, not a hardened image. Real clusters use real task images.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile

TOOLS = ("sh", "bash", "env", "cat", "echo", "ls", "mkdir", "rm", "rmdir", "cp", "mv", "ln",
         "sleep", "timeout", "dd", "head", "tail", "wc", "id", "true", "false", "test", "chmod",
         "touch", "sort", "uniq", "tr", "cut", "seq", "yes", "printf", "basename", "dirname",
         "pwd", "uname", "stat", "tee", "date", "readlink", "grep", "sed", "find", "xargs", "tar",
         "gzip", "kill", "diff", "cmp", "expr", "realpath", "mktemp", "nproc", "du", "df")
REPO = "miles-sandbox-base"
_LIB = re.compile(r"(/\S+\.so[^\s]*)")


def _libs(binaries: list[str]) -> list[str]:
    """Shared libraries of all `binaries`, from one `ldd` call."""
    try:
        out = subprocess.run(["ldd", *binaries], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({m for m in _LIB.findall(out) if os.path.exists(m) and not m.endswith(":")})


def _python_files() -> tuple[str, str, list[str]] | None:
    """(python binary, stdlib dir, extension modules) of the host's system python3, if any."""
    py = shutil.which("python3", path="/usr/bin:/bin")
    if py is None:
        return None
    try:
        out = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                        "['stdlib'])"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not out or not os.path.isdir(out):
        return None
    ext = []
    for dirpath, _, filenames in os.walk(os.path.join(out, "lib-dynload")):
        ext += [os.path.join(dirpath, f) for f in filenames if f.endswith(".so")]
    return os.path.realpath(py), out, ext


@functools.lru_cache(maxsize=2)
def plan(include_python: bool = True) -> dict[str, str]:
    """{path in image: host path} of every file the image gets."""
    files: dict[str, str] = {}
    binaries: list[str] = []

    def add(host: str, image_path: str | None = None) -> None:
        real = os.path.realpath(host)
        files[_merged(image_path or host)] = real
        binaries.append(real)

    for tool in TOOLS:
        found = shutil.which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if found:
            add(found, "/usr/bin/" + tool)
    if include_python:
        py = _python_files()
        if py is not None:
            binary, stdlib, exts = py
            add(binary, "/usr/bin/python3")
            for ext in exts:
                add(ext)
            skip = {"test", "__pycache__", "site-packages", "dist-packages", "idlelib",
                    "tkinter", "turtledemo", "ensurepip", "lib2to3"}
            for dirpath, dirnames, filenames in os.walk(stdlib):
                dirnames[:] = [d for d in dirnames if d not in skip]
                for name in filenames:
                    if not name.endswith(".so"):
                        full = os.path.join(dirpath, name)
                        files[_merged(full)] = full
    for lib in _libs(binaries):
        files[_merged(lib)] = os.path.realpath(lib)
    return files


def _merged(path: str) -> str:
    """Map /bin, /lib, /lib64, /sbin paths into /usr, as a merged-/usr image lays them out."""
    path = os.path.normpath(path)
    for top in ("/bin/", "/lib/", "/lib64/", "/sbin/"):
        if path.startswith(top):
            return "/usr" + path
    return path


def image_tag(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for dst, src in sorted(files.items()):
        st = os.stat(src)
        h.update(f"{dst}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
    return f"{REPO}:{h.hexdigest()[:16]}"


def rootfs_tar(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def directory(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def text(name: str, content: str) -> None:
            data = content.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        for d in ("usr", "usr/bin", "usr/lib", "usr/lib64", "usr/sbin", "etc", "root", "proc",
                  "dev", "sys", "var", "var/tmp", "home", "workspace"):
            directory(d)
        directory("tmp", 0o1777)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"),
                             ("sbin", "usr/sbin")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        text("etc/passwd", "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/:/bin/sh\n")
        text("etc/group", "root:x:0:\nnogroup:x:65534:\n")
        text("etc/hostname", "sandbox\n")
        for dst, src in sorted(files.items()):
            tar.add(src, arcname=dst.lstrip("/"), recursive=False)
    return buf.getvalue()


def write_rootfs(dest: str, include_python: bool = False) -> str:
    """The same tree as a directory: a full root usable as SandboxSpec.rootfs by the host
    backends (their commands then run on its /usr instead of the host's)."""
    with tarfile.open(fileobj=io.BytesIO(rootfs_tar(plan(include_python)))) as tar:
        tar.extractall(dest, filter="tar")
    return dest


async def ensure_base_image(api, include_python: bool = True) -> str:
    """Import the base image unless a tag for exactly these host files exists; return the tag."""
    files = plan(include_python)
    tag = image_tag(files)
    if await api.image_config(tag) is None:
        repo, _, version = tag.partition(":")
        await api.import_image(rootfs_tar(files), repo, version)
    return tag
