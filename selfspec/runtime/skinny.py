"""The skinny-GEMM kernel (``selfspec/runtime/csrc/skinny_linear.cpp``): float32 linear layers for the 1 to ~24 rows of a
decode step, compiled for this CPU on first use.

The extension is built with PyTorch's ``cpp_extension`` (a C++ compiler and ``ninja`` are needed) into
``$SELFSPEC_HOME/kernels/skinny-<key>``, where the key covers the source, the compiler flags, the PyTorch version and
the CPU's feature flags (``-march=native`` code must never run on another CPU). Concurrent first uses wait for one
build (PyTorch's build lock). Where it cannot be built, ``available()`` is False, ``unavailable_reason()`` says why,
and ``selfspec.runtime.kernels`` keeps its other backends.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from selfspec.runtime.io import cache_home

SOURCE = Path(__file__).with_name("csrc") / "skinny_linear.cpp"
CFLAGS = ("-O3", "-march=native", "-fno-math-errno")  # not -ffast-math: the attention's exp needs IEEE rounding
# ``at::parallel_for`` is a header template: it runs the kernel on PyTorch's OpenMP threads only when *this* file is
# compiled with OpenMP; without the flag every call ran on one core (half the machine, on a 2-core VM). The symbols
# resolve to the libgomp PyTorch itself loaded, so the kernel shares its thread pool and ``torch.set_num_threads``.
OPENMP_CFLAGS = ("-fopenmp",)
#: Rows a decode step or a draft tree brings; above ``MAX_ROWS`` a call goes to PyTorch's own GEMM.
DECODE_ROWS = 24
#: What ``MAX_ROWS`` becomes where a prompt's prefill measured faster on this kernel than on PyTorch's GEMM
#: (``selfspec.runtime.kernels``, ``auto``: 2.2x on a 2-core Zen 5, whose MKL reaches 40% of the FMA peak). Each row
#: is computed alone, so a prefill on it gives every position exactly what decoding would.
PREFILL_ROWS = 4096
#: Above this many rows a call goes to PyTorch's own GEMM (set by ``kernels.set_linear_backend(model, "auto")``).
MAX_ROWS = DECODE_ROWS

_lock = threading.Lock()
_module = None
_error: str | None = None


def cpuinfo_fields(text: str | None = None) -> dict[str, str]:
    """The first processor's ``key: value`` fields of ``/proc/cpuinfo`` (or of ``text``); empty where there is none.
    The one reader of that file: the build key (``_cpu_flags``), ``kernels.cpu_signature`` and the CPU names figures
    carry (``selfspec.bench.cost.describe_cpu``)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break  # a blank line ends the first processor's block
            continue
        fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_flags() -> str:
    """The vector extensions a build is for (x86 ``flags``, Arm ``Features``): part of the build key."""
    fields = cpuinfo_fields()
    flags = fields.get("flags") or fields.get("Features")
    return f"flags: {flags}" if flags else platform.processor()


# Every multiply-add of the kernels is one fused multiply-add wherever the ISA has it, in every tile shape. GCC's
# tuning for AMD Zen (-march=native there) splits FMAs in chains of dependent accumulations into a multiply and an add,
# which rounds twice, but only where its heuristic sees such a chain: on a Zen 3 the one-row float32 tile summed
# `x * w` with two roundings and the tiles of two or more rows with one, so a token's outputs depended on how many
# rows shared its call. That breaks what lossless verification rests on (a row computes the same bits alone, in a
# tree or in a batch). ``avoid-fma-max-bits=0`` turns the heuristic off; ``-ffp-contract=fast`` (GCC's default) says
# the same to clang, which has no such heuristic.
CONTRACT_CFLAGS = ("-ffp-contract=fast",)
GCC_CONTRACT_CFLAGS = ("--param=avoid-fma-max-bits=0",)


@functools.lru_cache(maxsize=None)
def _compiler_is_gcc() -> bool:
    """Whether the compiler ``cpp_extension`` runs (``$CXX``, else ``c++``) is GCC: only it takes ``--param``."""
    import subprocess

    try:
        banner = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True,
                                timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" not in banner.lower() and ("free software foundation" in banner.lower() or "g++" in banner)


def cflags() -> tuple[str, ...]:
    """The compiler flags of this build: OpenMP where PyTorch's own parallel backend is OpenMP (Linux wheels), and
    one rounding per multiply-add everywhere (``CONTRACT_CFLAGS``)."""
    uses_openmp = torch.backends.openmp.is_available() and sys.platform.startswith("linux")
    return (CFLAGS + CONTRACT_CFLAGS + (GCC_CONTRACT_CFLAGS if _compiler_is_gcc() else ())
            + (OPENMP_CFLAGS if uses_openmp else ()))


