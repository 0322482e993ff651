"""The embedded engine bounds what a client can make it wait on (issue 38, item 3).

``/init_weights_update_group`` dials whatever address the body names: one rendezvous at a time, a
deadline (``--dist-timeout``) that holds even against a peer that accepts and then says nothing,
and at most ``MAX_GROUPS`` groups. SIGTERM stops ``agentrl serve`` within seconds whatever is in
flight. ``/update_weights_from_disk`` reads only regular files, within a deadline: a FIFO named
``x.safetensors`` used to block the engine for good (the reader held the GIL while opening it).

Real servers on loopback: an in-process uvicorn where threads are counted, a real ``agentrl serve``
process where the server could freeze or must be signalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from agentrl.engines.local import LocalEngine, build_app
from agentrl.engines.local.distributed import MAX_GROUPS
from agentrl.engines.local.process import local_server
from agentrl.engines.local.weights import WeightUpdateError, read_source
from agentrl.ports import free_port

JOIN_THREADS = ("agentrl-init", "agentrl-rendezvous-watchdog")


def _join_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in JOIN_THREADS]


def _wait_for_no_join_threads(seconds: float = 30.0, *, allowed: int = 0) -> None:
    """Until at most ``allowed`` joining threads run (those of an earlier test end within their own bound)."""
    deadline = time.monotonic() + seconds
    while _join_threads().count("agentrl-init") > allowed or len(_join_threads()) > 2 * allowed:
        assert time.monotonic() < deadline, f"join threads still running: {_join_threads()}"
        time.sleep(0.05)


class _Mute(int):
    """The port of :func:`_mute_listener`, with the connections it accepted."""

    accepted: list[socket.socket]


@contextlib.contextmanager
def _mute_listener() -> Iterator[_Mute]:
    """A port that accepts TCP connections and never sends a byte (c10d's handshake waits on it for good)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    port = _Mute(srv.getsockname()[1])
    port.accepted = held
    try:
        yield port
    finally:
        stop.set()
        thread.join(2)
        for s in [*held, srv]:
            s.close()


def _init_body(port: int, group: str = "weight_update_group") -> dict:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": group}


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    engine = LocalEngine(tiny_ckpt, max_running_requests=2, seed=0)
    yield engine
    asyncio.run(engine.close())


@contextlib.contextmanager
def _serving(app) -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_second_join_while_one_is_pending_is_refused_at_once(engine):
    bound = 6.0
    app = build_app(engine, dist_timeout=bound)
    _wait_for_no_join_threads()
    with _serving(app) as url, _mute_listener() as port, httpx.Client(base_url=url, timeout=60) as http:
        first: dict = {}
        pending = threading.Thread(
            target=lambda: first.update(r=http.post("/init_weights_update_group", json=_init_body(port, "first"))),
            daemon=True,
        )
        pending.start()
        deadline = time.monotonic() + 10
        while app.state.weight_update_groups.joining != "first":
            assert time.monotonic() < deadline, "the first join never started"
            time.sleep(0.02)
        t0 = time.monotonic()
        try:  # before the fix: this one dialed and waited too
            r = httpx.post(f"{url}/init_weights_update_group", json=_init_body(port, "second"), timeout=bound)
        except httpx.ReadTimeout:
            pytest.fail("the second join waited instead of being refused")
        took = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert "'first' is still joining" in r.json()["message"] and "--dist-timeout" in r.json()["message"]
        assert took < bound / 2  # refused at once, not queued behind the pending join
        _wait_for_no_join_threads(2, allowed=1)  # the refused call left no thread behind
        assert http.get("/health").status_code == 200
        pending.join(bound + 10)
        assert not pending.is_alive() and first["r"].status_code == 400
        assert "within 6 s (--dist-timeout)" in first["r"].json()["message"]


@pytest.mark.parametrize("peer", ["closed port", "mute listener"])
def test_a_join_nobody_answers_ends_within_the_bound_and_frees_its_threads(engine, peer):
    bound = 2.0
    app = build_app(engine, dist_timeout=bound)
    _wait_for_no_join_threads()
    with _serving(app) as url, _mute_listener() as mute, httpx.Client(base_url=url, timeout=60) as http:
        port = mute if peer == "mute listener" else free_port()
        t0 = time.monotonic()
        try:
            r = http.post("/init_weights_update_group", json=_init_body(port), timeout=30)
        except httpx.ReadTimeout:  # before the fix: c10d waits for the mute peer for good
            pytest.fail(f"the join to a {peer} was still waiting after 30 s (--dist-timeout {bound})")
        took = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["success"] is False
        assert "within 2 s (--dist-timeout)" in r.json()["message"], r.json()
        assert bound <= took < bound + 8  # the deadline, not c10d's retries or the peer
        _wait_for_no_join_threads(5)  # the joining thread and its watchdog end with it
        assert app.state.weight_update_groups.joining is None
        # the slot is free again: the next join runs (and is bounded) in turn
        r = http.post("/init_weights_update_group", json=_init_body(free_port()), timeout=30)
        assert "within 2 s" in r.json()["message"]


def test_a_rank_outside_the_world_is_refused_before_dialing(engine):
    app = build_app(engine, dist_timeout=30)
    with _serving(app) as url, _mute_listener() as mute:
        body = {**_init_body(mute), "rank_offset": 2, "world_size": 2}  # rank 2 of ranks 0..1: would wait out 30 s
        try:
            r = httpx.post(f"{url}/init_weights_update_group", json=body, timeout=10)
        except httpx.ReadTimeout:
            pytest.fail("a join as a rank outside the world was attempted")
        assert r.status_code == 400 and "rank_offset (2) must lie in 1..world_size-1 (1)" in r.json()["message"]
        assert not mute.accepted  # nothing was dialed


def test_dist_timeout_is_validated_before_anything_starts(engine, tiny_ckpt, capsys):
    from agentrl.cli import main

    for bad in ("0", "-1", "nan", "7200"):
        assert main(["serve", "--hf-checkpoint", str(tiny_ckpt), "--dist-timeout", bad]) == 2
        assert "--dist-timeout must be a number of seconds in (0, 3600]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--dist-timeout"):
        build_app(engine, dist_timeout=0)


