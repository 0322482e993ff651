"""Hostile ``/update_weights_from_tensor`` payloads against a real engine server on loopback.

Each payload is a pickle in SGLang's wire shape (torch's rebuild functions, ForkingPickler's layout)
written by hand, as an attacker who can reach the port would. The engine must read only memory the
run's trainer wrote (files of its private ``--weight-ipc-dir``), check every view before reading a
byte, and never unlink, map or connect to anything a payload names.
"""

from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from torch.multiprocessing import reductions as R

from agentrl.engines.tensor_ipc import (
    FlattenedTensorMetadata,
    IpcFolder,
    Receiver,
    TensorStash,
    deserialize_named_tensors,
    serialize_named_tensors,
)

pytestmark = pytest.mark.e2e
GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


class _Call:
    """Pickles as ``fn(*args)``: any call an attacker can write into a pickle."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def file_storage(handle: str | bytes, nbytes: int, manager: bytes = b"") -> _Call:
    """torch's ``file_system`` storage: a shared-memory name (and, optionally, a torch_shm_manager socket)."""
    return _Call(R.rebuild_storage_filename, torch.UntypedStorage, manager, handle, nbytes)


def tensor(storage, dtype: torch.dtype, size, stride, offset: int = 0) -> _Call:
    typed = _Call(R.rebuild_typed_storage, storage, dtype)
    return _Call(R.rebuild_tensor, torch.Tensor, typed, (offset, torch.Size(size), tuple(stride), False))


def payload(obj) -> str:
    return base64.b64encode(pickle.dumps(obj, protocol=4)).decode()


def post(url: str, entry: str, load_format: str | None = None, timeout: float = 60) -> httpx.Response:
    body = {"serialized_named_tensors": [entry], **({"load_format": load_format} if load_format else {})}
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=timeout)


def greedy(url: str) -> list[int]:
    r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2, 3, 4], "sampling_params": GREEDY}, timeout=60)
    r.raise_for_status()
    return r.json()["output_ids"]


def peak_rss_mb(url: str) -> float:
    """The server process's peak resident memory (VmHWM), found by its port on the command line."""
    port = url.rsplit(":", 1)[1]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if b"serve" in cmd and b"--port" in cmd and cmd[cmd.index(b"--port") + 1] == port.encode():
            return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024
    raise AssertionError(f"no server process for {url}")


@pytest.fixture(scope="module")
def model(tiny_ckpt) -> dict:
    from safetensors.torch import load_file

    weights = load_file(str(tiny_ckpt / "model.safetensors"))
    return {"hidden": weights["model.norm.weight"].numel(), "bytes": sum(t.nbytes for t in weights.values())}


@pytest.fixture(scope="module")
def plain_server(tiny_ckpt, tmp_path_factory):
    """``agentrl serve`` alone: no private weight folder."""
    from agentrl.engines.local.process import local_server

    log = tmp_path_factory.mktemp("logs") / "plain.log"
    with local_server(tiny_ckpt, log_path=log, startup_timeout=120) as url:
        yield url


@pytest.fixture(scope="module")
def folder():
    f = IpcFolder.create()
    yield f
    f.remove()


@pytest.fixture(scope="module")
def folder_server(tiny_ckpt, tmp_path_factory, folder):
    """``agentrl serve --weight-ipc-dir``: CPU handles accepted from that folder only."""
    from agentrl.engines.local.process import local_server

    log = tmp_path_factory.mktemp("logs") / "folder.log"
    with local_server(
        tiny_ckpt, log_path=log, startup_timeout=120, extra_args=["--weight-ipc-dir", str(folder.path)]
    ) as url:
        yield url


@pytest.fixture
def victim():
    """A /dev/shm file some other process made (random floats: loaded as a norm weight it changes greedy output)."""
    path = Path("/dev/shm") / f"victim-{uuid.uuid4().hex}"
    data = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).mul_(5).numpy().tobytes()
    path.write_bytes(data)
    yield path, data
    path.unlink(missing_ok=True)


def _victim_payload(victim, hidden: int, **kw) -> str:
    path, _ = victim
    storage = file_storage(kw.pop("handle", "/" + path.name).encode(), hidden * 4, **kw)
    return payload([("model.norm.weight", tensor(storage, torch.float32, [hidden], [1]))])


def test_a_shm_file_the_client_did_not_create_is_never_read_nor_deleted(tiny_ckpt, model, victim, tmp_path):
    """Before: the engine loaded the victim's bytes into model.norm.weight and deleted the file when it exited."""
    from agentrl.engines.local.process import local_server

    path, data = victim
    with local_server(tiny_ckpt, log_path=tmp_path / "engine.log", startup_timeout=120) as url:
        before = greedy(url)
        r = post(url, _victim_payload(victim, model["hidden"]))
        assert r.status_code == 400 and "could not read" in r.json()["message"], r.text
        assert "--weight-ipc-dir" in r.json()["message"] and "/update_weights_from_disk" in r.json()["message"]
        assert greedy(url) == before
    assert path.read_bytes() == data  # still there, unchanged, after the engine exited