def build_key() -> str:
    """What the compiled module depends on, hashed: source, flags, PyTorch, Python and the CPU's features."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(cflags()).encode(), torch.__version__.encode(),
                 platform.python_version().encode(), platform.machine().encode(), _cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def clear_stale_build_lock(directory: Path) -> bool:
    """Remove the ``lock`` file PyTorch's ``cpp_extension`` leaves in a build ``directory`` when the process that
    was building there is killed (Ctrl-C, OOM, a timeout): every later build would wait on it forever. A lock is
    stale when none of the processes that announced a build there (``building-<pid>`` files, written by
    ``compile_extension``) is alive, or, with no announcement (a build by another tool), when it is older than an
    hour. Returns whether a lock was removed."""
    import time
    import warnings

    lock = directory / "lock"
    if not lock.exists():
        return False
    owners = [int(f.name.split("-", 1)[1]) for f in directory.glob("building-*") if f.name.split("-", 1)[1].isdigit()]
    if owners:
        if any(_alive(pid) for pid in owners):
            return False
    else:
        try:
            if time.time() - lock.stat().st_mtime < 3600:
                return False
        except FileNotFoundError:
            return False
    for pid in owners:
        (directory / f"building-{pid}").unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    warnings.warn(f"removed a stale build lock in {directory} (left by a killed build); building again", stacklevel=3)
    return True


def compile_extension(name: str, source: Path, flags: list[str], directory: Path):
    """Compile ``source`` with PyTorch's ``cpp_extension`` into ``directory`` and import it as ``name``, with the
    ninja of this virtualenv on ``PATH`` (it need not be: ``.venv/bin/python ...``). Also used by
    ``scripts/kernel_ab.py`` to build two versions of the kernel side by side. A lock left by a killed build is
    removed first (``clear_stale_build_lock``)."""
    from torch.utils import cpp_extension

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_build_lock(directory)
    announce = directory / f"building-{os.getpid()}"
    announce.touch()
    path = os.environ.get("PATH", "")
    try:
        import ninja  # the PyPI package: its binary is in the venv
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    except ImportError:
        pass  # a system ninja may still be on PATH; cpp_extension says so if not
    try:
        return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(flags),
                                  build_directory=str(directory), verbose=False)
    finally:
        os.environ["PATH"] = path
        announce.unlink(missing_ok=True)


def _build():
    directory = cache_home() / "kernels" / f"skinny-{build_key()}"
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob("*.so")):
        print("selfspec: building the skinny linear kernel for this CPU (once per machine, about a minute)",
              file=sys.stderr, flush=True)
    return compile_extension("selfspec_skinny_linear", SOURCE, list(cflags()), directory)


def extension():
    """The compiled module (built on first call).

    Raises:
        RuntimeError: it cannot be built here (no compiler, no ninja, not an x86/ARM CPU...), with the reason.
    """
    global _module, _error
    with _lock:
        if _module is None and _error is None:
            try:
                _module = _build()
            except Exception as e:  # compiler missing, build failure, ninja missing: all mean "not here"
                _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        if _module is None:
            raise RuntimeError(f"the skinny linear kernel could not be built on this machine ({_error}); it needs a "
                               "C++ compiler (g++) and the ninja package (pip install ninja). Use "
                               "--linear-backend onednn or stock instead")
        return _module


def available() -> bool:
    """The kernel is built (or builds now) on this machine."""
    try:
        extension()
    except RuntimeError:
        return False
    return True


def unavailable_reason() -> str | None:
    return None if available() else _error


def pack(weight: torch.Tensor, half: bool = False) -> torch.Tensor:
    """``[out, in]`` float32 weight -> the kernel's panel layout (a new tensor; the parameter is untouched). ``half``:
    float16 panels (rounded to nearest), which ``linear`` widens to float32 as it loads them: half the memory a call
    streams, for drafters' layers only (a draft only proposes; the verified model keeps float32)."""
    return extension().pack(weight.detach(), half)


#: inputs per block of the exact grids (llama.cpp's Q4_1 and Q8_0 blocks)
GRID_BLOCK = 32
#: whether ``pack_exact`` may store a weight as the block grid it lies on (``False``: always float32 panels)
EXACT_GRIDS = True


