"""Running megatron-core 0.16.1 where there is no GPU: every workaround, in one place.

megatron-core is written for CUDA. Its model code is plain PyTorch, so it runs on CPU, except for a
few spots that name the GPU outright. The SDK wants the same Megatron code path on a laptop (tests,
tiny models, gloo) and on a cluster (NCCL), so instead of forking megatron we patch those spots
here, and only when ``torch.cuda.is_available()`` is False: on a CUDA machine this module changes
nothing and megatron runs exactly as shipped.

What is patched (each is explained where it is done):

1. ``torch.cuda.current_device()`` returns ``"cpu"``.
2. The default causal mask (``transformer.utils.get_default_causal_mask``) is built on the CPU.
3. The tied-embedding copy on the last pipeline stage is not moved with ``.cuda()``.
4. The RNG tracker is megatron's *inference* tracker (see :func:`init_megatron_parallel`).
5. Around a pipeline-schedule call, :func:`cpu_schedule` maps ``device="cuda"`` allocations to the CPU
   and makes ``torch.cuda.synchronize()`` a no-op (scoped, not global).

The module also owns megatron's process-global parallel state for the trainer: initialise it once
per process with :func:`init_megatron_parallel`, tear it down with :func:`destroy_megatron_parallel`.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator

import torch

INSTALL_HINT = "install it with `pip install megatron-core` (the model code needs only torch, numpy, packaging)"

_APPLIED = False


def megatron_available() -> str | None:
    """None when megatron-core imports; otherwise why not and how to install it."""
    try:
        with warnings.catch_warnings():
            # megatron warns at import that Transformer Engine / Apex are absent; we use its local modules
            warnings.simplefilter("ignore")
            importlib.import_module("megatron.core")
            importlib.import_module("megatron.core.models.gpt").GPTModel  # noqa: B018 - the class must exist
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot use it", say which
        return f"megatron-core is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def apply_cpu_workarounds() -> None:
    """Patch the CUDA-only spots of megatron-core so its models run on CPU (idempotent).

    A no-op when CUDA is available: megatron then runs unpatched.
    """
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    _patch_current_device()
    _patch_causal_mask()
    _patch_tied_embedding_copy()
    _APPLIED = True


def _patch_current_device() -> None:
    # megatron allocates buffers with ``device=torch.cuda.current_device()`` (rotary inv_freq, the global
    # memory buffer of DotProductAttention, the TP gather/scatter outputs in tensor_parallel.mappings, weight
    # init in tensor_parallel.layers). Without CUDA that call raises "Torch not compiled with CUDA enabled".
    # Returning "cpu" makes every one of those allocations land on the CPU, where the rest of the model
    # lives. Only applied without CUDA, where the original could never succeed, so nothing that works
    # is changed.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _patch_causal_mask() -> None:
    # DotProductAttention (the local spec's attention) builds its causal mask, when it is given no mask,
    # with ``torch.ones(sq, sq, device="cuda")`` (transformer/utils.py, imported by name into
    # fusions/fused_softmax.py). Same mask, built on the CPU; only applied without CUDA.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        """[sq, sq] bool, True above the diagonal = masked out (megatron's convention)."""
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_tied_embedding_copy() -> None:
    # With tied embeddings and pipeline parallelism the last stage keeps a copy of the word embeddings as
    # its output weight; LanguageModule.setup_embeddings_and_output_layer zeroes it and all-reduces it with
    # the first stage after ``weight.data = weight.data.cuda()``, which raises without CUDA. Without CUDA we
    # hide ``.cuda`` for the duration of that one call: the all-reduce then runs on the CPU tensor (gloo).
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_agentrl_cpu", False):
        return

    def setup_embeddings_and_output_layer(self) -> None:
        tensor_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign]
        try:
            original(self)
        finally:
            torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign]

    setup_embeddings_and_output_layer._agentrl_cpu = True  # type: ignore[attr-defined]
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


class _CudaAllocationsOnCpu(torch.overrides.TorchFunctionMode):
    """Rewrites a ``device="cuda"`` (or ``torch.device("cuda")``) keyword to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_schedule() -> Iterator[None]:
    """Wrap a call of megatron's ``get_forward_backward_func()(...)`` so it runs without CUDA.

    The schedules allocate their token counter with ``torch.zeros([], device="cuda")``
    (pipeline_parallel/schedules.py) and the pipeline's shape exchange calls ``torch.cuda.synchronize()``
    (p2p_communication.py); both raise without CUDA. Inside this block the first lands on the CPU and the
    second does nothing (gloo's point-to-point waits are already synchronous). Scoped rather than global
    because a TorchFunctionMode sees every torch call. Without effect when CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    apply_cpu_workarounds()
    synchronize = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    try:
        with _CudaAllocationsOnCpu():
            yield
    finally:
        torch.cuda.synchronize = synchronize  # type: ignore[assignment]


def init_megatron_parallel(tp: int = 1, pp: int = 1, cp: int = 1, *, seed: int = 1234) -> None:
    """Set up megatron's tensor/pipeline/context-parallel groups and its RNG tracker for this process.

    ``torch.distributed`` must already be initialised (gloo on CPU, nccl on GPUs); the data-parallel size
    is what is left of the world. Megatron keeps these groups in module globals, so a second call with the
    same sizes is a no-op and one with different sizes is an error: call :func:`destroy_megatron_parallel`
    first to change them.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "init_megatron_parallel needs torch.distributed initialised first: call "
            "torch.distributed.init_process_group('gloo' on CPU or 'nccl' on GPUs) before it"
        )
    apply_cpu_workarounds()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        have = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(),
        )
        if have != (tp, pp, cp):
            raise RuntimeError(
                f"megatron parallel state is already initialised with (tp, pp, cp)={have}, not "
                f"{(tp, pp, cp)}; call destroy_megatron_parallel() before re-initialising"
            )
    else:
        world = dist.get_world_size()
        if world % (tp * pp * cp):
            raise ValueError(
                f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}; "
                "choose parallel sizes whose product divides the number of processes"
            )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
    # The training tracker snapshots and restores CUDA generator states (torch.cuda.get_rng_state) around
    # every dropout in a tensor-parallel region, which cannot work without CUDA. Megatron's inference
    # tracker keeps the same interface with no-op forks, so dropout then draws from the CPU generator; that
    # is harmless here because the SDK runs with dropout 0 (RL needs ratio == 1 on the first pass).
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True)


def destroy_megatron_parallel() -> None:
    """Forget megatron's parallel groups (the torch.distributed process group itself stays up)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