def test_no_path_outside_the_private_folder_resolves(folder_server, folder, model, victim):
    path, data = victim
    link = folder.path / "link"
    link.symlink_to(path)  # only the folder's owner could do this; still not followed
    try:
        before = greedy(folder_server)
        for handle in ("/" + path.name, str(path), f"../{path.name}", "link", "missing"):
            r = post(folder_server, _victim_payload(victim, model["hidden"], handle=handle))
            assert r.status_code == 400 and "weight folder" in r.json()["message"], (handle, r.text)
        assert greedy(folder_server) == before
    finally:
        link.unlink()
    assert path.read_bytes() == data


def test_the_manager_socket_a_payload_names_is_never_connected(plain_server, model, victim, tmp_path):
    """Before: torch's rebuild_storage_filename dialled the client-chosen torch_shm_manager socket."""
    sock_path = tmp_path / "manager.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(8)
    listener.setblocking(False)
    try:
        try:
            entry = _victim_payload(victim, model["hidden"], manager=str(sock_path).encode())
            r = post(plain_server, entry, timeout=15)
        except httpx.TimeoutException:
            r = None  # torch waiting on our silent "manager": it connected
        with pytest.raises(BlockingIOError):
            listener.accept()[0].close()  # a connection waiting here means the engine dialled it
        assert r is not None and r.status_code == 400, r and r.text
    finally:
        listener.close()


@pytest.mark.parametrize(
    "size, stride, offset, storage",
    [
        ("H", [1], 0, "empty"),  # an empty (growable) storage: torch grew it, uninitialised heap bytes became weights
        ("H+8", [1], 0, "H"),  # size past a file's storage
        ("H", [1], 8, "H"),  # offset past it
        ("H", [2], 0, "H"),  # stride past it
    ],
)
def test_views_past_their_storage_are_refused_before_reading(
    plain_server, model, victim, size, stride, offset, storage
):
    h = model["hidden"]
    n = {"H": h, "H+8": h + 8}
    path, data = victim
    store = _Call(R.rebuild_storage_empty, torch.UntypedStorage) if storage == "empty" else None
    store = store or file_storage(("/" + path.name).encode(), n[storage] * 4)
    entry = payload([("model.norm.weight", tensor(store, torch.float32, [n[size]], stride, offset))])
    before = greedy(plain_server)
    r = post(plain_server, entry)
    assert r.status_code == 400 and "reach byte" in r.json()["message"], r.text
    assert greedy(plain_server) == before and path.read_bytes() == data