def q4_1_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(d, m, q)`` such that ``d * q + m``, computed in float32, is ``weight`` bit for bit (``d``, ``m``: float32,
    one pair per 32 consecutive inputs of an output, ``[out, in / 32]``; ``q``: integers 0..15, ``[out, in]``), or
    ``None`` where the weight is not on such a grid (every float32 checkpoint not made from a quantized file).

    Two kinds of file put weights on such a grid, and the grid is found from the float32 values alone:

    - Q4_1: ``d`` and ``m`` are float16. ``m`` is the block's minimum (its own weight, q = 0) and ``d`` the float16
      step nearest ``(max - m) / 15``, or one of its neighbours.
    - Q4_K (llama.cpp's k-quant; Gemma 3's GGUF holds some): each 32-input sub-block is ``D * q - M`` with
      ``D = d * sc`` and ``M = dmin * mn`` (float16 times a 6-bit integer: at most 17 significant bits, products
      exact in float32), so ``D * q`` is exact and the one rounding is that of the sum, as in the kernel
      (``_k_quant_blocks``).

    Every weight is checked against the rebuilt value either way."""
    out_features, in_features = weight.shape
    if in_features % GRID_BLOCK or weight.numel() == 0:
        return None
    blocks = weight.reshape(-1, GRID_BLOCK)
    m = blocks.amin(-1, keepdim=True)
    span = blocks.amax(-1, keepdim=True) - m
    if not (torch.isfinite(m).all() and torch.isfinite(span).all()):
        return None
    d, q = torch.zeros_like(m), torch.zeros_like(blocks)
    found = torch.zeros_like(m, dtype=torch.bool)
    if torch.equal(m.half().float(), m) and span.max() <= 15 * torch.finfo(torch.float16).max:
        nearest = (span / 15).half()
        for step in (0, 1, -1, 2, -2):  # float16 steps around the nearest
            candidate = (nearest.view(torch.int16) + step).view(torch.float16).float()
            if step and (candidate < 0).any():
                candidate = candidate.clamp_min(0)
            _try_affine(blocks, candidate, m, found, d, q)
            if found.all():
                break
    if not found.all() and not _k_quant_blocks(blocks, m, span, found, d, q):
        return None
    return d.view(out_features, -1), m.view(out_features, -1), q.reshape(out_features, in_features).to(torch.uint8)


def _try_affine(blocks: torch.Tensor, d: torch.Tensor, m: torch.Tensor, found: torch.Tensor, d_out: torch.Tensor,
                q_out: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Where ``d * q + m`` (``q`` the nearest levels 0..15) rebuilds every weight of a block bit for bit and the
    block has no grid yet, record ``d`` and ``q`` and mark it ``found``. ``blocks`` ``[n, 32]``; ``rows``: only
    those blocks, ``d`` and ``m`` given per row of ``rows`` (default: every block, ``d`` and ``m`` ``[n, 1]``).
    Returns which of them it found (a bool per block tried)."""
    values = blocks if rows is None else blocks[rows]
    levels = torch.round((values - m) / torch.where(d > 0, d, 1.0)).clamp(0, 15) + 0.0  # + 0.0: no -0.0 level
    rebuilt = d * levels + m  # compared bit for bit: -0.0 is not 0.0 here
    hit = (rebuilt.view(torch.int32) == values.view(torch.int32)).all(-1)
    hit &= ~(found if rows is None else found[rows]).squeeze(-1)
    where = hit.nonzero().squeeze(-1) if rows is None else rows[hit]
    d_out[where] = d[hit]
    q_out[where] = levels[hit]
    found[where] = True
    return hit


_NEGATIVE_ZERO = -(2 ** 31)  # the bits of -0.0 as an int32

#: the k-quant search gives up where more than this share of blocks is left after trying top levels 15..TOP_CHECK
KQ_LEFT_AT_CHECK, TOP_CHECK = 0.5, 13

#: float32 mantissa bits below the 17 significant bits of a k-quant scale (float16 x 6-bit integer)
_BELOW_17_BITS = 0x7F