# -- a real agentrl serve process ---------------------------------------------------------------------


def _serve_process(ckpt: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentrl", "serve", "--hf-checkpoint", str(ckpt), "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"agentrl serve exited with {proc.returncode} while starting"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        assert time.monotonic() < deadline, "agentrl serve did not start"
        time.sleep(0.3)


@pytest.mark.e2e
def test_sigterm_stops_serve_promptly_with_a_join_a_stream_and_a_load_in_flight(tiny_ckpt):
    proc, url = _serve_process(tiny_ckpt, "--dist-timeout", "600")  # the join alone would wait 10 minutes
    events: list[dict] = []
    results: dict = {}
    try:
        with _mute_listener() as mute:
            joining = threading.Thread(
                target=lambda: results.update(
                    join=httpx.post(url + "/init_weights_update_group", json=_init_body(mute), timeout=60)
                ),
                daemon=True,
            )
            joining.start()

            def stream() -> None:
                body = {
                    "input_ids": [5, 17, 42],
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 1.0},
                }
                with contextlib.suppress(httpx.HTTPError):
                    with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                events.append(json.loads(line[6:]))

            threading.Thread(target=stream, daemon=True).start()
            deadline = time.monotonic() + 30
            while not events:  # the stream is running
                assert time.monotonic() < deadline, "the stream never started"
                time.sleep(0.05)
            threading.Thread(  # a disk load, queued behind the running stream
                target=lambda: results.update(
                    load=httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_ckpt)}, timeout=60)
                ),
                daemon=True,
            ).start()
            deadline = time.monotonic() + 30
            while not mute.accepted:  # the join is dialing
                assert time.monotonic() < deadline, "the join never dialed"
                time.sleep(0.05)
            refusal = httpx.post(url + "/init_weights_update_group", json=_init_body(mute, "other"), timeout=10)
            assert "still joining" in refusal.json()["message"]  # the first join is pending
            time.sleep(0.3)
            assert events[-1]["meta_info"]["finish_reason"] is None  # still streaming
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pytest.fail("agentrl serve was still running 15 s after SIGTERM")
            took = time.monotonic() - t0
            joining.join(5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert took < 15
    assert proc.returncode in (0, -signal.SIGTERM)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"  # the stream was ended, not cut off
    assert results["join"].status_code == 400  # answered, not dropped
    assert (
        results["join"].json()["message"] == "Failed to initialize custom process group: the engine is shutting down."
    )


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    """An ``agentrl serve`` of its own: before the fix a FIFO froze the whole process."""
    with local_server(tiny_ckpt, extra_args=["--seed", "0"], startup_timeout=120) as url:
        yield url


def _special_folder(tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / kind.replace(" ", "_")
    folder.mkdir()
    if kind == "fifo":
        os.mkfifo(folder / "x.safetensors")
    else:  # a symlink to a FIFO elsewhere
        os.mkfifo(tmp_path / "pipe")
        os.symlink(tmp_path / "pipe", folder / "x.safetensors")
    return folder


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["fifo", "symlink to a fifo"])
def test_a_fifo_named_safetensors_is_refused_and_the_engine_still_serves(served, tmp_path, kind):
    folder = _special_folder(tmp_path, kind)
    try:
        r = httpx.post(served + "/update_weights_from_disk", json={"model_path": str(folder)}, timeout=20)
    except httpx.ReadTimeout:
        pytest.fail("/update_weights_from_disk was still blocked on the FIFO after 20 s")
    assert r.status_code == 400 and r.json()["success"] is False
    assert f"{str(folder / 'x.safetensors')!r} is a FIFO, not a regular file" in r.json()["message"]
    assert httpx.get(served + "/health", timeout=5).status_code == 200
    body = {"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    out = httpx.post(served + "/generate", json=body, timeout=20).json()
    assert len(out["output_ids"]) == 4


def _sparse_safetensors(path: Path, name: str, shape: list[int]) -> None:
    """A safetensors file declaring one float32 tensor of ``shape``, its data a hole (4 KiB on disk)."""
    nbytes = 4 * int(torch.Size(shape).numel())
    header = json.dumps({name: {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + nbytes)


@pytest.mark.e2e
def test_a_weight_update_declaring_what_the_model_lacks_allocates_nothing(served, tmp_path):
    """A 4 KiB sparse file declaring 512 MiB grew the engine by 514 MiB before the name was refused; a broadcast
    may declare any shape too. Names and shapes are checked against the model before memory is allocated."""
    import psutil

    port = served.rsplit(":", 1)[1]
    proc = next(p for p in psutil.Process().children(recursive=True) if port in " ".join(p.cmdline()))
    base, peak, done = proc.memory_info().rss, [0], threading.Event()

    def watch() -> None:  # the peak: a tensor allocated, read and freed again leaves no trace in the final RSS
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cases = {"unknown": ("not_a_param", [128, 1 << 20]), "wrong shape": ("lm_head.weight", [128, 1 << 20])}
    for kind, (name, shape) in cases.items():
        folder = tmp_path / kind.replace(" ", "_")
        folder.mkdir()
        _sparse_safetensors(folder / "model.safetensors", name, shape)
        r = httpx.post(served + "/update_weights_from_disk", json={"model_path": str(folder)}, timeout=60)
        assert r.status_code == 400 and repr(name) in r.json()["message"], (kind, r.text)
    body = {"names": ["not_a_param"], "dtypes": ["float32"], "shapes": [[128, 1 << 20]], "group_name": "g"}
    r = httpx.post(served + "/update_weights_from_distributed", json=body, timeout=60)
    assert r.status_code == 400 and "the bucket declares 536870912 bytes" in r.json()["message"], r.text
    done.set()
    watcher.join()
    assert peak[0] - base < 100 << 20, f"the engine grew {(peak[0] - base) >> 20} MiB for what the requests declared"


def test_the_checkpoint_reader_reads_what_safetensors_writes_within_a_deadline(tmp_path, tiny_ckpt):
    from safetensors.torch import load_file, save_file

    tensors = {
        "bf16": torch.randn(3, 5).bfloat16(),
        "f16": torch.randn(4).half(),
        "f64": torch.randn(2, 2).double(),
        "i64": torch.arange(7),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
    }
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    got, _ = read_source(str(tmp_path))
    assert got.keys() == tensors.keys()
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    got, _ = read_source(str(tiny_ckpt))  # a real checkpoint: what safetensors' own reader gives
    want = load_file(str(tiny_ckpt / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(WeightUpdateError, match=r"reading '.*model\.safetensors' took longer than 0 s"):
        read_source(str(tmp_path), deadline_s=0.0)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])  # truncated: refused, no SIGBUS, nothing read past it
    with pytest.raises(WeightUpdateError, match="outside the file"):
        read_source(str(tmp_path))
    (tmp_path / "dev").mkdir()
    os.symlink("/dev/zero", tmp_path / "dev" / "zero.safetensors")  # would be read for ever
    with pytest.raises(WeightUpdateError, match="zero.safetensors' is a device or other special file"):
        read_source(str(tmp_path / "dev"))


@pytest.mark.e2e
async def test_groups_are_capped(tiny_ckpt):
    from agentrl.engines.http import EngineRequestError, SGLangEngine
    from agentrl.runtime.weight_sync import DistributedTransport

    with local_server(tiny_ckpt, extra_args=["--dist-timeout", "20"], startup_timeout=120) as url:
        engine = SGLangEngine(url)
        transports = [
            DistributedTransport([engine], backend="gloo", group_name=f"cap{i}", timeout=20) for i in range(MAX_GROUPS)
        ]
        try:
            for t in transports:
                await t.connect()
            extra = DistributedTransport([engine], backend="gloo", group_name="one_too_many", timeout=3)
            with pytest.raises(EngineRequestError, match=f"already holds {MAX_GROUPS} weight-update groups"):
                await extra.connect()
            await transports[0].close()  # a destroyed group frees its place
            await extra.connect()
            await extra.close()
        finally:
            for t in transports:
                await t.close()
            await engine.close()


def test_a_join_stuck_past_its_deadline_gives_up_the_slot(monkeypatch):
    """The one join slot freed only when the joining thread returned: a join c10d kept past its deadline would
    refuse every later init for good. Past ABANDON_S it no longer holds the slot."""
    from agentrl.engines.local import distributed

    groups = distributed.WeightUpdateGroups(rendezvous_timeout=1)
    stuck = distributed._Join("old", "127.0.0.1", 1, 0.01)
    groups._joining = stuck
    assert "still joining" in (groups._refusal("new") or "")
    monkeypatch.setattr(distributed, "ABANDON_S", 0.0)
    time.sleep(0.05)
    assert stuck.abandoned() and groups._refusal("new") is None
    again = distributed._Join("again", "127.0.0.1", 1, 0.01)  # a second one stuck too: then joins are refused
    groups._joining = again
    time.sleep(0.05)
    assert "2 earlier joins are stuck" in (groups._refusal("new") or "")
