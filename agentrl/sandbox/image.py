"""The default sandbox image, built from the host's own Debian Python: no registry is needed.

Training machines often cannot reach an image registry, yet every Debian/Ubuntu host already has
a Python interpreter installed from packages. :func:`build_image` collects the files of those
packages (``dpkg -L``: the interpreter, its standard library, a shell and the basic utilities,
plus every shared library ``ldd`` says they load), adds ``/etc/passwd`` with the sandbox user
(uid 10001) and an empty ``/scratch``, and streams the result as one tar into the engine (the
SDK's equivalent of ``docker import``). It takes a few seconds and yields ~70 MB. The tar is
deterministic (sorted entries, numeric root ownership, the host files' own mtimes so the shipped
``.pyc`` files stay valid); its sha256 is stored in the image label ``agentrl.rootfs.sha256``.

Any other image works as ``SandboxConfig(image=...)`` as long as it has ``/bin/sh``, coreutils
(``sleep``, ``head``, ``rm``, ``chmod``) and ``python3`` (for ``run(code=...)``). The easy way to
add packages is to build on this one, which needs no registry either::

    FROM agentrl-sandbox:py3.11
    COPY wheels/ /opt/wheels/
    ENV PYTHONPATH=/opt/site
    RUN ["python3", "-c", "..."]     # runs as uid 10001; add USER 0 before steps that need root

``docker build -t my-sandbox .`` then ``--sandbox-image my-sandbox``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.sandbox.base import DEFAULT_IMAGE, SandboxError

__all__ = [
    "DEFAULT_IMAGE",
    "SANDBOX_UID",
    "build_image",
    "docker_client",
    "ensure_image",
    "rootfs_paths",
    "write_rootfs",
]

log = logging.getLogger(__name__)

SANDBOX_UID = 10001
"""The numeric uid:gid model-written code runs as (never root; no passwd lookup needed)."""

# Debian packages whose files make the image; {v} is the Python version ("3.11").
PACKAGES = (
    "python{v}-minimal",
    "libpython{v}-minimal",
    "libpython{v}-stdlib",
    "dash",
    "bash",
    "coreutils",
    "grep",
    "sed",
    "findutils",
    "procps",
    "libc6",
    "libgcc-s1",  # libgcc_s.so.1: Rust- and C++-built wheels (pydantic-core, ...) added to derived images load
    "tzdata",
)
# Single files from packages we do not want whole (util-linux is 5 MB of mostly admin tools).
EXTRA_FILES = ("/usr/bin/setsid", "/usr/bin/timeout")
SKIP_PREFIXES = tuple(
    f"/usr/share/{d}/"
    for d in ("doc", "man", "info", "locale", "lintian", "bug", "menu", "bash-completion", "doc-base")
)
_ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", "HOME=/scratch")
RECIPE = hashlib.sha256(repr((PACKAGES, EXTRA_FILES, SKIP_PREFIXES, _ENV, SANDBOX_UID)).encode()).hexdigest()[:16]
"""What the default image is made of, as its label ``agentrl.recipe``: an image an older agentrl built from
another list of packages is rebuilt on first use instead of being used as if it were current."""
_build_lock = threading.Lock()  # a pool's first sandboxes are created in parallel threads: build once


@functools.cache
def docker_client() -> Any:
    """The process's ``docker.DockerClient`` (``DOCKER_HOST`` honoured, so Podman's socket works too)."""
    import docker

    return docker.from_env(max_pool_size=64, timeout=120)


def _client() -> Any:
    return docker_client()


def ensure_image(name: str = DEFAULT_IMAGE) -> str:
    """Return ``name`` once the engine has it; the default image is built on first use.

    Any other missing name raises :class:`SandboxError` (no registry to pull from): build it
    with ``docker build`` (see the module docstring) or use the default. Concurrent callers in
    one process wait for a single build.
    """
    if _exists(name) and (name != DEFAULT_IMAGE or _recipe(name) == RECIPE):
        return name
    if name != DEFAULT_IMAGE:
        raise SandboxError(
            f"sandbox image {name!r} is not in the Docker engine and no registry is reachable: build it with "
            f"`docker build -t {name} .` (FROM {DEFAULT_IMAGE}, made by `agentrl sandbox build`) or use the default"
        )
    with _build_lock:
        return name if _exists(name) and _recipe(name) == RECIPE else build_image(name)


def _recipe(name: str) -> str | None:
    return (_client().images.get(name).labels or {}).get("agentrl.recipe")


def _exists(name: str) -> bool:
    import docker

    try:
        _client().images.get(name)
        return True
    except docker.errors.ImageNotFound:
        return False


def build_image(name: str = DEFAULT_IMAGE, python: str = "/usr/bin/python3.11") -> str:
    """Build ``name`` from the host's Debian ``python`` and its packages (replacing an older one).

    Raises :class:`SandboxError` when the host has no ``dpkg`` or ``python`` is not a Debian
    package's interpreter (a pyenv/conda Python cannot be collected this way).
    """
    t0 = time.monotonic()
    paths = rootfs_paths(python)
    log.info("sandbox image %s: %d files collected from the host's packages", name, len(paths))
    with tempfile.TemporaryFile(prefix="agentrl-rootfs-") as tmp:
        digest = write_rootfs(tmp, paths, python)
        size = tmp.tell()
        tmp.seek(0)
        log.info("sandbox image %s: rootfs %.1f MB (sha256 %s), importing", name, size / 2**20, digest[:12])
        repo, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (name, "", "latest")
        changes = [
            'CMD ["/bin/sh"]',
            f"USER {SANDBOX_UID}:{SANDBOX_UID}",
            "WORKDIR /scratch",
            *(f"ENV {e}" for e in _ENV),
            f"LABEL agentrl.rootfs.sha256={digest} agentrl.recipe={RECIPE}",
        ]
        _client().api.import_image(src=tmp, repository=repo, tag=tag, changes=changes)
    log.info("sandbox image %s built in %.1f s", name, time.monotonic() - t0)
    return name


def _version(python: str) -> str:
    if not Path(python).is_file():
        raise SandboxError(
            f"no Python interpreter at {python}: install one (apt-get install python3.11) "
            "or pass --python /usr/bin/python3.X"
        )
    out = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def _dpkg_list(packages: list[str]) -> list[str]:
    out = subprocess.run(["dpkg", "-L", *packages], capture_output=True, text=True)
    if out.returncode != 0:
        raise SandboxError(
            f"dpkg -L failed ({out.stderr.strip()[:300]}): apt-get install the missing package(s) "
            f"of {' '.join(packages)}, or build a sandbox image another way"
        )
    return [line for line in out.stdout.splitlines() if line.startswith("/")]


def _canonical(path: str) -> str:
    """``/bin/dash`` -> ``/usr/bin/dash`` on merged-/usr hosts (the parent resolved, the name kept)."""
    parent, base = os.path.split(path)
    return os.path.join(os.path.realpath(parent), base)


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _shared_libs(elves: list[str]) -> set[str]:
    """Every library the dynamic loader resolves for ``elves`` (``ldd`` on chunks of 40, in parallel)."""
    libs: set[str] = set()
    procs = [
        subprocess.Popen(["ldd", *elves[i : i + 40]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for i in range(0, len(elves), 40)
    ]
    for proc in procs:
        out, _ = proc.communicate()
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
                libs.add(parts[parts.index("=>") + 1])
            elif parts and parts[0].startswith("/") and line.startswith("\t"):
                libs.add(parts[0])  # the loader itself: /lib64/ld-linux-x86-64.so.2
    return libs


def rootfs_paths(python: str = "/usr/bin/python3.11") -> set[str]:
    """Host paths (files, symlinks, dirs) that make the image: packages + ldd's libraries + .pyc caches."""
    if shutil.which("dpkg") is None:
        raise SandboxError(
            "building the sandbox image needs a Debian/Ubuntu host (dpkg not found); "
            "on other hosts build an image with python3 and /bin/sh and pass its name"
        )
    version = _version(python)
    owner = subprocess.run(["dpkg", "-S", os.path.realpath(python)], capture_output=True, text=True)
    if owner.returncode != 0:
        raise SandboxError(
            f"{python} is not from a Debian package (a pyenv/conda build?): pass "
            f"--python /usr/bin/python{version} after apt-get install python{version}"
        )
    libc = set(_dpkg_list(["libc6"]))  # needs nothing outside itself: spared the slow ldd pass
    wanted = libc | set(_dpkg_list([p.format(v=version) for p in PACKAGES if p != "libc6"]))
    wanted.update(p for p in EXTRA_FILES if os.path.lexists(p))
    wanted = {p for p in wanted if os.path.lexists(p) and not p.startswith(SKIP_PREFIXES)}
    for p in list(wanted):  # the byte-compiled stdlib (made at install time, so not in dpkg's lists)
        if p.endswith(".py"):
            head, tail = os.path.split(p)
            pyc = os.path.join(head, "__pycache__", f"{tail[:-3]}.cpython-{version.replace('.', '')}.pyc")
            if os.path.exists(pyc):
                wanted.add(pyc)
    elves = sorted(p for p in wanted - libc if os.path.isfile(p) and not os.path.islink(p) and _is_elf(p))
    for lib in _shared_libs(elves):
        wanted.update((lib, os.path.realpath(lib)))
    return wanted


