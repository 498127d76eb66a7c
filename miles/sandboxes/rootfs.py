"""Dockerfile -> root template, for the host backends (subprocess, bwrap).

A host sandbox runs on the host's own /usr, so "building the image" means replaying the steps that
shape the sandbox's private tree, once, in a builder sandbox of the same backend, and keeping the
result as a template that each episode copies:

    FROM         ignored: the base system is the host's (or a full-root `rootfs=` directory)
    ARG / ENV    recorded; ENV becomes the template's environment
    WORKDIR      created; the last one becomes the template's default workdir
    COPY / ADD   files from the build context (the Dockerfile's directory) written into the tree;
                 ADD of a local tar archive is extracted (safely); URLs are refused
    RUN          executed in the builder sandbox (same isolation, `network` as in the spec)
    SHELL        changes the shell used by later RUN steps
    USER         ignored (host sandboxes run as root inside bwrap, as their own uid otherwise)
    CMD, ENTRYPOINT, EXPOSE, LABEL, VOLUME, HEALTHCHECK, STOPSIGNAL, MAINTAINER: ignored
    multi-stage builds, COPY --from, heredocs: refused with file:line and the reason

Design decisions:
- The cache key hashes the Dockerfile and every file of the build context, so editing a test
  fixture rebuilds; templates live in base_dir/templates/<key> and survive the process.
- A RUN that needs the system directories writable (apt-get install) fails here with its exit
  code and stderr: such tasks need the docker backend or a prepared full-root `rootfs=`.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import shutil
import tarfile
import time

import msgspec

from miles.sandboxes import dockerfile as df
from miles.sandboxes.base import SandboxSpec, sandbox_path
from miles.sandboxes.hostfs import RESERVED_DIRS, RootTemplate

TEMPLATE_VERSION = "1"
IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "VOLUME", "HEALTHCHECK", "STOPSIGNAL",
           "MAINTAINER", "USER", "ONBUILD"}


def context_files(context: str) -> list[str]:
    """Relative paths of the build context's files, sorted, .dockerignore patterns skipped."""
    import fnmatch
    ignore = []
    ignore_path = os.path.join(context, ".dockerignore")
    if os.path.isfile(ignore_path):
        with open(ignore_path) as f:
            ignore = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    out = []
    for dirpath, dirnames, filenames in os.walk(context):
        dirnames.sort()
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), context)
            if not any(fnmatch.fnmatch(rel, pat) for pat in ignore):
                out.append(rel)
    return out


def template_key(backend_name: str, dockerfile_path: str) -> str:
    h = hashlib.sha256(f"{TEMPLATE_VERSION}\0{backend_name}\0".encode())
    context = os.path.dirname(os.path.abspath(dockerfile_path))
    with open(dockerfile_path, "rb") as f:
        h.update(f.read())
    for rel in context_files(context):
        full = os.path.join(context, rel)
        h.update(f"\0{rel}\0{os.stat(full).st_mode & 0o777}\0".encode())
        with open(full, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:24]


def _context_path(context: str, src: str, where: str) -> str:
    full = os.path.normpath(os.path.join(context, src))
    if full != context and not full.startswith(context + os.sep):
        raise df.DockerfileError(f"{where}: source {src!r} is outside the build context")
    return full


async def _copy_into(sandbox, context: str, sources: list[str], dest: str, workdir: str,
                     ins: df.Instruction, where: str) -> None:
    import glob
    if ins.flags.get("from"):
        raise df.DockerfileError(f"{where}: COPY --from (multi-stage) is not supported by the "
                                 "host backends; use the docker backend")
    if any(s.startswith(("http://", "https://")) for s in sources):
        raise df.DockerfileError(f"{where}: ADD of a URL is not supported (no network at "
                                 "build time); download it into the build context instead")
    mode = int(ins.flags["chmod"], 8) if ins.flags.get("chmod") else None
    matches = []
    for src in sources:
        found = sorted(glob.glob(_context_path(context, src, where)))
        if not found:
            raise df.DockerfileError(f"{where}: source {src!r} not found in the build context "
                                     f"{context}")
        matches += found
    dest_is_dir = dest.endswith("/") or len(matches) > 1 or os.path.isdir(matches[0])
    dest = sandbox_path(dest, workdir, f"{where}: destination")
    for src in matches:
        if ins.cmd == "ADD" and os.path.isfile(src) and tarfile.is_tarfile(src):
            with tarfile.open(src) as tar:
                for member in tar.getmembers():
                    member = tarfile.data_filter(member, "/")  # no absolute/.. /device entries
                    if member.isfile():
                        data = tar.extractfile(member).read()
                        await sandbox.upload(posixpath.join(dest, member.name), data,
                                             member.mode or 0o644)
            continue
        if os.path.isdir(src):
            for dirpath, _, filenames in os.walk(src):
                for name in filenames:
                    full = os.path.join(dirpath, name)
                    rel = os.path.relpath(full, src)
                    await _upload_file(sandbox, full, posixpath.join(dest, rel), mode)
        else:
            target = posixpath.join(dest, os.path.basename(src)) if dest_is_dir else dest
            await _upload_file(sandbox, src, target, mode)