def test_a_stride_0_bucket_allocates_nothing(plain_server, victim):
    """Before: this 471-byte flattened_bucket made the engine allocate +512 MiB (cloning a stride-0 view)."""
    path, _ = victim
    n = 1 << 29
    flat = tensor(file_storage(("/" + path.name).encode(), 1), torch.uint8, [n + 1], [0])
    meta = [FlattenedTensorMetadata("model.norm.weight", torch.Size([n // 4]), torch.float32, 1, n + 1, n // 4)]
    entry = payload({"flattened_tensor": flat, "metadata": meta})
    assert len(base64.b64decode(entry)) < 1000
    peak = peak_rss_mb(plain_server)
    r = post(plain_server, entry, "flattened_bucket")
    assert peak_rss_mb(plain_server) - peak < 64, r.text
    assert r.status_code == 400 and "more than once" in r.json()["message"], r.text


def test_more_bytes_than_the_model_holds_are_refused(plain_server, model, tmp_path):
    """An in-bounds view of a storage larger than the whole model: the cap refuses it before it is read."""
    big = Path("/dev/shm") / f"big-{uuid.uuid4().hex}"
    nbytes = model["bytes"] + (1 << 20)
    with open(big, "wb") as f:
        f.truncate(nbytes)
    try:
        storage = file_storage(("/" + big.name).encode(), nbytes)
        entry = payload([("model.norm.weight", tensor(storage, torch.float32, [model["hidden"]], [1]))])
        r = post(plain_server, entry)
        assert r.status_code == 400 and "reads at most" in r.json()["message"], r.text
        assert big.stat().st_size == nbytes
    finally:
        big.unlink(missing_ok=True)


@pytest.mark.parametrize("dtype, extra", [(torch.float16, 0), (torch.float32, 1)])
def test_dtype_and_shape_must_match_the_parameter(plain_server, model, dtype, extra):
    """Before: a float16 tensor was silently converted into the float32 norm weight."""
    h = model["hidden"] + extra
    path = Path("/dev/shm") / f"half-{uuid.uuid4().hex}"
    path.write_bytes(torch.full((h,), 0.5, dtype=dtype).numpy().tobytes())
    try:
        storage = file_storage(("/" + path.name).encode(), h * dtype.itemsize)
        r = post(plain_server, payload([("model.norm.weight", tensor(storage, dtype, [h], [1]))]))
        assert r.status_code == 400 and "the model's is torch.float32" in r.json()["message"], r.text
    finally:
        path.unlink(missing_ok=True)


def test_the_folder_must_be_private(tmp_path, tiny_ckpt):
    """A folder other users can write into (or a symlink to one) is refused before the model loads."""
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(open_dir)
    for d, message in ((open_dir, "chmod 700"), (link, "not a directory"), (tmp_path / "none", "create it")):
        cmd = [sys.executable, "-m", "agentrl", "serve", "--hf-checkpoint", str(tiny_ckpt), "--weight-ipc-dir", str(d)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr, r.stderr


def test_a_legit_stash_reaches_only_an_engine_with_the_folder(plain_server, folder_server, folder, model):
    weights = {"model.norm.weight": torch.full((model["hidden"],), 1.0)}
    with TensorStash(folder) as stash:
        entry = serialize_named_tensors(weights.items(), stash)
        r = post(plain_server, entry)
        assert r.status_code == 400 and "--weight-ipc-dir" in r.json()["message"], r.text
        files = sorted(folder.path.iterdir())
        assert post(folder_server, entry).status_code == 200
        assert sorted(folder.path.iterdir()) == files  # the engine deleted nothing


# ------------------------------------------------------------------------------- without a server


def _cuda(dtype=torch.float32, size=(4,), stride=(1,), offset=0, storage_bytes=16, counter=b"/torch_1_2_3"):
    args = (torch.Tensor, torch.Size(size), stride, offset, torch.storage.TypedStorage, dtype, 0, b"h" * 64)
    return _Call(R.rebuild_cuda_tensor, *args, storage_bytes, 0, False, counter, 0, b"e" * 64, True)


def test_cuda_handles_are_checked_before_torch_maps_them():
    cpu = Receiver(params=None, max_bytes=1 << 20)
    with pytest.raises(ValueError, match="CUDA IPC handle, but this engine runs on cpu"):
        deserialize_named_tensors(payload([("w", _cuda())]), cpu)
    bare = Receiver(params=None, max_bytes=1 << 20, device=torch.device("cuda", 0))  # no --weight-ipc-dir
    with pytest.raises(ValueError, match="started without --weight-ipc-dir"):
        deserialize_named_tensors(payload([("w", _cuda())]), bare)
    folder = IpcFolder.create()  # the run's opt-in to colocated sync
    gpu = Receiver(params=None, max_bytes=1 << 20, device=torch.device("cuda", 0), folder=folder)
    try:
        _check_cuda_views(gpu, folder)
    finally:
        folder.remove()


def _check_cuda_views(gpu: Receiver, folder: IpcFolder) -> None:
    with pytest.raises(ValueError, match="reach byte 32 of a 16-byte storage"):
        deserialize_named_tensors(payload([("w", _cuda(size=(8,)))]), gpu)
    with pytest.raises(ValueError, match="more than once"):
        deserialize_named_tensors(payload([("w", _cuda(size=(4, 4), stride=(0, 1)))]), gpu)
    with pytest.raises(ValueError, match="reads at most 8"):
        deserialize_named_tensors(payload([("w", _cuda())]), Receiver(None, 8, torch.device("cuda", 0), folder))
    for counter in (b"/victim", b"../../etc/passwd", b"/torch_1_2_3"):  # torch maps (and may unlink) this file
        with pytest.raises(ValueError, match="reference counter"):
            deserialize_named_tensors(payload([("w", _cuda(counter=counter))]), gpu)


@pytest.mark.parametrize(
    "obj, message",
    [
        (_Call(torch.Tensor, 1 << 40), "not a tensor payload"),  # classes are names, never called
        (_Call(torch.UntypedStorage, 1 << 40), "not a tensor payload"),
        ([("w", tensor(file_storage(b"x", 16), torch.float32, [4], [1])), ("w", 1)], "pairs"),
        ([("w", tensor(file_storage(b"x", 16), torch.float32, [4], [1]))] * 2, "names a tensor twice"),
        ([("w", tensor(file_storage(b"x", 16), torch.float32, [2, 2], [1, 1]))], "more than once"),
        ([("w", tensor(file_storage(b"x", 16), torch.float32, [-1], [1]))], "non-negative integer"),
    ],
)
def test_malformed_descriptions_are_refused(obj, message):
    with pytest.raises(ValueError, match=message):
        deserialize_named_tensors(payload(obj), Receiver(params=None, max_bytes=1 << 20))
