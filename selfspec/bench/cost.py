"""What a verification of ``n`` tokens costs on this machine: the forward cost curve behind every tree choice.

``cost_curve(model, sizes)`` is the median forward time of ``n`` new tokens over ``prefix`` cached ones, for each
``n``; the cache is rolled back after each forward, so every measurement sees the same prefix. Several linear
backends are measured interleaved (one round over every backend and size, repeated), so that a slow moment of a
shared machine falls on all of them alike. A flat curve (8 tokens costing what 1 costs) is what makes trees pay.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import torch

from selfspec.runtime import cache as kv
from selfspec.runtime.kernels import cpu_signature, linear_backend
from selfspec.runtime.skinny import cpuinfo_fields


def describe_cpu(cpuinfo: str | None = None) -> str | None:
    """``/proc/cpuinfo``'s text (or ``cpuinfo``) as one name that tells machines apart: the model name, then the
    family and model numbers and the widest vector extensions, e.g. ``AMD EPYC (family 25 model 1, AVX2)``. A VM
    often reports only "AMD EPYC", for Zen 3 and Zen 5 alike, and their figures differ a lot. None without a model
    name."""
    fields = cpuinfo_fields(cpuinfo)
    name = fields.get("model name")
    if not name:
        return None
    flags = set(fields.get("flags", "").split())
    isa = ["AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None,
           "AMX" if "amx_tile" in flags else None]
    parts = [f"family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields and "model" in fields
             else None, *isa]
    details = ", ".join(part for part in parts if part)
    return f"{name} ({details})" if details else name


def cpu_model() -> str:
    """The processor as figures should name it: ``describe_cpu()`` (e.g. ``AMD EPYC (family 25 model 1, AVX2)``), or
    the name ``cpu_signature`` gives where there is no ``/proc/cpuinfo``."""
    return describe_cpu() or cpu_signature()["cpu"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cost_curves(model: Any, sizes: Sequence[int], backends: Sequence[str] = ("stock",), *, prefix: int = 256,
                repeats: int = 12, warmup: int = 2, seed: int = 0) -> dict[str, dict[int, float]]:
    """``{backend: {tokens: median forward ms}}`` over ``prefix`` cached tokens of random ids.

    Raises:
        ValueError: no sizes, a size below 1, or fewer than one repeat.
    """
    if not sizes or min(sizes) < 1 or repeats < 1:
        raise ValueError(f"cost curve: need token counts >= 1 and repeats >= 1, got {list(sizes)} and {repeats}")
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, prefix + max(sizes)), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(device)
    seconds: dict[str, dict[int, list[float]]] = {b: {n: [] for n in sizes} for b in backends}
    with torch.inference_mode():
        cache = kv.new_cache(model, capacity=prefix + max(sizes) + 8)
        model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)
        # One backend at a time: a stock forward streams the float32 weights (538 MB for SmolLM2) and evicts what a
        # grid backend's next forward would find in cache, as decoding on one backend never does (interleaved
        # rounds measured SmolLM2's 1-token skinny forward at 10.4 ms where decoding sees 8.8).
        for backend in backends:
            with linear_backend(model, backend):
                for round_ in range(warmup + repeats):  # the warm-up rounds pack weights and fault pages in
                    for n in sizes:
                        _sync(device)
                        start = time.perf_counter()
                        model(input_ids=ids[:, prefix:prefix + n], cache=cache, use_cache=True)
                        _sync(device)
                        if round_ >= warmup:
                            seconds[backend][n].append(time.perf_counter() - start)
                        kv.crop(cache, prefix)  # back to the prefix: every forward sees the same context
    return {b: {n: statistics.median(t) * 1e3 for n, t in per_size.items()} for b, per_size in seconds.items()}


@torch.inference_mode()
def machine_limits(buffer_mb: int = 512, repeats: int = 3) -> dict[str, float]:
    """What this CPU can do at best with the current torch threads: ``read_gb_s``, the rate a large float32 buffer
    is read (a sum over ``buffer_mb`` MB, larger than any cache); ``gflops``, a large float32 GEMM's rate through
    PyTorch's BLAS; and, where the skinny extension builds, ``fma_gflops``, the cores' multiply-add peak measured
    from registers (``skinny.fma_peak_gflops``: BLAS reaches well under it on some CPUs, 216 of 510 GFLOPS on a
    2-core Zen 5). Best of ``repeats``; about a second."""
    data = torch.ones(buffer_mb * 2**20 // 4)
    data.sum()  # fault the pages in
    read = min(_timed(data.sum) for _ in range(repeats))
    del data
    a, b = torch.randn(1024, 1152), torch.randn(1152, 1536)
    a @ b
    gemm = min(_timed(lambda: a @ b) for _ in range(repeats))
    limits = {"read_gb_s": buffer_mb * 2**20 / read / 1e9, "gflops": 2 * 1024 * 1152 * 1536 / gemm / 1e9}
    from selfspec.runtime import skinny

    if skinny.available():
        limits["fma_gflops"] = max(skinny.fma_peak_gflops() for _ in range(repeats))
    return limits


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def streamed_bytes(model: Any) -> int:
    """Bytes ``model``'s linear layers read a forward as they run now: a layer on a packed backend reads its packed
    weight (an exact grid streams 4.5-8.5 bits a weight, ``skinny.pack_grid``), one not yet packed or on the stock
    path its float32 weight."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            packed = getattr(module.__dict__.get("forward"), "_weight", None)
            dense = isinstance(packed, torch.Tensor) and packed.layout == torch.strided
            total += packed.numel() * packed.element_size() if dense else module.weight.numel() * 4
    return total


def linear_floor_ms(model: Any, sizes: Sequence[int], limits: dict[str, float]) -> dict[int, float]:
    """``{tokens: ms}``: the least time that many rows can take through ``model``'s linear layers (its LM head
    included) on a machine of ``limits``: the longer of reading every weight once (as stored now:
    ``streamed_bytes``) and doing the multiply-adds at the cores' peak (``fma_gflops``; the GEMM rate ``gflops``
    where that was not measured). The rest of a forward (attention, norms, dispatch) comes on top; ``selfspec cost``
    prints this beside the measured curve."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    read_ms = streamed_bytes(model) / (limits["read_gb_s"] * 1e9) * 1e3
    rate = limits.get("fma_gflops") or limits["gflops"]
    return {n: max(read_ms, 2 * weights * n / (rate * 1e9) * 1e3) for n in sizes}