async def _upload_file(sandbox, src: str, target: str, mode: int | None) -> None:
    with open(src, "rb") as f:
        data = f.read()
    await sandbox.upload(target, data, mode if mode is not None else os.stat(src).st_mode & 0o777)


async def build_template(backend, spec: SandboxSpec, key: str) -> RootTemplate:
    """Replay spec.dockerfile in a builder sandbox of `backend`; cache under base_dir/templates."""
    path = os.path.abspath(spec.dockerfile)
    if not os.path.isfile(path):
        raise df.DockerfileError(f"SandboxSpec.dockerfile={spec.dockerfile!r}: no such file")
    store = os.path.join(backend.base_dir, "templates")
    target, record = os.path.join(store, key), os.path.join(store, key + ".json")
    if os.path.isfile(record) and os.path.isdir(target):
        with open(record, "rb") as f:
            return msgspec.json.decode(f.read(), type=RootTemplate)
    os.makedirs(store, exist_ok=True)
    context = os.path.dirname(path)
    with open(path) as f:
        steps = df.parse(f.read(), path)
    builder = await backend.create(SandboxSpec(
        cpu=spec.cpu, memory_mb=spec.memory_mb, disk_mb=spec.disk_mb,
        max_processes=spec.max_processes, network=spec.network,
        ttl_s=backend.build_timeout_s + 60, labels={"miles.build": key}))
    workdir, env, args, shell = "/", {}, {}, ["/bin/sh", "-c"]
    try:
        froms = 0
        for ins in steps:
            where = f"{path}:{ins.line}"
            if "<<" in ins.args and ins.cmd in ("RUN", "COPY", "ADD"):
                raise df.DockerfileError(f"{where}: heredocs are not supported by the host "
                                         "backends")
            variables = {**args, **env}
            if ins.cmd == "FROM":
                froms += 1
                if froms > 1:
                    raise df.DockerfileError(f"{where}: multi-stage builds are not supported "
                                             "by the host backends; use the docker backend")
            elif ins.cmd == "ARG":
                for k, v in df.parse_env(ins, variables, path).items():
                    args.setdefault(k, v)
            elif ins.cmd == "ENV":
                env.update(df.parse_env(ins, variables, path))
            elif ins.cmd == "WORKDIR":
                workdir = sandbox_path(df.substitute(ins.args, variables), workdir,
                                       f"{where}: WORKDIR")
                builder.ensure_dir(workdir)
            elif ins.cmd in ("COPY", "ADD"):
                sources, dest = df.copy_operands(ins, variables, path)
                await _copy_into(builder, context, sources, dest, workdir, ins, where)
            elif ins.cmd == "SHELL":
                if ins.json_args is None:
                    raise df.DockerfileError(f"{where}: SHELL needs the JSON form")
                shell = ins.json_args
            elif ins.cmd == "RUN":
                argv = ins.json_args if ins.json_args is not None else [*shell, ins.args]
                r = await builder.exec(argv, cwd=workdir, env={**args, **env},
                                       timeout_s=backend.build_timeout_s)
                if not r.ok:
                    why = "timed out" if r.timed_out else f"exited {r.exit_code}"
                    raise df.DockerfileError(
                        f"{where}: RUN {ins.args[:120]!r} {why} under backend {backend.name}: "
                        f"{(r.stderr or r.stdout)[-600:].strip()}")
            elif ins.cmd not in IGNORED:
                raise df.DockerfileError(f"{where}: unknown instruction {ins.cmd}")
        staging = f"{target}.tmp-{os.getpid()}-{int(time.time() * 1e6)}"
        os.mkdir(staging, 0o755)
        for name in os.listdir(builder.root):
            if name in RESERVED_DIRS or name in ("tmp",):
                continue
            src = os.path.join(builder.root, name)
            if os.path.islink(src):
                os.symlink(os.readlink(src), os.path.join(staging, name))
            elif os.path.isdir(src):
                shutil.copytree(src, os.path.join(staging, name), symlinks=True)
            else:
                shutil.copy2(src, os.path.join(staging, name), follow_symlinks=False)
        try:
            os.rename(staging, target)
        except OSError:  # another process built the same key first: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        await builder.destroy()
    template = RootTemplate(path=target, workdir=None if workdir == "/" else workdir, env=env)
    if not os.path.isfile(record):
        with open(record + ".tmp", "wb") as f:
            f.write(msgspec.json.encode(template))
        os.replace(record + ".tmp", record)
    return template


def tar_bytes(files: dict[str, bytes]) -> bytes:
    """A tar archive of {relative path: content} (used by tests and the docker backend)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
