"""Linear-layer backends for CPU inference: the same model, its matmuls run by another library.

Decoding multiplies every weight matrix by 1 to ~20 rows (one token, or a draft tree). On some CPUs the BLAS
that ``torch.nn.functional.linear`` uses handles these skinny shapes badly: on the AMD EPYC this project is
developed on, MKL takes 16 ms for the 576 x 49152 LM head at 2 rows and 24 ms at 3 rows, but 8 ms at 1 row,
while oneDNN (also shipped inside PyTorch) takes 4-6 ms for 1 to 8 rows. Tree verification lives on exactly
these shapes, so the backend decides whether a 4-node tree costs 1.5x or 1.1x one token.

``set_linear_backend(model, "onednn")`` makes every float32 ``nn.Linear`` of ``model`` run through oneDNN
(``torch._C._nn.mkldnn_linear``) when gradients are off; training, other dtypes and other devices keep the stock
path. ``"skinny"`` runs them through this project's own kernel (``selfspec.runtime.skinny``, compiled for the CPU on
first use): register-blocked for 1 to 24 rows, it streams each weight once per call and keeps every loaded weight
vector busy for all rows, so on float32 weights a step of 8 tokens costs 1.1-1.4x one token (docs/RESULTS.md has the
curve per machine; ``selfspec cost`` prints this one's). A weight that lies exactly on a GGUF Q4_1 or Q8_0 block grid
(every weight of a model loaded from such a file) is streamed as that grid and rebuilt bit for bit on load
(``skinny.pack_exact``): the same outputs from 3.6-6.4x fewer bytes, so one token costs about half as much and a
step becomes bound by the multiply-adds from a few tokens on. Calls with more rows (prefill) take the stock path. The
parameters are untouched (the identity fingerprint, ``state_dict`` and saving are unchanged); each layer keeps a
packed copy of its weight, repacked when the parameter changes. ``"auto"`` measures forwards of a plain step and of the tree sizes
drafters verify (``AUTO_SIZES``) on each available backend, keeps the fastest in total, and remembers the choice per
CPU, model and kernel build. Every backend but ``stock`` also runs a model's masked grouped-query attention (tree
verification, padded batches) without copying its KV heads (``selfspec.runtime.attention.GQA_SDPA``), and ``skinny``
runs forwards of a few queries on its own attention kernel (``attention.SKINNY_ATTENTION``) and Llama-family decoder
layers on a lean forward over its kernels (``selfspec.runtime.lean``); ``stock`` is PyTorch and transformers as
shipped.

A drafter's own linear layers (Medusa heads, the feature drafter, an early-exit adapter and draft head) follow the
base model's backend (``follow_backend``), and on ``skinny`` they read float16 copies of their weights, or with
``set_draft_weights("q8_0" / "q4_1")`` their weights rounded to a block grid (``draft_backend``): a draft only
proposes tokens that the float32 model then verifies, so its weights' precision can change what is accepted, never
what is output, and fewer bytes are less memory traffic in a draft step.

Greedy decoding stays lossless: the drafters' output is compared with the generate of the *same* model, and the
backend only changes float rounding (differences of ~1e-5 in the logits), the same class of difference as a
tree forward's batched matmuls versus plain decoding's one row. Benchmarks run every method on one backend and
can add ``vanilla@stock`` to show the stock baseline next to it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.runtime import skinny
from selfspec.runtime.attention import GQA_SDPA, SKINNY_ATTENTION, use_attention
from selfspec.runtime.lean import tensor_version, use_lean_layers

BACKENDS = ("stock", "onednn", "skinny", "auto")
#: drafters' own weights on the skinny kernel (``set_draft_weights``): what their layers run on where the base runs on
#: ``skinny``
SKINNY_HALF = "skinny-f16"
#: what drafters' layers may read: float16 or float32 copies of their weights, or their weights rounded to a Q8_0 or
#: Q4_1 block grid (``skinny.quantize``)
DRAFT_WEIGHTS = ("float16", "float32", "q8_0", "q4_1")
#: bytes a weight of each draft format streams (grid panels keep d and m as float32: 36 / 24 bytes per 32 weights)
_DRAFT_BYTES = {"q4_1": 0.75, "q8_0": 1.125, "float16": 2.0, "float32": 4.0}
_draft_weights = "float16"
_STATE = "_selfspec_linear_backend"
_KERNEL_CACHE = "_selfspec_linear_kernels"
# oneDNN's linear on dense activations against a packed weight (what Inductor's CPU freezing uses): the same
# primitive as ``mkldnn_linear``, bitwise, minus converting every input to and every output from oneDNN's layout.
_POINTWISE = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def onednn_available() -> bool:
    """oneDNN linear is usable in this PyTorch build."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch._C._nn, "mkldnn_linear")


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rows @ weight.T + bias`` on oneDNN: ``rows`` dense ``[n, in]``, ``weight`` packed (``to_mkldnn``)."""
    if _POINTWISE is not None:  # dense in, dense out: no per-call conversion of the activations
        return _POINTWISE(rows, weight, bias, "none", [], "")
    if bias is not None and packed_bias is None:
        packed_bias = bias.to_mkldnn()
    return torch._C._nn.mkldnn_linear(rows.to_mkldnn(), weight, packed_bias).to_dense()


class _PackedLinear:
    """A replacement ``forward`` for one ``nn.Linear``: a packed-weight kernel when it applies, stock otherwise.

    It runs ~200 times per forward of a small model, so the common case (inference, float32 rows on the CPU, weights
    unchanged since they were packed) costs two dict lookups and one identity check before the kernel: the
    parameters are read from ``_parameters`` (``nn.Module.__getattr__`` costs a microsecond a lookup), and the
    weight's dtype and device are checked only when it is packed."""

    backend = ""

    def __init__(self, module: nn.Linear):
        self.module = module
        self._key = None
        self._weight = self._bias = None

    def _pack(self, weight: torch.Tensor, bias: torch.Tensor | None):
        raise NotImplementedError

    def _run(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def _current(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Pack ``weight`` (and ``bias``) unless the packed copy is of them as they are now; False when the kernel
        cannot take them (not float32 on the CPU)."""
        key = (weight.data_ptr(), tensor_version(weight),
               None if bias is None else (bias.data_ptr(), tensor_version(bias)))
        if key == self._key:
            return True
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return False
        with torch.no_grad():  # first call, or the parameter was replaced or changed in place: repack
            self._weight, self._bias = self._pack(weight.detach(), None if bias is None else bias.detach())
        self._key = key
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        params = self.module._parameters
        weight, bias = params["weight"], params.get("bias")
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0
                or not self._current(weight, bias)):
            return F.linear(x, weight, bias)
        shape = x.shape
        out = self._run(x.reshape(-1, shape[-1]), bias)
        if out is None:
            return F.linear(x, weight, bias)
        return out.view(*shape[:-1], out.shape[-1])


class _OneDNNLinear(_PackedLinear):
    backend = "onednn"

    def _pack(self, weight, bias):
        return weight.to_mkldnn(), None if bias is None else bias.to_mkldnn()

    def _run(self, rows, bias):
        return onednn_linear(rows.contiguous(), self._weight, bias, self._bias)


class _SkinnyLinear(_PackedLinear):
    backend = "skinny"

    def _pack(self, weight, bias):
        return skinny.pack_exact(weight), None  # a GGUF model's block grid where the weights lie on one

    def _run(self, rows, bias):
        if rows.shape[0] > skinny.MAX_ROWS:
            return None  # a large GEMM: the stock BLAS is good at those
        return skinny.linear(rows, self._weight, self.module.out_features, bias)


class _SkinnyHalfLinear(_SkinnyLinear):
    """A drafter's layer on the skinny kernel, over the weights ``set_draft_weights`` chose: float16 panels
    (``skinny.pack(..., half=True)``; a weight beyond float16's range, |w| > 65504, keeps float32 panels) or the
    weight rounded to a Q8_0 / Q4_1 grid (``skinny.pack_quantized``; a layer whose inputs are not in blocks of 32
    takes float16). A weight that lies exactly on a GGUF block grid (a draft head made of a Q8_0 model's LM-head rows)
    keeps that grid wherever it streams no more bytes than the chosen format: its float32 values exactly. Repacked when
    the chosen format changes."""

    backend = SKINNY_HALF

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self._format = None  # the draft weights it was packed for

    def _current(self, weight, bias):
        if self._format != _draft_weights:
            self._key = None
        return super()._current(weight, bias)

    def _pack(self, weight, bias):
        chosen = self._format = _draft_weights
        grid = skinny.pack_grid(weight) if skinny.EXACT_GRIDS else None
        if grid is not None and _DRAFT_BYTES[grid[0]] <= _DRAFT_BYTES[chosen]:
            return grid[1], None
        if chosen in skinny.GRIDS and weight.shape[1] % skinny.GRID_BLOCK == 0 and weight.numel() \
                and bool(torch.isfinite(weight).all()):
            return skinny.pack_quantized(weight, chosen), None
        half = bool(weight.abs().max() <= torch.finfo(torch.float16).max) if weight.numel() else True
        return skinny.pack(weight, half=half), None


_KERNELS = {"onednn": _OneDNNLinear, "skinny": _SkinnyLinear, SKINNY_HALF: _SkinnyHalfLinear}


def packed_formats(model: nn.Module) -> dict[str, int]:
    """``{format: linear layers}`` of what ``model``'s linears stream as they run now: ``float32`` / ``float16``
    panels, exact ``q4_1`` / ``q8_0`` grids (``skinny.pack_grid``), ``onednn`` or ``stock`` (also a layer its backend
    has not packed yet: packing happens on a layer's first call)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            forward = module.__dict__.get("forward")
            packed = getattr(forward, "_weight", None) if isinstance(forward, _PackedLinear) else None
            if packed is None:
                name = "stock"
            elif isinstance(forward, _SkinnyLinear):
                name = skinny.packed_format(packed)
            else:
                name = forward.backend
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def skinny_available() -> bool:
    """The skinny kernel builds (or is built) on this machine (``selfspec.runtime.skinny``)."""
    return skinny.available()


def module_backend(module: nn.Module) -> str:
    """The backend one linear layer runs on now: ``stock``, ``onednn`` or ``skinny``."""
    current = module.__dict__.get("forward")
    return current.backend if isinstance(current, _PackedLinear) else "stock"


def linear_backend_of(model: nn.Module) -> str:
    """The backend ``set_linear_backend`` last put on ``model`` (``"stock"`` if never called)."""
    return getattr(model, _STATE, "stock")


def set_linear_backend(model: nn.Module, backend: str = "auto", *, sizes: tuple[int, ...] | None = None,
                       remeasure: bool = False) -> str:
    """Run ``model``'s linear layers on ``backend`` (in place); returns the backend now in effect.

    Args:
        backend: ``stock`` (PyTorch's default ``F.linear``), ``onednn``, ``skinny`` (``selfspec.runtime.skinny``), or
            ``auto``: for a float32 CPU model, the one of those available here whose forwards of ``sizes`` tokens
            (default ``AUTO_SIZES``: a plain step and the trees drafters verify) cost least in total, measured
            once per CPU, model, sizes and kernel build and cached (``remeasure`` measures again); ``stock``
            otherwise. Where ``auto`` picks ``skinny`` it also measures a prompt's prefill on the kernel against
            PyTorch's GEMM and lets the kernel take every row count where it wins (``skinny.MAX_ROWS``; an explicit
            ``skinny`` keeps prefill on PyTorch's GEMM). Each layer keeps the packed weights of every backend it
            has run on (a copy of the weights per backend), so switching back is free. Every backend but
            ``stock`` also switches an ``sdpa`` model's attention: ``onednn`` to ``attention.GQA_SDPA``,
            ``skinny`` to ``attention.SKINNY_ATTENTION``.

    Raises:
        ValueError: an unknown backend, ``onednn`` where this PyTorch build has no oneDNN, or ``skinny`` where the
            kernel cannot be built (the message says why).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "onednn" and not onednn_available():
        raise ValueError("this PyTorch build has no oneDNN (torch.backends.mkldnn); use --linear-backend stock")
    if backend == "skinny" and not skinny_available():
        raise ValueError(f"the skinny kernel is not available here: {skinny.unavailable_reason()}; it needs a C++ "
                         "compiler and the ninja package; use --linear-backend onednn or stock")
    auto = backend == "auto"
    if auto:
        backend = _choose(model, tuple(sizes) if sizes else AUTO_SIZES, remeasure)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            set_module_backend(module, backend)
    # The kernels of a backend include its attention: grouped-query SDPA for masked forwards (attention.GQA_SDPA),
    # and on skinny the few-query attention kernel too (attention.SKINNY_ATTENTION); "stock" is PyTorch and
    # transformers as shipped.
    use_attention(model, {"stock": None, "skinny": SKINNY_ATTENTION}.get(backend, GQA_SDPA))
    # and on skinny, Llama-family decoder layers run a lean forward over the same kernels (selfspec.runtime.lean)
    use_lean_layers(model, enabled=backend == "skinny")
    setattr(model, _STATE, backend)
    if auto and backend == "skinny":
        # and whether prompts' prefill runs faster on the kernel too (measured once per CPU, model, kernel build)
        skinny.MAX_ROWS = _prefill_rows(model, remeasure)
        # and which tile shape computes 15-16 rows faster here (the same)
        skinny.set_wide_tiles(_wide_tiles(model, remeasure))
        # and whether small tiles should prefetch their next tile's weights here (the same)
        skinny.set_small_prefetch(_small_prefetch(model, remeasure))
    return backend


def set_module_backend(module: nn.Linear, backend: str) -> None:
    """Run one linear layer on ``backend`` (``stock``, ``onednn``, ``skinny`` or ``SKINNY_HALF``; no availability
    check: see ``set_linear_backend``)."""
    current = module.__dict__.get("forward")
    if isinstance(current, _PackedLinear) and current.backend != backend:
        del module.forward  # back to nn.Linear.forward
        current = None
    if backend in _KERNELS and current is None:
        # One kernel object per layer and backend, kept: switching back and forth does not repack.
        kernels = module.__dict__.setdefault(_KERNEL_CACHE, {})
        module.forward = kernels.setdefault(backend, _KERNELS[backend](module))


def set_draft_weights(dtype: str) -> None:
    """What drafters' own linear layers read where the base runs on ``skinny``: ``"float16"`` (the default) or
    ``"float32"`` copies of their weights, or the weights rounded to a ``"q8_0"`` or ``"q4_1"`` block grid (1.1 /
    0.75 bytes a weight: a draft step streams less; what is accepted may change, never what is output). Takes effect
    at the next ``begin`` of a drafter (and the next call of a layer already on the draft kernels).

    Raises:
        ValueError: another dtype.
    """
    global _draft_weights
    if dtype not in DRAFT_WEIGHTS:
        raise ValueError(f"draft weights {dtype!r}: choose one of {', '.join(DRAFT_WEIGHTS)}")
    _draft_weights = dtype


def draft_weights() -> str:
    return _draft_weights


@contextlib.contextmanager
def using_draft_weights(dtype: str | None) -> Iterator[str]:
    """``set_draft_weights(dtype)`` inside the block, the previous choice restored after it; None leaves the choice
    as it is (a drafter without draft weights of its own). Each drafter layer keeps the copy it last packed, so two
    drafters that switch like this each repack once (a layer two of them share, such as a base model's LM head, would
    repack at every switch)."""
    previous = _draft_weights
    if dtype is None:
        yield previous
        return
    set_draft_weights(dtype)
    try:
        yield dtype
    finally:
        set_draft_weights(previous)


def check_draft_weights(dtype: str | None, owner: str) -> None:
    """A drafter's own ``draft_weights`` option, checked where it is given (None: the process-wide choice).

    Raises:
        ValueError: not one of ``DRAFT_WEIGHTS``; the message starts with ``owner`` (e.g. ``eagle drafter``).
    """
    if dtype is not None and dtype not in DRAFT_WEIGHTS:
        raise ValueError(f"{owner}: draft_weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {dtype!r}")


def draft_backend(backend: str) -> str:
    """The backend a drafter's layers run on when the base runs on ``backend``: ``skinny`` on the draft weights
    (``SKINNY_HALF``) unless ``set_draft_weights("float32")``; other backends as they are."""
    return SKINNY_HALF if backend == "skinny" and _draft_weights != "float32" else backend


def follow_backend(model: nn.Module, layers: Callable[[], Iterable[nn.Linear]], current: str) -> str:
    """Put a drafter's own linear ``layers()`` on the backend of drafts where ``model`` runs (``draft_backend``),
    when it differs from ``current`` (what they were last put on); returns it, the new ``current``."""
    backend = draft_backend(linear_backend_of(model))
    if backend != current:
        for layer in layers():
            set_module_backend(layer, backend)
    return backend


@contextlib.contextmanager
def drafting_with(modules: Iterable[nn.Linear]) -> Iterator[None]:
    """Inside the block, the base model's ``modules`` run as a draft's layers (an early exit's shallow layers): on
    the draft weights (``SKINNY_HALF``) where they run on ``skinny`` and draft weights are not float32; back on their
    own panels after it, whatever happens inside. Each keeps both packed copies, so switching is cheap."""
    switched = []
    if _draft_weights != "float32":
        for module in modules:
            if module_backend(module) == "skinny":
                kernels = module.__dict__[_KERNEL_CACHE]
                if SKINNY_HALF not in kernels:
                    kernels[SKINNY_HALF] = _SkinnyHalfLinear(module)
                switched.append((module.__dict__, kernels["skinny"], kernels[SKINNY_HALF]))
    # the kernel objects swapped straight in the modules' __dict__ (what set_module_backend ends with), per draft
    for slots, _, half in switched:
        slots["forward"] = half
    try:
        yield
    finally:
        for slots, full, _ in switched:
            slots["forward"] = full


@contextlib.contextmanager
def linear_backend(model: nn.Module, backend: str) -> Iterator[str]:
    """Use ``backend`` inside the block, then restore the previous one."""
    previous = linear_backend_of(model)
    try:
        yield set_linear_backend(model, backend)
    finally:
        set_linear_backend(model, previous)


#: token counts ``auto`` times by default: a plain step and the trees drafters usually verify on a CPU
AUTO_SIZES = (1, 4, 8)
#: prompt length ``auto`` times a prefill at, on the skinny kernel against PyTorch's GEMM
PREFILL_PROBE = 128
_CHOICES_FILE = "backend-choices.json"


def cpu_signature() -> dict:
    """What decides which kernels win: the processor's model name and vector extensions, the core count torch
    uses, and the torch build."""
    import platform

    fields = skinny.cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    vector = sorted(f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile",
                                              "amx_bf16"))
    return {"cpu": name, "flags": vector, "threads": torch.get_num_threads(), "torch": torch.__version__}


def machine_class(device: torch.device | str | None = None) -> str:
    """The coarse kind of machine a drafting policy is calibrated for (``decoding.by_machine``): what a
    tree and a draft step cost depends first on the vector unit, so a CPU is classed by its widest vector extension
    (``x86_64-avx2``, ``x86_64-avx512``, and ``x86_64-avx512-amx`` where AMX tiles sit beside AVX-512; else the
    architecture, e.g. ``aarch64``) and any other device by its type (``cuda``). Coarse on purpose: a class must
    recur across machines to be worth a saved policy; ``selfspec calibrate`` finds the best one for a given machine.
    Where there is no /proc/cpuinfo (macOS, Windows), PyTorch's own reading of the CPU decides."""
    import platform

    if device is not None and torch.device(device).type != "cpu":
        return torch.device(device).type
    arch = platform.machine().lower() or "cpu"
    arch = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    flags = set(skinny.cpuinfo_fields().get("flags", "").split())
    if not flags:  # no /proc/cpuinfo: torch's capability ("AVX512", "AVX2", ...)
        capability = str(torch.backends.cpu.get_cpu_capability()).lower()
        flags = {"avx512f"} if capability.startswith("avx512") else {"avx2"} if capability == "avx2" else set()
    if "avx512f" in flags:
        return f"{arch}-avx512-amx" if "amx_tile" in flags else f"{arch}-avx512"
    return f"{arch}-avx2" if "avx2" in flags else arch


def _choice_key(model: nn.Module, sizes: tuple[int, ...]) -> str:
    import hashlib
    import json

    from selfspec.runtime.identity import base_model_identity

    identity = base_model_identity(model)
    # The skinny kernel's build (source and flags) is part of the key: a rebuilt kernel is measured again.
    text = json.dumps({**cpu_signature(), "model": identity.get("fingerprint"), "sizes": list(sizes),
                       "skinny": skinny.build_key()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _choose(model: nn.Module, sizes: tuple[int, ...] = AUTO_SIZES, remeasure: bool = False) -> str:
    """The backend whose forwards of ``sizes`` tokens (after a 256-token prefix) cost least in total, measured
    once per machine, model and size set and kept in ``$SELFSPEC_HOME/kernels/backend-choices.json`` with the
    measured curve (``remeasure`` or ``SELFSPEC_REMEASURE=1`` measures again)."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu" or params.dtype != torch.float32:
        return "stock"
    candidates = ["stock"] + (["onednn"] if onednn_available() else []) + (["skinny"] if skinny_available() else [])
    if len(candidates) == 1:
        return "stock"
    sizes = tuple(sorted(set(int(n) for n in sizes) | {1}))
    key = _choice_key(model, sizes)
    entry = _recorded_choice(key, remeasure)
    if entry is not None and entry.get("backend") in candidates:
        return entry["backend"]
    curves = measure_backends(model, candidates, sizes)
    total = {b: sum(curve.values()) for b, curve in curves.items()}
    best = min(candidates, key=total.__getitem__)
    _record_choice(key, {"backend": best, **cpu_signature(), "sizes": list(sizes),
                         "ms": {b: {str(n): round(1000 * t, 3) for n, t in curve.items()}
                                for b, curve in curves.items()}})
    return best


def _recorded_choice(key: str, remeasure: bool = False) -> dict | None:
    """The entry ``key`` of ``$SELFSPEC_HOME/kernels/backend-choices.json``; None when there is none, the file
    is unreadable, or ``remeasure`` / ``SELFSPEC_REMEASURE=1`` asks to measure again."""
    import json
    import os

    from selfspec.runtime.io import cache_home

    if remeasure or os.environ.get("SELFSPEC_REMEASURE") == "1":
        return None
    try:
        entry = json.loads((cache_home() / "kernels" / _CHOICES_FILE).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) else None


def _record_choice(key: str, entry: dict) -> None:
    """Store ``entry`` under ``key`` in the choices file (read again under its lock, written atomically)."""
    import json

    from selfspec.runtime.io import atomic_write_text, cache_home, file_lock

    path = cache_home() / "kernels" / _CHOICES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        try:
            known = json.loads(path.read_text())
        except (OSError, ValueError):
            known = {}
        known[key] = entry
        atomic_write_text(path, json.dumps(known, indent=1))


def _prefill_rows(model: nn.Module, remeasure: bool = False) -> int:
    """``skinny.PREFILL_ROWS`` where a ``PREFILL_PROBE``-token prefill of ``model`` ran faster with the skinny
    kernel taking every row than with PyTorch's GEMM taking those above ``skinny.DECODE_ROWS`` (best of three,
    interleaved), else ``DECODE_ROWS``; measured once per CPU, model and kernel build, kept beside the backend
    choice."""
    from selfspec.runtime.cache import new_cache

    key = _choice_key(model, (PREFILL_PROBE,)) + "-prefill"
    entry = _recorded_choice(key, remeasure)
    if entry is not None and entry.get("rows") in (skinny.DECODE_ROWS, skinny.PREFILL_ROWS):
        return entry["rows"]
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, PREFILL_PROBE), generator=torch.Generator().manual_seed(0))

    def prefill(_) -> float:
        cache = new_cache(model, PREFILL_PROBE + 8)  # untimed
        return seconds(lambda: model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1))

    previous = skinny.MAX_ROWS
    try:
        with torch.inference_mode():
            best = best_of({rows: lambda rows=rows: setattr(skinny, "MAX_ROWS", rows)
                            for rows in (skinny.DECODE_ROWS, skinny.PREFILL_ROWS)}, prefill)
    finally:
        skinny.MAX_ROWS = previous
    chosen = min(best, key=best.__getitem__)
    _record_choice(key, {"rows": chosen, **cpu_signature(), "prefill_tokens": PREFILL_PROBE,
                         "ms": {str(rows): round(1000 * t, 3) for rows, t in best.items()}})
    return chosen


#: the tree size ``auto`` times both 15-16-row tile shapes at
WIDE_TILE_PROBE = 16


def _tuned_switch(model: nn.Module, name: str, field: str, settings: dict, apply: Callable[[object], object],
                  restore: object, tokens: tuple[int, ...], remeasure: bool = False):
    """The value of one kernel switch (``settings``: label -> value, set by ``apply``) under which forwards of
    ``tokens`` tokens over a 256-token cache cost least in total (best of five, interleaved; every value gives the
    same results), measured once per CPU, model and kernel build and kept beside the backend choice under key suffix
    ``-name`` and entry ``field``. Each forward streams the whole model, so the weights arrive from memory as in
    decoding. The switch is left at ``restore`` after measuring, whatever happened."""
    key = _choice_key(model, tokens) + f"-{name}"
    entry = _recorded_choice(key, remeasure)
    if entry is not None and any(type(entry.get(field)) is type(v) and entry[field] == v for v in settings.values()):
        return entry[field]
    try:
        curves = time_forwards(model, {label: lambda v=value: apply(v) for label, value in settings.items()}, tokens,
                               rounds=5)
    finally:
        apply(restore)
    total = {label: sum(curve.values()) for label, curve in curves.items()}
    chosen = settings[min(total, key=total.__getitem__)]
    _record_choice(key, {field: chosen, **cpu_signature(), "tokens": list(tokens),
                         "ms": {label: {str(n): round(1000 * t, 3) for n, t in curve.items()}
                                for label, curve in curves.items()}})
    return chosen


def _wide_tiles(model: nn.Module, remeasure: bool = False) -> str:
    """The tile shape (``skinny.WIDE_TILES``) under which a ``WIDE_TILE_PROBE``-token forward of ``model`` ran
    faster (``_tuned_switch``). ``"16x1"`` without AVX-512 (no choice there)."""
    if skinny.set_wide_tiles("12x2") != "12x2":
        return "16x1"
    skinny.set_wide_tiles("16x1")
    return _tuned_switch(model, "wide-tiles", "tiles", {plan: plan for plan in skinny.WIDE_TILES},
                         skinny.set_wide_tiles, "16x1", (WIDE_TILE_PROBE,), remeasure)


#: the forwards ``auto`` times small tiles' prefetch at: a plain step and a 2-token tree (1-2 rows run as 1- and
#: 2-row tiles; 3 rows on take 8-row tiles, which always prefetch)
SMALL_PREFETCH_PROBE = (1, 2)


def _small_prefetch(model: nn.Module, remeasure: bool = False) -> bool:
    """Whether tiles of 1-4 rows software-prefetch here (``skinny.set_small_prefetch``): the setting under which
    forwards of ``SMALL_PREFETCH_PROBE`` tokens cost less in total (``_tuned_switch``)."""
    return _tuned_switch(model, "small-prefetch", "prefetch", {"off": False, "on": True}, skinny.set_small_prefetch,
                         skinny.SMALL_PREFETCH_DEFAULT, SMALL_PREFETCH_PROBE, remeasure)


#: the batch ``batch_backend`` times (rows, tokens): a training batch's shape, thousands of rows per linear
BATCH_PROBE = (4, 256)


def batch_backend(model: nn.Module, remeasure: bool = False) -> str:
    """The faster of ``stock`` and ``onednn`` for no-grad forwards of whole batches: what a training recipe runs the
    frozen base for (its features and the teacher's distribution). These are GEMMs of thousands of rows, where the
    two GEMM libraries inside PyTorch differ by machine (the skinny kernel, built for decoding's few rows, is not a
    candidate here, though it can take a prompt's prefill: ``_prefill_rows``): on the Zen 5 EPYC of
    docs/RESULTS.md, MKL's float32 GEMM reaches ~180 GFLOPS and oneDNN's ~390, and the base's feature pass ran
    1.7x faster on oneDNN. So it is measured, not assumed: the best of three interleaved forwards of a
    ``BATCH_PROBE`` batch on each, once per CPU and model, kept beside the decode choice
    (``SELFSPEC_REMEASURE=1`` or ``remeasure`` measures again). The two agree to float32 rounding. ``stock``
    where oneDNN is missing or the model is not float32 on the CPU."""
    params = next(model.parameters(), None)
    if (params is None or params.device.type != "cpu" or params.dtype != torch.float32
            or not onednn_available()):
        return "stock"
    key = _choice_key(model, BATCH_PROBE) + "-batch"
    entry = _recorded_choice(key, remeasure)
    if entry is not None and entry.get("backend") in ("stock", "onednn"):
        return entry["backend"]
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, BATCH_PROBE, generator=torch.Generator().manual_seed(0))
    previous = linear_backend_of(model)
    backends = {backend: lambda backend=backend: set_linear_backend(model, backend) for backend in ("stock", "onednn")}
    decoder = model.get_decoder()
    try:
        with torch.inference_mode():
            for switch in backends.values():  # warm-up: first calls pack weights and pick primitives
                switch()
                decoder(input_ids=ids[:1, :16], use_cache=False)
            best = best_of(backends, lambda _: seconds(lambda: decoder(input_ids=ids, use_cache=False)))
    finally:
        set_linear_backend(model, previous)
    chosen = min(best, key=best.__getitem__)
    _record_choice(key, {"backend": chosen, **cpu_signature(), "batch": list(BATCH_PROBE),
                         "ms": {b: round(1000 * t, 3) for b, t in best.items()}})
    return chosen


@torch.inference_mode()
def measure_backends(model: nn.Module, backends: list[str], sizes: tuple[int, ...], prefix: int = 256,
                     rounds: int = 3) -> dict[str, dict[int, float]]:
    """``{backend: {tokens: seconds}}`` (``time_forwards`` with each backend switched on in turn); the model is left
    on the backend it had."""
    previous = linear_backend_of(model)
    try:
        return time_forwards(model, {b: lambda b=b: set_linear_backend(model, b) for b in backends}, sizes,
                             prefix=prefix, rounds=rounds)
    finally:
        set_linear_backend(model, previous)


@torch.inference_mode()
def time_forwards(model: nn.Module, settings: dict[str, Callable[[], object]], sizes: tuple[int, ...],
                  prefix: int = 256, rounds: int = 3) -> dict[str, dict[int, float]]:
    """``{setting: {tokens: seconds}}``: the best of ``rounds`` interleaved forwards of each size over a
    ``prefix``-token cache under each setting (``settings[name]()`` switches it on), rolled back after every forward
    (one slow moment of a busy machine decides nothing). What ``auto`` measures backends and tile shapes with."""
    from selfspec.runtime.cache import crop, new_cache

    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model, prefix + max(sizes))
    model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)

    def forward(key: tuple[str, int]) -> float:
        n = key[1]
        try:
            return seconds(lambda: model(input_ids=ids[:, prefix:prefix + n], cache=cache, use_cache=True))
        finally:
            crop(cache, prefix)

    best = best_of({(name, n): switch for name, switch in settings.items() for n in sizes}, forward, rounds)
    return {name: {n: best[(name, n)] for n in sizes} for name in settings}


def seconds(call: Callable[[], object]) -> float:
    """How long ``call()`` took, by the wall clock."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def best_of(settings: dict, run: Callable[[object], float], rounds: int = 3) -> dict:
    """``{key: seconds}``: the least of ``rounds`` results of ``run(key)`` (the seconds its work took; any setup
    it needs left untimed) under each setting, ``settings[key]()`` switching it on, the settings interleaved round
    by round: one slow moment of a busy machine decides nothing, and a drift in its speed falls on every setting
    alike. Every probe of ``auto`` times with it (backends, tile shapes, prefetch, prefill rows, batch GEMMs)."""
    best = dict.fromkeys(settings, float("inf"))
    for _ in range(rounds):
        for key, switch in settings.items():
            switch()
            best[key] = min(best[key], run(key))
    return best
