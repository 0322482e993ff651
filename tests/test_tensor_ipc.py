"""Tensors by handle between processes (SGLang's /update_weights_from_tensor format), and its guard."""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from agentrl.engines.tensor_ipc import (
    IpcFolder,
    Receiver,
    TensorStash,
    deserialize_named_tensors,
    serialize_named_tensors,
)


@pytest.fixture
def ipc_folder():
    """A run's private weight folder (0700 under /dev/shm), removed afterwards."""
    folder = IpcFolder.create()
    yield folder
    folder.remove()


def _any(folder: IpcFolder | None, max_bytes: int = 1 << 30) -> Receiver:
    """A receiver with no model: any name, dtype and shape, CPU handles from ``folder``."""
    return Receiver(params=None, max_bytes=max_bytes, folder=folder)


@pytest.mark.e2e
def test_round_trip_into_an_unrelated_process(ipc_folder):
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    with TensorStash(ipc_folder) as stash:
        payload = serialize_named_tensors([("a", a), ("b", b)], stash)
        assert len(payload) < 2000  # handles, not values
        code = (
            "from agentrl.engines.tensor_ipc import IpcFolder, Receiver, deserialize_named_tensors as d\n"
            f"r = Receiver(params=None, max_bytes=1 << 20, folder=IpcFolder({str(ipc_folder.path)!r}))\n"
            f"print([(n, str(t.dtype), t.float().tolist()) for n, t in d({payload!r}, r)])"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == str(
            [("a", "torch.float32", a.tolist()), ("b", "torch.bfloat16", b.float().tolist())]
        )
        assert len(list(ipc_folder.path.iterdir())) == 2  # the reader deleted nothing
    assert not list(ipc_folder.path.iterdir())  # the sender deleted exactly its files


def test_strided_and_tied_tensors_keep_their_own_values(ipc_folder):
    """Non-contiguous tensors are written from contiguous temporaries: a freed temporary's address, reused by
    the next one, must never map that tensor onto an earlier file; the same tensor under two names is one file."""
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    with TensorStash(ipc_folder) as stash:
        payload = serialize_named_tensors([("a", a.t()), ("b", b.t()), ("a2", a.t()), ("tied", a), ("tied2", a)], stash)
        got = dict(deserialize_named_tensors(payload, _any(ipc_folder)))
        assert len(list(ipc_folder.path.iterdir())) == 3  # a.t() once (the same view twice), b.t(), a
    for name, want in (("a", a.t()), ("b", b.t()), ("a2", a.t()), ("tied", a), ("tied2", a)):
        assert torch.equal(got[name], want), name


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


class _EvalBuiltin:
    def __reduce__(self):
        return (eval, ("__import__('os').system('echo pwned')",))


class _TorchLoad:
    """torch.storage._load_from_bytes runs torch.load(weights_only=False): a full unpickle."""

    def __reduce__(self):
        import torch.storage

        return (torch.storage._load_from_bytes, (pickle.dumps(_Evil()),))


@pytest.mark.parametrize(
    "obj, message",
    [
        (_Evil(), "refusing to load"),
        (_EvalBuiltin(), "refusing to load builtins.eval"),
        (_TorchLoad(), "refusing to load torch.storage._load_from_bytes"),
        ([("x", 1)], "list of \\(name, tensor\\) pairs"),
    ],
)
def test_payloads_that_are_not_named_tensors_are_refused(obj, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = base64.b64encode(pickle.dumps(obj)).decode()
    with pytest.raises((pickle.UnpicklingError, ValueError), match=message):
        deserialize_named_tensors(payload)
    with pytest.raises(ValueError, match="base64 strings"):
        deserialize_named_tensors(10**9)


def test_a_refusal_imports_nothing_and_echoes_little():
    """``getattr(torch, name)`` imported the submodule a pickle named (torch._dynamo: 1.4 s) before refusing it;
    a refusal quoted a client's 3M-element list whole, and a 200k-deep one raised RecursionError."""
    import subprocess
    import sys

    code = (
        "import base64, sys\n"
        "from agentrl.engines.tensor_ipc import deserialize_named_tensors as d\n"
        "try:\n    d(base64.b64encode(b'ctorch\\n_dynamo\\n.').decode())\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split("\n")[:2] == [
        "UnpicklingError refusing to load torch._dynamo from serialized tensors",
        "False",
    ]
    from agentrl.engines.tensor_ipc import _index

    with pytest.raises(ValueError) as info:
        _index(list(range(3_000_000)), "size")
    assert len(str(info.value)) < 200
    deep: list = []
    for _ in range(200_000):
        deep = [deep]
    with pytest.raises(ValueError) as info:
        _index(deep, "size")
    assert len(str(info.value)) < 200


@pytest.mark.e2e
async def test_engine_loads_weights_by_handle_and_refuses_garbage(tiny_ckpt, tmp_path, ipc_folder):
    from safetensors.torch import load_file

    from agentrl.engines.http import EngineRequestError, SGLangEngine
    from agentrl.engines.local.process import local_server
    from agentrl.runtime.weight_sync import TensorTransport

    weights = load_file(str(tiny_ckpt / "model.safetensors"))
    folder = str(ipc_folder.path)
    with local_server(tiny_ckpt, startup_timeout=120, extra_args=["--weight-ipc-dir", folder]) as url:
        engine = SGLangEngine(url)
        try:
            prompt = [1, 2, 3, 4]
            greedy = {"max_new_tokens": 6, "temperature": 0.0}
            from agentrl.engines.base import SamplingParams

            before = await engine.generate(prompt, SamplingParams(**greedy))
            with pytest.raises(EngineRequestError, match="could not read"):
                await engine.update_weights_from_tensor([base64.b64encode(pickle.dumps(_Evil())).decode()])
            changed = {n: (t * 0 if "embed" in n or "lm_head" in n else t) for n, t in weights.items()}
            await TensorTransport([engine], bucket_bytes=1 << 16, ipc_dir=folder).push(changed.items(), "v7")
            assert (await engine.model_info())["weight_version"] == "v7"
            after = await engine.generate(prompt, SamplingParams(**greedy))
            assert after.output_ids != before.output_ids or len(set(after.output_ids)) == 1
            await TensorTransport([engine], ipc_dir=folder).push(weights.items(), "v8")
            again = await engine.generate(prompt, SamplingParams(**greedy))
            assert again.output_ids == before.output_ids
            assert not list(ipc_folder.path.iterdir())  # every bucket's files deleted by the sender
        finally:
            await engine.close()


def test_a_push_that_never_arrives_leaves_no_shared_memory():
    """A push nobody answers leaves no file: neither torch's /dev/shm files nor the stash's files in the folder.

    Run in a fresh process: the files are named by pid, and in the test process any other thread
    (an earlier test's leftovers) could create or hold one while this runs.
    """
    code = textwrap.dedent("""
        import asyncio, gc, glob, os
        import torch
        from agentrl.engines.base import EngineError
        from agentrl.engines.http import SGLangEngine
        from agentrl.engines.ipc_folder import IpcFolder
        from agentrl.ports import free_port
        from agentrl.runtime.weight_sync import TensorTransport

        folder = IpcFolder.create()

        def shm_files():
            return {f for f in glob.glob("/dev/shm/torch_*") if f.startswith(f"/dev/shm/torch_{os.getpid()}_")}

        async def main():
            engine = SGLangEngine(f"http://127.0.0.1:{free_port()}", max_retries=0)  # nothing listens there
            weights = {f"w{i}": torch.randn(64, 64) for i in range(3)}
            try:
                await TensorTransport([engine], bucket_bytes=20_000, ranks_per_engine=2, ipc_dir=folder.path).push(
                    weights.items(), "1"
                )
            except EngineError:
                print("refused")
            finally:
                await engine.close()

        before = shm_files()
        asyncio.run(main())
        gc.collect()
        print(len(shm_files() - before) + len(list(folder.path.iterdir())), "left")
        folder.remove()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["refused", "0", "left"], r.stdout


_META_CLS = None


@contextlib.contextmanager
def sglang_bucket_class():
    """SGLang's ``FlattenedTensorMetadata`` as slime pickles it: a dataclass of that module and name.

    Built here (SGLang is not installed) under SGLang's own module path, so the pickle names exactly
    what slime's sender names. The module is in ``sys.modules`` only while pickling: other code asks
    ``find_spec("sglang")`` to see whether SGLang is installed.
    """
    import dataclasses
    import types

    global _META_CLS
    name = "sglang.srt.weight_sync.tensor_bucket"
    if _META_CLS is None:
        _META_CLS = dataclasses.make_dataclass(
            "FlattenedTensorMetadata", ["name", "shape", "dtype", "start_idx", "end_idx", "numel"]
        )
        _META_CLS.__module__ = name
    mod = types.ModuleType(name)
    mod.FlattenedTensorMetadata = _META_CLS
    added = [m for m in ("sglang", "sglang.srt", "sglang.srt.weight_sync", name) if m not in sys.modules]
    for m in added:
        sys.modules[m] = mod if m == name else types.ModuleType(m)
    try:
        yield _META_CLS
    finally:
        for m in added:
            sys.modules.pop(m, None)


def slime_bucket(named: list[tuple[str, torch.Tensor]], stash: TensorStash, *, by_bytes: bool = True) -> str:
    """What slime's ``update_weight_from_tensor.py`` sends with ``load_format="flattened_bucket"``:
    ``MultiprocessingSerializer.serialize({"flattened_tensor", "metadata"}, output_str=True)``, a ForkingPickler
    pickle whose CPU buffer is a file of the engine's private folder (``stash``) instead of a torch /dev/shm file.
    ``by_bytes``: current SGLang (a uint8 buffer, byte offsets); else older SGLang (one dtype, element offsets)."""
    from agentrl.engines.tensor_ipc import HandlePickler

    flats, meta, pos = [], [], 0
    buf = io.BytesIO()
    with sglang_bucket_class() as meta_cls:
        for name, t in named:
            flat = t.contiguous().flatten()
            flat = flat.view(torch.uint8) if by_bytes else flat
            meta.append(meta_cls(name, t.shape, t.dtype, pos, pos + flat.numel(), t.numel()))
            flats.append(flat)
            pos += flat.numel()
        HandlePickler(buf, stash).dump({"flattened_tensor": torch.cat(flats), "metadata": meta})
    return base64.b64encode(buf.getvalue()).decode()


def test_slime_flattened_buckets_are_read_in_both_sglang_layouts(ipc_folder):
    from agentrl.engines.tensor_ipc import HandlePickler, serialize_flattened_bucket
    from agentrl.engines.tensor_ipc import deserialize_flattened_bucket as read

    stash = TensorStash(ipc_folder)
    r = _any(ipc_folder)

    mixed = [
        ("a", torch.randn(3, 5)),
        ("odd", torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16)),  # 6 bytes: the next range is unaligned
        ("b", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("c", torch.randn(4)),
    ]
    for payload in (slime_bucket(mixed, stash), serialize_flattened_bucket(mixed, stash)):
        got = read(payload, r)
        assert [n for n, _ in got] == [n for n, _ in mixed]
        for (_, want), (_, t) in zip(mixed, got):
            assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    same = [("x", torch.randn(2, 2)), ("y", torch.randn(3))]
    old = read(slime_bucket(same, stash, by_bytes=False), r)
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(old, same))
    assert read(serialize_flattened_bucket([])) == []  # a rank with nothing to send (no file, no folder needed)
    assert read(slime_bucket([("i", torch.arange(3))], stash, by_bytes=False), r)[0][1].dtype == torch.int64

    buf = io.BytesIO()
    with sglang_bucket_class() as cls:  # an int64 buffer whose entry claims float32: refused, never converted
        meta = [cls("i", torch.Size([3]), torch.float32, 0, 3, 3)]
        HandlePickler(buf, stash).dump({"flattened_tensor": torch.arange(3), "metadata": meta})
    with pytest.raises(ValueError, match="'i': torch.float32 in a torch.int64 buffer"):
        read(base64.b64encode(buf.getvalue()).decode(), r)
    stash.close()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("end_idx", 10**6, "does not hold"),
        ("numel", 7, "does not hold"),
        ("shape", torch.Size([5, 5]), "has 25 elements"),
        ("dtype", "float32", "dtype must be a torch dtype"),
        ("start_idx", False, "offsets integers"),
    ],
)
def test_bad_bucket_metadata_is_refused_naming_the_tensor(field, value, message, ipc_folder):
    from agentrl.engines.tensor_ipc import HandlePickler, deserialize_flattened_bucket

    buf = io.BytesIO()
    with TensorStash(ipc_folder) as stash:
        with sglang_bucket_class() as cls:
            meta = cls("w", torch.Size([2, 3]), torch.float32, 0, 24, 6)
            setattr(meta, field, value)
            HandlePickler(buf, stash).dump({"flattened_tensor": torch.zeros(24, dtype=torch.uint8), "metadata": [meta]})
        with pytest.raises(ValueError, match=f"'w'.*{message}|{message}"):
            deserialize_flattened_bucket(base64.b64encode(buf.getvalue()).decode(), _any(ipc_folder))
        with pytest.raises(ValueError, match="keys 'flattened_tensor' and 'metadata'"):
            deserialize_flattened_bucket(serialize_named_tensors([("w", torch.zeros(2))], stash), _any(ipc_folder))


@pytest.mark.e2e
async def test_engine_loads_a_slime_flattened_bucket(tiny_ckpt, ipc_folder):
    from safetensors.torch import load_file

    from agentrl.engines.base import SamplingParams
    from agentrl.engines.http import SGLangEngine
    from agentrl.engines.local.process import local_server

    weights = load_file(str(tiny_ckpt / "model.safetensors"))
    stash = TensorStash(ipc_folder)
    with local_server(tiny_ckpt, startup_timeout=120, extra_args=["--weight-ipc-dir", str(ipc_folder.path)]) as url:
        engine = SGLangEngine(url)
        try:
            greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
            before = await engine.generate([1, 2, 3, 4], greedy)
            flipped = -weights["lm_head.weight"]  # argmax becomes argmin: every greedy token changes
            payload = slime_bucket([("lm_head.weight", flipped)], stash)
            await engine.update_weights_from_tensor([payload], load_format="flattened_bucket", weight_version="b1")
            assert (await engine.model_info())["weight_version"] == "b1"
            after = await engine.generate([1, 2, 3, 4], greedy)
            assert after.output_ids != before.output_ids
            restore = slime_bucket([("lm_head.weight", weights["lm_head.weight"])], stash)
            await engine.update_weights_from_tensor([restore], load_format="flattened_bucket", weight_version="b2")
            assert (await engine.generate([1, 2, 3, 4], greedy)).output_ids == before.output_ids
            assert len(list(ipc_folder.path.iterdir())) == 2  # the engine read both buckets and deleted neither
        finally:
            await engine.close()
            stash.close()
