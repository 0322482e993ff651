"""MCP tools whose stdio server runs inside each episode's Docker sandbox (``mcp_tools(sandboxed=True)``):
the sandbox image gains the host's ``mcp`` and the demo server; each episode gets its own container,
its own server process, and a clean sandbox back."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from agentrl.mcp import MCPToolEnv, mcp_tools  # noqa: E402
from agentrl.rollout.scripted import play  # noqa: E402
from agentrl.sandbox import SandboxConfig, SandboxPool, create_sandbox  # noqa: E402
from tests.mcp_servers.support import SERVER, call, scripted  # noqa: E402


def _dists(name: str) -> dict[str, importlib.metadata.Distribution]:
    """``name`` and every distribution it needs (extras off), as installed here."""
    from packaging.requirements import Requirement

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [(name, ("",))]
    while todo:
        dist_name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", dist_name).lower()
        if key in found:
            continue
        dist = found[key] = importlib.metadata.distribution(dist_name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
                todo.append((req.name, ("", *req.extras)))
    return found


_GLIBC = re.compile(r"(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux[^.]*)\.so")


def _copy_shared_libraries(site: Path, dest: Path) -> None:
    """The host libraries the compiled modules load that the image lacks (glibc it has): libgcc_s for
    the Rust-built ones (pydantic-core, rpds-py, cryptography)."""
    dest.mkdir()
    for module in site.rglob("*.so"):
        out = subprocess.run(["ldd", str(module)], capture_output=True, text=True).stdout
        for name, path in re.findall(r"^\s*(\S+) => (/\S+)", out, re.M):
            if not _GLIBC.match(name) and not (dest / name).exists():
                shutil.copy2(path, dest / name)


@pytest.fixture(scope="session")
def mcp_sandbox_image(docker_image, tmp_path_factory):
    """The sandbox image plus the host's ``mcp`` and its dependencies (/opt/site) and the demo server
    (/opt/demo_server.py). The host's Python is 3.11 like the image's Debian one (same ABI, same libc),
    so the installed files are copied as they are: no registry. Tagged by content: built once."""
    import docker

    from agentrl.sandbox.docker import docker_client

    client = docker_client()
    dists = _dists("mcp")
    dockerfile = (
        f"FROM {docker_image}\nCOPY site/ /opt/site/\nCOPY lib/ /opt/lib/\nCOPY demo_server.py /opt/demo_server.py\n"
        "ENV PYTHONPATH=/opt/site LD_LIBRARY_PATH=/opt/lib\n# bytecode: unchecked-hash\n"
    )
    digest = hashlib.sha256((client.images.get(docker_image).id + dockerfile).encode())
    digest.update(Path(SERVER).read_bytes())
    for key in sorted(dists):
        digest.update(f"{key}=={dists[key].version};".encode())
    tag = f"agentrl-test-mcp:{digest.hexdigest()[:12]}"
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    t0 = time.monotonic()
    ctx = tmp_path_factory.mktemp("mcp-image")
    for dist in dists.values():
        for f in dist.files or []:
            src = Path(str(dist.locate_file(f)))
            if f.parts[0] != ".." and "__pycache__" not in f.parts and src.is_file():
                (ctx / "site" / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, ctx / "site" / f)
    _copy_shared_libraries(ctx / "site", ctx / "lib")
    # compiled now (3.11 bytecode is the image's too): the read-only image could not cache it, and
    # every server start would compile mcp again (~2 s)
    compile_ = [sys.executable, "-m", "compileall", "-q", "-j0", "--invalidation-mode", "unchecked-hash"]
    subprocess.run([*compile_, str(ctx / "site")], check=True, stdout=subprocess.DEVNULL)
    shutil.copy2(SERVER, ctx / "demo_server.py")
    (ctx / "Dockerfile").write_text(dockerfile)
    client.images.build(path=str(ctx), tag=tag, rm=True, forcerm=True)
    print(f"built {tag} in {time.monotonic() - t0:.1f}s")
    return tag


SANDBOXED_TOOLS = ["add", "read_note", "crash", "bump", "where", "save"]


def _sandboxed_env(image: str) -> type[MCPToolEnv]:
    config = SandboxConfig(backend="docker", image=image, timeout=30.0)

    class SandboxedEnv(MCPToolEnv):
        tools = mcp_tools(
            ["python3", "/opt/demo_server.py"], sandboxed=True, sandbox_config=config, include=SANDBOXED_TOOLS
        )
        sandbox_pool = SandboxPool(lambda: create_sandbox(config), config)

        def reward(self, action):
            return float(action.text.strip() == "done")

    return SandboxedEnv


async def _ps(sandbox) -> str:
    return (await sandbox.run(["ps", "-eo", "args"])).stdout


@pytest.mark.docker
async def test_a_sandboxed_server_runs_in_the_episodes_container(mcp_sandbox_image):
    env_class = _sandboxed_env(mcp_sandbox_image)
    assert [t.name for t in env_class.tools] == SANDBOXED_TOOLS  # listed in a sandbox
    config = SandboxConfig(backend="docker", image=mcp_sandbox_image, timeout=30.0)
    with pytest.raises(ValueError, match=r"\['box'\] .* take an argument called 'sandbox'"):
        mcp_tools(["python3", "/opt/demo_server.py"], sandboxed=True, sandbox_config=config)
    assert all(t.sandboxed for t in env_class.tools)
    a, b = env_class(), env_class()
    try:
        await asyncio.gather(a.reset(options={"prompt": "x"}), b.reset(options={"prompt": "y"}))
        box_a, box_b = await a.sandbox(), await b.sandbox()
        assert box_a is not box_b
        host, cwd = (await call(a.tools, "where", sandbox=box_a)).content.split()
        assert cwd == "/scratch" and host != socket.gethostname()
        assert host == (await box_a.run(code="import socket; print(socket.gethostname())")).stdout.strip()
        saved = await call(a.tools, "save", {"name": "note.txt", "text": "hello"}, sandbox=box_a)
        assert saved.content == "/scratch/note.txt"
        assert (await box_a.run(["cat", "note.txt"])).stdout == "hello"
        assert (await box_b.run(["ls", "-A"])).stdout == ""  # another episode, another container
        assert [(await call(a.tools, "bump", sandbox=box_a)).content for _ in range(2)] == ["1", "2"]
        assert (await call(b.tools, "bump", sandbox=box_b)).content == "1"
        assert (await call(a.tools, "add", {"a": 2, "b": 3}, sandbox=box_a)).content == "5"
        assert "/opt/demo_server.py" in await _ps(box_a)
    finally:
        await a.close()
        await b.close()
    again = await env_class.sandbox_pool.acquire()  # the released sandbox, reset: no server left in it
    try:
        assert again in (box_a, box_b) and "demo_server" not in await _ps(again)
    finally:
        await env_class.sandbox_pool.release(again)
        await env_class.sandbox_pool.close()


@pytest.mark.docker
async def test_an_episode_with_a_sandboxed_server(mcp_sandbox_image):
    env_class = _sandboxed_env(mcp_sandbox_image)
    policy = scripted([("save", {"name": "a.txt", "text": "x"}), ("where", {}), (None, "done")])
    try:
        [result] = await play(env_class, policy, [{"prompt": "save a note"}])
    finally:
        await env_class.sandbox_pool.close()
    assert result.error is None and result.reward == 1.0, result.error
    saved, where = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert saved == "/scratch/a.txt" and where.endswith(" /scratch")