def _entries(paths: set[str]) -> dict[str, str]:
    """Map image path -> host path, adding parent dirs and the host's own symlinked dirs (/bin -> usr/bin)."""
    out: dict[str, str] = {}
    for p in paths:
        parts = Path(p).parts
        for i in range(2, len(parts)):  # ancestors that are symlinks on the host (merged /usr)
            anc = os.path.join(*parts[:i])
            if os.path.islink(anc):
                out[anc] = anc
        canon = _canonical(p)
        out[canon] = p
        if os.path.islink(p):
            target = os.path.realpath(p)
            if os.path.exists(target):
                out[_canonical(target)] = target
        parent = os.path.dirname(canon)
        while parent != "/":
            out.setdefault(parent, parent)
            parent = os.path.dirname(parent)
    return out


class _Hashing(io.RawIOBase):
    def __init__(self, f) -> None:
        self.f, self.h = f, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.h.update(b)
        return self.f.write(b)


def _add_text(tar: tarfile.TarFile, name: str, text: str, mode: int = 0o644) -> None:
    data = text.encode()
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
    tar.addfile(info)


def write_rootfs(fileobj, paths: set[str], python: str) -> str:
    """Write the image's root filesystem as a deterministic tar to ``fileobj``; returns its sha256."""
    version = _version(python)
    hashing = _Hashing(fileobj)
    u = SANDBOX_UID
    with tarfile.open(fileobj=hashing, mode="w|", format=tarfile.GNU_FORMAT) as tar:
        fixed = {
            "/proc",
            "/sys",
            "/dev",
            "/etc",
            "/root",
            "/tmp",
            "/scratch",
            "/usr/local/bin",
            "/etc/passwd",
            "/etc/group",
            "/usr/bin/python3",
            "/usr/bin/python",
        }
        for d, mode in (
            ("proc", 0o555),
            ("sys", 0o555),
            ("dev", 0o755),
            ("etc", 0o755),
            ("root", 0o700),
            ("tmp", 0o1777),
            ("scratch", 0o755),
            ("usr/local/bin", 0o755),
        ):
            _add_dir(tar, d, mode)
        _add_text(
            tar,
            "etc/passwd",
            f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{u}:{u}:agentrl sandbox:/scratch:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        )
        _add_text(tar, "etc/group", f"root:x:0:\nsandbox:x:{u}:\nnogroup:x:65534:\n")
        for name, target in (("usr/bin/python3", f"python{version}"), ("usr/bin/python", f"python{version}")):
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)
        for image_path, host_path in sorted(_entries(paths).items()):
            if image_path in fixed:
                continue
            info = tar.gettarinfo(host_path, arcname=image_path.lstrip("/"))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode &= 0o1777 if info.isdir() else 0o777  # no setuid/setgid bits in a sandbox
            if info.isdir():
                info.mtime = 0
                tar.addfile(info)
            elif info.isfile():
                with open(host_path, "rb") as f:
                    tar.addfile(info, f)
            elif info.issym() or info.islnk():
                tar.addfile(info)
    return hashing.h.hexdigest()