def _round_bits(x: torch.Tensor, below: int, step: int = 0) -> torch.Tensor:
    """``x`` (float32) rounded to the significant bits above the mantissa mask ``below`` (``_BELOW_17_BITS``,
    ``_BELOW_19_BITS``), then moved ``step`` units of the last bit kept."""
    unit = below + 1
    return (((x.view(torch.int32) + unit // 2) & ~below) + step * unit).view(torch.float32)


def _zero_sign(blocks: torch.Tensor) -> torch.Tensor:
    """Per block, -1.0 where it holds a -0.0 weight (a symmetric grid with a negative scale rebuilds its zeros so,
    and only so), else 1.0."""
    return torch.where((blocks.view(torch.int32) == _NEGATIVE_ZERO).any(-1, keepdim=True), -1.0, 1.0)


def _k_quant_blocks(blocks: torch.Tensor, m: torch.Tensor, span: torch.Tensor, found: torch.Tensor, d: torch.Tensor,
                    q: torch.Tensor) -> bool:
    """Fill the blocks not yet ``found`` with a Q4_K sub-block grid (``q4_1_grid``): ``m = -M`` and ``D`` of at most
    17 significant bits. Most sub-blocks hold a weight of level 0 (their minimum is ``-M``) and one of level 15 or
    a little less (``D`` is about the span over that level); in the rest (64 of Gemma 3 270M's 737,280) the
    lowest level is 1-3, and ``M`` is searched near ``D * level - minimum`` too (their ``m`` is overwritten with
    ``-M``). Returns whether every block has its grid; gives up at once on weights whose block minima are not
    17-bit numbers (no k-quant file made them)."""
    rows = (~found).squeeze(-1).nonzero().squeeze(-1)
    minima = m[rows]
    if ((minima.view(torch.int32) & _BELOW_17_BITS) != 0).float().mean() > 0.05:
        return False
    tried = rows.numel()
    for top in range(15, 0, -1):  # the level of the block's largest weight
        if rows.numel() == 0:
            return True
        estimate = span[rows] / top
        for step in (0, 1, -1, 2, -2):
            _try_affine(blocks, _round_bits(estimate, _BELOW_17_BITS, step).clamp_min(0), minima, found, d, q, rows)
        keep = ~found[rows].squeeze(-1)
        rows, minima = rows[keep], m[rows[keep]]
        if top == TOP_CHECK and rows.numel() > tried * KQ_LEFT_AT_CHECK:
            return False  # not a k-quant grid (another grid of float16 steps, say Q5_0): no long search
    for low in (1, 2, 3):  # no weight of level 0: the minimum is D * low - M
        for top in range(15, low, -1):
            if rows.numel() == 0:
                return True
            for step in (0, 1, -1, 2, -2):
                scale = _round_bits(span[rows] / (top - low), _BELOW_17_BITS, step).clamp_min(0)
                for shift in (0, 1, -1):
                    offset = _round_bits(m[rows] - scale * low, _BELOW_17_BITS, shift)
                    hit = _try_affine(blocks, scale, offset, found, d, q, rows)
                    m[rows[hit]] = offset[hit]
            keep = ~found[rows].squeeze(-1)
            rows = rows[keep]
    return rows.numel() == 0


def _symmetric_levels(values: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The integer levels (as floats, -127..127) that ``d * level`` rounds nearest to ``values``. ``+ 0.0``: a level
    of -0.0 would rebuild a -0.0 weight here, but it is stored as the integer 0 (+0.0 in the kernel). Where ``d``
    is zero (a block of a zero scale holds +0.0 and -0.0, the signs of its levels), the level is +-1: ``0 * -1``
    rebuilds a -0.0 as the file's ``0 * q`` did."""
    levels = torch.round(values / torch.where(d != 0, d, 1.0)).clamp(-127, 127) + 0.0
    return torch.where(d != 0, levels, torch.copysign(torch.ones_like(values), values))


def q8_0_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(d, q)`` such that ``d * q`` in float32 is ``weight`` bit for bit (``d``: float32, one per 32 consecutive
    inputs, ``[out, in / 32]``; ``q``: integers -127..127, ``[out, in]``), or ``None``. The symmetric block grids of
    GGUF files all have this form: Q8_0 (``d`` the block's largest magnitude over 127), Q5_0 (levels -16..15, ``d``
    that magnitude over 16) and Q4_0 (-8..7, over 8); ``d`` is float16 in each, the products exact."""
    out_features, in_features = weight.shape
    if in_features % GRID_BLOCK or weight.numel() == 0:
        return None
    blocks = weight.reshape(-1, GRID_BLOCK)
    largest = blocks.abs().amax(-1, keepdim=True)
    if not torch.isfinite(largest).all():
        return None
    d, q = torch.zeros_like(largest), torch.zeros_like(blocks)
    found = torch.zeros_like(largest, dtype=torch.bool)
    sign = _zero_sign(blocks)  # Q5_0 and Q4_0 scales are signed: the block's largest weight over -16 / -8
    for top in (127, 16, 8):  # Q8_0, Q5_0, Q4_0
        candidate = sign * largest / top + 0.0  # + 0.0: a zero scale is +0.0 (see _symmetric_levels)
        exact = torch.eq(candidate.half().float(), candidate)
        levels = _symmetric_levels(blocks, candidate)
        hit = exact & (candidate * levels).view(torch.int32).eq(blocks.view(torch.int32)).all(-1, keepdim=True) & ~found
        d, q = torch.where(hit, candidate, d), torch.where(hit, levels, q)
        found |= hit
        if found.all():
            return d.view(out_features, -1), q.reshape(out_features, in_features).to(torch.int8)
    return None


#: float32 mantissa bits below the 19 significant bits of a Q6_K scale (float16 x 8-bit integer)
_BELOW_19_BITS = 0x1F


def q6_k_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(d, q)`` such that ``d * q`` in float32 is ``weight`` bit for bit with one ``d`` per 16 consecutive inputs
    (``[out, in / 16]``, float32) and ``q`` integers -127..127 (``[out, in]``), or ``None``: llama.cpp's Q6_K, whose
    ``D = d * sc`` (float16 times a signed 8-bit scale: at most 19 significant bits) multiplies levels -32..31, the
    product rounded once in float32 as the kernel rounds it. ``D`` is found near the block's largest magnitude over
    its level (32, or a little less where the 8-bit scale rounded), signed where the block's zeros are -0.0."""
    out_features, in_features = weight.shape
    if in_features % GRID_BLOCK or weight.numel() == 0:
        return None
    blocks = weight.reshape(-1, GRID_BLOCK // 2)
    largest = blocks.abs().amax(-1, keepdim=True)
    if not torch.isfinite(largest).all():
        return None
    sign = _zero_sign(blocks)
    d, q = torch.zeros_like(largest), torch.zeros_like(blocks)
    found = torch.zeros_like(largest, dtype=torch.bool)
    rows = torch.arange(blocks.shape[0])
    for top in range(32, 15, -1):
        estimate = sign[rows] * largest[rows] / top
        for step in (0, 1, -1, 2, -2):
            candidate = _round_bits(estimate, _BELOW_19_BITS, step) + 0.0  # + 0.0: a zero scale is +0.0
            values = blocks[rows]
            levels = _symmetric_levels(values, candidate)
            hit = (candidate * levels).view(torch.int32).eq(values.view(torch.int32)).all(-1) & ~found[rows].squeeze(-1)
            d[rows[hit]], q[rows[hit]] = candidate[hit], levels[hit]
            found[rows[hit]] = True
        rows = rows[~found[rows].squeeze(-1)]
        if rows.numel() == 0:
            return d.view(out_features, -1), q.reshape(out_features, in_features).to(torch.int8)
        if top == 30 and rows.numel() > blocks.shape[0] // 2:
            return None  # not a Q6_K grid: no long search
    return None


def _panel_rows(t: torch.Tensor, lanes: int) -> torch.Tensor:
    """``[out, ...]`` -> ``[panels, lanes, ...]``, outputs past the end zero (a zero block rebuilds zero weights)."""
    panels = -(-t.shape[0] // lanes)
    padded = t.new_zeros((panels * lanes, *t.shape[1:]))
    padded[: t.shape[0]] = t
    return padded.view(panels, lanes, *t.shape[1:])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(*t.shape[:-1], -1)


def _grid_panels(kind: str, d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor, module) -> torch.Tensor:
    """The kernel's grid layout (uint8 ``[panels, in / 32, block bytes]``) of ``d`` (and ``m``) ``[out, in / 32]``
    (``[out, in / 16]`` for ``q6_k``; stored as float32) and ``q`` ``[out, in]`` levels (uint8 0..15 for ``q4_1``,
    int8 for ``q8_0`` and ``q6_k``)."""
    lanes = module.lanes()
    out_features, in_features = q.shape
    if kind != "q6_k":
        d = _panel_rows(d.float(), lanes).transpose(1, 2)  # [P, nb, L]
    if kind == "q4_1":
        m = _panel_rows(m.float(), lanes).transpose(1, 2)
        q = _panel_rows(q, lanes)  # [P, L, in]
        q = q.view(*q.shape[:2], -1, GRID_BLOCK // 2, 2)  # [P, L, nb, 16, 2]
        pairs = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1)  # [P, nb, 16, L]
        packed = torch.cat([_as_bytes(d), _as_bytes(m), pairs.reshape(*pairs.shape[:2], -1)], dim=-1)
    else:
        if kind == "q6_k":  # two scales a block: [P, L, nb, 2] -> [P, nb, 2 L] (all first halves' d, then seconds')
            d = _panel_rows(d.float().view(out_features, -1, 2), lanes).permute(0, 2, 3, 1).reshape(
                -(-out_features // lanes), in_features // GRID_BLOCK, 2 * lanes)
        q = _panel_rows(q, lanes).view(-1, lanes, in_features // GRID_BLOCK, GRID_BLOCK).permute(0, 2, 3, 1)
        packed = torch.cat([_as_bytes(d), _as_bytes(q).reshape(*q.shape[:2], -1)], dim=-1)
    if packed.shape[-1] != module.grid_block_bytes(kind):
        raise AssertionError(f"grid panels of {packed.shape[-1]} bytes a block for {kind}")
    return packed.contiguous()


def pack_grid(weight: torch.Tensor, module=None) -> tuple[str, torch.Tensor] | None:
    """``(kind, panels)`` where ``weight`` (float32 ``[out, in]``) lies exactly on a block grid of a GGUF file:
    ``q4_1`` (Q4_1 and Q4_K files; ``q4_1_grid``), ``q8_0`` (Q8_0, Q5_0, Q4_0; ``q8_0_grid``) or ``q6_k``
    (``q6_k_grid``). The kernel rebuilds every float32 weight bit for bit from the 6, 9 or 10 bits a weight it
    streams, so ``linear`` gives the float32 panels' outputs exactly, with 5.3x / 3.6x / 3.2x less memory traffic.
    ``None`` where the weight is on none of them (pack it with ``pack``). ``module``: another build of the kernel to
    pack for (its vector width), as the tests' AVX2 build; default this machine's."""
    weight = weight.detach()
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    module = module if module is not None else extension()
    grid = q4_1_grid(weight)
    if grid is not None:
        d, m, q = grid
        return "q4_1", _grid_panels("q4_1", d, m, q, module)
    grid = q8_0_grid(weight)
    if grid is not None:
        d, q = grid
        return "q8_0", _grid_panels("q8_0", d, None, q, module)
    grid = q6_k_grid(weight)
    if grid is None:
        return None
    d, q = grid
    return "q6_k", _grid_panels("q6_k", d, None, q, module)


#: what ``quantize`` rounds a weight to (lossy: for drafters' layers only)
GRIDS = ("q8_0", "q4_1")


def quantize(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(d, m, q)``: ``weight`` (float ``[out, in]``, ``in`` a multiple of 32) rounded to the nearest point of a
    ``kind`` block grid, as llama.cpp quantizes (``q8_0``: ``d`` the block's largest magnitude over 127, ``m``
    ``None``; ``q4_1``: ``m`` the block's minimum, ``d`` its span over 15), the levels rounded against the float16
    ``d`` and ``m`` that are stored. Lossy, unlike ``pack_grid``: for a draft's own layers, whose weights can change
    what is accepted but never what is output.

    Raises:
        ValueError: an unknown kind, or ``in`` not a multiple of 32.
    """
    if kind not in GRIDS:
        raise ValueError(f"unknown grid {kind!r}; choose one of {', '.join(GRIDS)}")
    out_features, in_features = weight.shape
    if in_features % GRID_BLOCK:
        raise ValueError(f"a {kind} grid needs inputs in blocks of {GRID_BLOCK}; this weight has {in_features}")
    blocks = weight.detach().float().reshape(out_features, in_features // GRID_BLOCK, GRID_BLOCK)
    if kind == "q8_0":
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
        q = torch.round(blocks / torch.where(d > 0, d, 1.0)).clamp(-127, 127)
        return d.squeeze(-1).half(), None, q.reshape(out_features, in_features).to(torch.int8)
    m = blocks.amin(-1, keepdim=True).half().float()
    d = ((blocks.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.round((blocks - m) / torch.where(d > 0, d, 1.0)).clamp(0, 15)
    return d.squeeze(-1).half(), m.squeeze(-1).half(), q.reshape(out_features, in_features).to(torch.uint8)


def dequantize(d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[out, in]`` a grid ``(d, m, q)`` rebuilds (``d * q + m``, as the kernel computes it)."""
    out_features, in_features = q.shape
    levels = q.float().view(out_features, -1, GRID_BLOCK)
    rebuilt = d.float()[..., None] * levels
    if m is not None:
        rebuilt = rebuilt + m.float()[..., None]
    return rebuilt.reshape(out_features, in_features)


def pack_quantized(weight: torch.Tensor, kind: str, module=None) -> torch.Tensor:
    """``weight`` rounded to a ``kind`` grid (``quantize``) in the kernel's grid layout: ``linear`` then computes with
    exactly ``dequantize(*quantize(weight, kind))``."""
    d, m, q = quantize(weight, kind)
    return _grid_panels(kind, d, m, q, module if module is not None else extension())


def pack_exact(weight: torch.Tensor) -> torch.Tensor:
    """The fewest bytes that give the float32 panels' results exactly: the weight's block grid where it lies on
    one (``pack_grid``; ``EXACT_GRIDS``), else float32 panels (``pack``)."""
    grid = pack_grid(weight) if EXACT_GRIDS else None
    return grid[1] if grid is not None else pack(weight)


def packed_format(packed: torch.Tensor) -> str:
    """``float32``, ``float16``, ``q4_1``, ``q8_0`` or ``q6_k``: what a packed weight holds."""
    if packed.dtype != torch.uint8:
        return str(packed.dtype).removeprefix("torch.")
    return next(kind for kind in ("q4_1", "q8_0", "q6_k") if packed.shape[-1] == extension().grid_block_bytes(kind))


_attention_dims: dict[int, bool] = {}


def attention_supported(head_dim: int) -> bool:
    """The attention kernel takes heads of this size (a multiple of the vector width: 4, 8, 16 or 32 vectors)."""
    known = _attention_dims.get(head_dim)
    if known is None:
        known = _attention_dims[head_dim] = bool(extension().attention_supported(head_dim))
    return known


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Softmax attention of a few queries: ``query [B, H, n, D]`` over ``key``/``value`` ``[B, KV, L, D]`` (``H``
    a multiple of ``KV``: grouped-query heads read as they are), ``mask`` None or ``[B or 1, 1, n, L]``, bool (True:
    attend) or float32 (added to the scores) -> ``[B, n, H, D]``, transformers' layout after attention."""
    module = _module if _module is not None else extension()
    return module.attention(query, key, value, mask, scale)


def linear(rows: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``rows [n, in] @ weight.T + bias`` from the packed weight, plus ``residual`` ``[n, out]`` if given (added last,
    as ``residual + linear(rows)`` adds it); ``n`` should be at most ``MAX_ROWS``."""
    module = _module if _module is not None else extension()  # built: no lock on the decode path
    return module.linear(rows, packed, out_features, bias, residual)  # reads the data only: no autograd


def fma_peak_gflops(iterations: int = 2_000_000) -> float:
    """The float32 multiply-add rate (GFLOPS) this build's vectors reach on torch's threads, from register-resident
    chains (no memory traffic; ~20 ms at the default)."""
    return float(extension().fma_peak_gflops(int(iterations)))


def rms_norm(rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of contiguous float32 ``rows [n, hidden]`` (the Llama family's, one pass a row)."""
    return (_module if _module is not None else extension()).rms_norm(rows, weight, eps)


def rope_(rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rotary embedding (rotate-half) in place on ``rows [n, heads * head_dim]``; ``cos`` / ``sin`` ``[n or m,
    head_dim]``, row ``r`` taking position row ``r % m`` (one position row per token, shared by batch rows)."""
    (_module if _module is not None else extension()).rope_(rows, cos, sin, head_dim)
    return rows


def decoder_layer(hidden: torch.Tensor, norm1: torch.Tensor, eps1: float, packed: list[torch.Tensor],
                  biases: list[torch.Tensor | None], out_features: list[int], cos: torch.Tensor, sin: torch.Tensor,
                  head_dim: int, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int,
                  mask: torch.Tensor | None, scale: float, norm2: torch.Tensor, eps2: float,
                  normed: torch.Tensor | None = None) -> torch.Tensor:
    """One Llama-family decoder layer in one call (what ``selfspec.runtime.lean`` does in twelve, bitwise the same):
    ``hidden [batch * n, hidden]`` -> the layer's output ``[batch, n, hidden]``, the new keys and values written into ``key_buffer`` /
    ``value_buffer`` ``[batch, kv_heads, capacity, head_dim]`` after their ``length`` entries (room reserved by the
    caller); ``packed`` / ``biases`` / ``out_features`` for q, k, v, o, gate, up, down; ``normed``: the attention
    input where it is not ``RMSNorm(hidden)`` (a feature drafter's normed halves; ``norm1`` is then not read)."""
    return (_module if _module is not None else extension()).decoder_layer(
        hidden, norm1, eps1, packed, biases, out_features, cos, sin, head_dim, key_buffer, value_buffer, length,
        mask, scale, norm2, eps2, normed)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` ``[rows, k]``: the ``k`` largest log-probabilities (log_softmax) of each row of float32
    ``logits [rows, V]``, largest first (the earlier column first among equal values; NaN never chosen): what
    ``log_softmax(logits).topk(k)`` ranks, in one pass each for the maximum, the normalizer and the top ``k``."""
    values, indices = (_module if _module is not None else extension()).top_log_probs(logits, k)
    return values, indices


def head_top(hidden: torch.Tensor, norm: torch.Tensor, eps: float, packed: torch.Tensor, out_features: int,
             bias: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft head in one call: ``top_log_probs(linear(rms_norm(hidden, norm, eps), packed, ...), k)`` for
    ``hidden [rows, H]``."""
    values, indices = (_module if _module is not None else extension()).head_top(hidden, norm, eps, packed,
                                                                                  out_features, bias, k)
    return values, indices


def decoder_stack(stack, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_buffers: list[torch.Tensor],
                  value_buffers: list[torch.Tensor], length: int, mask: torch.Tensor | None,
                  all_outputs: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Every layer of ``stack`` (an extension ``DecoderStack``: the per-layer constants of ``decoder_layer``, held in
    C++) in turn over ``hidden [batch * n, hidden]``, as that many ``decoder_layer`` calls would run them, bitwise:
    layer ``i`` writes its keys and values into ``key_buffers[i]`` / ``value_buffers[i]`` after their ``length``
    entries. Returns ``(outputs, keys, values)``: every layer's output ``[batch, n, hidden]`` (``all_outputs``) or
    the last one's alone, and the views ``[:, :, :length + n]`` of the buffers (what each cache layer now holds)."""
    return stack.run(hidden, cos, sin, key_buffers, value_buffers, length, mask, all_outputs)


def keep_entries(key_buffers: list[torch.Tensor], value_buffers: list[torch.Tensor], prefix_length: int,
                 accepted: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """In every layer's key and value buffers ``[batch, kv_heads, capacity, head_dim]``: keep the first
    ``prefix_length`` entries and the root's after them, and move the ``accepted`` nodes' entries (node ``i`` was
    written at ``prefix_length + 1 + i``; ascending, as a path from the root is) down behind the root. Returns the
    views ``[:, :, :prefix_length + 1 + len(accepted)]`` (``selfspec.runtime.cache.keep_accepted``'s result)."""
    return (_module if _module is not None else extension()).keep_entries(key_buffers, value_buffers, prefix_length,
                                                                           accepted)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.max(dim=-1).indices`` of float32 CPU rows ``[n, V]``: each row's first maximal column, a NaN
    counting as the maximum (its first NaN), as int64 ``[n]``."""
    return (_module if _module is not None else extension()).argmax_rows(logits)


def loaded() -> bool:
    """The extension is built and loaded in this process (asking does not build it)."""
    return _module is not None


#: The tile shapes for 15-16 rows the kernel can use (``set_wide_tiles``), by name.
WIDE_TILES = ("16x1", "12x2")


def set_wide_tiles(plan: str) -> str:
    """Compute 15-16 rows as one 16-row tile per weight panel (``"16x1"``) or a 12-row tile over two panels and the
    rest (``"12x2"``); which is faster differs between CPUs, and neither changes a result. Returns the shape in
    effect: always ``"16x1"`` on a build without AVX-512, where the choice does not exist."""
    if plan not in WIDE_TILES:
        raise ValueError(f"unknown tile shape {plan!r}; choose one of {', '.join(WIDE_TILES)}")
    return WIDE_TILES[int(extension().set_wide_tiles(WIDE_TILES.index(plan)))]


def wide_tiles() -> str:
    """The tile shape in effect for 15-16 rows (``set_wide_tiles``)."""
    return WIDE_TILES[int(extension().wide_tiles())]


#: whether 1-4-row tiles prefetch in a process where nothing set it (``set_small_prefetch``)
SMALL_PREFETCH_DEFAULT = True


def set_small_prefetch(on: bool) -> bool:
    """Whether tiles of 1-4 rows (a plain decode step, a drafter's small calls) software-prefetch the next tile's
    weights while they compute, as larger tiles always do (default: ``SMALL_PREFETCH_DEFAULT``). Whether that pays
    depends on the CPU's own prefetchers (a 1-token forward of SmolLM2 31% faster on a 2-core Zen 5; an older
    kernel lost ~10% at 2 rows on a 2-core AVX2 EPYC), so ``set_linear_backend(model, "auto")`` measures both once
    per machine; it never changes a result. Returns the setting in effect."""
    if not isinstance(on, bool):
        raise ValueError(f"set_small_prefetch takes True or False, got {on!r}")
    return bool(extension().set_small_prefetch(int(on)))


def small_prefetch() -> bool:
    """Whether tiles of 1-4 rows prefetch (``set_small_prefetch``)."""
    return bool(extension().small_prefetch())


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate = silu(gate) * up`` in place (contiguous float32 ``[n, intermediate]`` both)."""
    (_module if _module is not None else extension()).silu_mul_(gate, up)
    return gate
