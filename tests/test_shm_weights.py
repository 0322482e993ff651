"""Shared-memory weight sync: the engine's parameters become views of the trainer's slot file,
and double buffering keeps a push from changing the weights an engine is still using."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from agentrl.runtime.shm_weights import Layout, SharedWeightsWriter, open_weights

PROMPT = [1, 5, 9, 14, 3]


async def _greedy(engine) -> tuple[list[int], list[float]]:
    out = await engine.generate(PROMPT, {"max_new_tokens": 6, "temperature": 0}, return_logprob=True)
    lps = out["meta_info"]["output_token_logprobs"]
    return [t for _, t, _ in lps], [lp for lp, _, _ in lps]


def _perturbed(ckpt, scale: float) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(int(scale * 1000))
    return [
        (k, v + scale * torch.randn(v.shape, generator=g))
        for k, v in model.state_dict().items()
        if k != "lm_head.weight" or not model.config.tie_word_embeddings
    ]


async def _reference(ckpt, named, tmp_path) -> tuple[list[int], list[float]]:
    from safetensors.torch import save_file

    from agentrl.engines.local.engine import LocalEngine

    engine = LocalEngine(ckpt, max_running_requests=2, seed=0)
    try:
        folder = tmp_path / "ref"
        folder.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in named}, str(folder / "model.safetensors"))
        assert (await engine.update_weights_from_disk(str(folder)))["success"]
        return await _greedy(engine)
    finally:
        await engine.close()


async def test_engine_runs_on_shared_slots(tiny_ckpt, tmp_path):
    from agentrl.engines.local.engine import LocalEngine

    writer = SharedWeightsWriter(tmp_path)
    engine = LocalEngine(tiny_ckpt, max_running_requests=2, seed=0)
    try:
        pushes = [_perturbed(tiny_ckpt, s) for s in (0.02, 0.05, 0.08)]
        for i, named in enumerate(pushes):
            path, layout = writer.write(named)
            assert path.endswith(f"-{i % 2}")
            result = await engine.update_weights_from_tensors(open_weights(path, layout), str(i + 1), assign=True)
            assert result["success"], result
            assert engine.weight_version == str(i + 1)
            ids, lps = await _greedy(engine)
            ref_ids, ref_lps = await _reference(tiny_ckpt, named, tmp_path)
            assert ids == ref_ids
            assert lps == pytest.approx(ref_lps, abs=1e-4)
        # zero copy: the engine's embedding *is* the slot file; a write into the slot shows through
        emb = engine.model.get_input_embeddings().weight
        open_weights(path, layout)["model.embed_tokens.weight"][0, 0] = 123.0
        assert emb[0, 0].item() == 123.0
    finally:
        await engine.close()
        writer.close()
    assert not list(tmp_path.glob("agentrl-weights-*"))


def test_writer_maps_no_slot_and_writes_every_dtype(tmp_path):
    """The trainer writes slots with pwrite: none of its pages map a slot, so the weights the engines
    read count once, in the engines, not again (per slot) in the trainer's resident memory."""
    writer = SharedWeightsWriter(tmp_path)

    def push(k: int) -> list[tuple[str, torch.Tensor]]:  # different bytes in every push
        g = torch.Generator().manual_seed(k)
        return [
            ("f32", torch.randn(300, 7, generator=g)),
            ("bf16", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
            ("strided", (torch.arange(24.0) + k).reshape(4, 6).t()),  # not contiguous
            ("scalar", torch.tensor(2.5 + k)),
            ("empty", torch.zeros(0, 4)),
            ("flags", torch.tensor([True, k % 2 == 0, False])),
        ]

    def check(got: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    try:
        previous = None  # what an engine still reads: the slot of the push before
        for k in range(4):
            path, layout = writer.write(push(k))
            assert path.endswith(f"-{k % 2}")
            if previous is not None:
                check(previous, push(k - 1))  # double buffering: this push left the other slot alone
            previous = open_weights(path, layout)
            check(previous, push(k))
        del previous  # the reader's mapping goes with its tensors
        writer.write(push(9))
        assert writer.tag not in Path("/proc/self/maps").read_text()  # the writer mapped nothing
    finally:
        writer.close()


def test_layout_is_aligned_and_space_is_reserved_up_front(tmp_path):
    named = [("a", torch.ones(3)), ("b", torch.zeros(2, 5, dtype=torch.bfloat16))]
    layout = Layout.of(named)
    assert [e[1] % 64 for e in layout.entries] == [0, 0] and layout.nbytes >= 3 * 4 + 10 * 2
    writer = SharedWeightsWriter(tmp_path / "missing-dir")
    with pytest.raises(OSError):  # the train loop falls back to the object store on OSError
        writer.write(named)


def test_slots_of_dead_writers_are_reaped(tmp_path):
    """ray.kill (SIGKILL) skips close(): the next writer deletes slot files whose process is gone."""
    import os
    import subprocess
    import sys

    from agentrl.runtime.shm_weights import SharedWeightsWriter

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"agentrl-weights-{dead_pid}-deadbeef-0"
    live = tmp_path / f"agentrl-weights-{os.getpid()}-cafecafe-0"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    # a writer in another pid namespace: its pid means nothing here, but it holds its files' lock
    elsewhere = tmp_path / f"agentrl-weights-{dead_pid}-0ther0ns-0"
    elsewhere.write_bytes(b"x")
    import fcntl

    held = os.open(elsewhere, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    writer = SharedWeightsWriter(tmp_path)
    assert not stale.exists() and live.exists() and elsewhere.exists()
    os.close(held)
    import torch

    writer.write([("w", torch.ones(4))])
    slots = sorted(tmp_path.glob(f"{writer.tag}-*"))
    assert len(slots) == 2
    del writer  # dropped without close(): the finalizer deletes its slots
    import gc

    gc.collect()
    assert not any(p.exists() for p in slots)


def test_reaping_never_blocks_on_or_touches_what_is_not_a_slot_of_this_user(tmp_path):
    """Any local user may leave a FIFO named like a dead writer's slot: opening it to test its lock blocked the
    trainer's writer for good. Only regular files of this user are judged (and a dead writer's are reaped)."""
    import subprocess
    import sys

    os.mkfifo(tmp_path / "agentrl-weights-999999999-fifo-0")
    os.symlink("/dev/null", tmp_path / "agentrl-weights-999999999-link-0")
    (tmp_path / "agentrl-weights-999999999-dead-0").write_bytes(b"\0" * 64)
    (tmp_path / "agentrl-weights-99999999999999999999999-x-0").write_bytes(b"")  # no pid: os.kill overflowed
    (tmp_path / "agentrl-weights-9999999999-y-0").write_bytes(b"")
    code = f"from agentrl.runtime.shm_weights import reap_stale_slots as r; print(r({str(tmp_path)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-400:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "agentrl-weights-999999999-fifo-0",
        "agentrl-weights-999999999-link-0",
        "agentrl-weights-9999999999-y-0",
        "agentrl-weights-99999999999999999999999-x-0",
    ]


def test_the_writer_refuses_non_finite_weights_while_writing(tmp_path):
    """The finiteness check moved from the engine (which read every page of the slot again) into the writer,
    chunk by chunk as it writes: a NaN or inf anywhere is refused before the slot counts as written."""
    from agentrl.runtime import shm_weights

    writer = SharedWeightsWriter(tmp_path)
    big = shm_weights.CHUNK // 4 * 3 + 5  # floats: the bad value sits in the fourth chunk
    good = [("w", torch.randn(big)), ("h", torch.randn(7).to(torch.bfloat16))]
    try:
        path, layout = writer.write(good)
        for name, index, value in (("w", big - 1, float("nan")), ("w", 0, -float("inf")), ("h", 3, float("inf"))):
            bad = [(n, t.clone()) for n, t in good]
            dict(bad)[name][index] = value
            with pytest.raises(ValueError, match=f"weight '{name}' holds NaN or infinite values"):
                writer.write(bad)
            assert writer.pushes == 1  # not counted: the next push writes the same (unused) slot again
        got = open_weights(path, layout)  # the slot engines use was never touched
        assert all(torch.equal(got[n], t) for n, t in good)
        # a caller that proved its weights finite (the trainer, after its step) skips the pass: trusted as said
        path, layout = writer.write(bad, checked=True)
        assert torch.isinf(open_weights(path, layout)["h"]).any()
        huge = [("w", torch.full((big,), 3e38)), ("h", torch.zeros(7, dtype=torch.bfloat16))]  # sums overflow
        path, layout = writer.write(huge)  # finite values whose sum is inf: exact check, accepted
        assert torch.equal(open_weights(path, layout)["w"], huge[0][1])
    finally:
        writer.close()


def test_a_slot_is_mapped_only_if_it_is_a_whole_regular_file(tmp_path):
    """torch.from_file would grow a short file (and a mapping past its end faults the engine); no symlink is followed."""
    named = [("w", torch.ones(64))]
    layout = Layout.of(named)
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 16)
    with pytest.raises(OSError, match="holds 16 bytes"):
        open_weights(str(short), layout)
    assert short.stat().st_size == 16
    target = tmp_path / "target"
    target.write_bytes(b"\0" * layout.nbytes)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        open_weights(str(tmp_path / "link"), layout)
    assert open_weights(str(target), layout)["w"].shape == (64,)


def test_the_shm_route_refuses_non_finite_weights_before_any_engine_sees_them(ray_local):
    import asyncio

    import ray

    from agentrl.engines.base import EngineError
    from agentrl.runtime.weight_sync import SharedMemoryTransport

    @ray.remote(num_cpus=0)
    class Engine:
        def __init__(self):
            self.calls = 0

        def update_weights_from_shared(self, path, layout, version):
            self.calls += 1
            return {"success": True}

        def count(self):
            return self.calls

    engine = Engine.remote()
    shm = SharedMemoryTransport([engine])
    try:
        with pytest.raises(EngineError, match="refused before it reached the engines.*'w' holds NaN"):
            asyncio.run(shm.push(iter([("w", torch.tensor([1.0, float("nan")]))]), "1"))
        assert ray.get(engine.count.remote()) == 0 and shm.route == "shm"
        asyncio.run(shm.push(iter([("w", torch.tensor([1.0, 2.0]))]), "2"))
        assert ray.get(engine.count.remote()) == 1
    finally:
        asyncio.run(shm.close())


def test_a_large_slot_is_several_parts_written_in_parallel(tmp_path, monkeypatch):
    """tmpfs serializes the writers of one file: a large slot is one part file per writer thread."""
    from agentrl.runtime import shm_weights

    monkeypatch.setattr(shm_weights, "MIN_PART", 4096)
    writer = SharedWeightsWriter(tmp_path, threads=3)
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(300 + i, generator=g)) for i in range(12)] + [("b", torch.ones(5, dtype=torch.bool))]
    try:
        path, layout = writer.write(named)
        assert len(layout.parts) == 3 and sorted({e[4] for e in layout.entries}) == [0, 1, 2]
        assert len(list(tmp_path.glob(f"{writer.tag}-*"))) == 6  # two slots of three parts
        got = open_weights(path, layout)
        assert all(torch.equal(got[n], t) for n, t in named)
        bad = [(n, t.clone()) for n, t in named]
        bad[11][1][7] = float("nan")  # in the last part
        with pytest.raises(ValueError, match="'w11' holds NaN"):
            writer.write(bad)
        assert all(torch.equal(got[n], t) for n, t in named)  # the slot in use is untouched
    finally:
        writer.close()
    assert not list(tmp_path.glob(f"{writer.tag}-*"))
