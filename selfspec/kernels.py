"""Linear-layer backends for CPU inference: the same model, its matmuls run by another library.

Decoding multiplies every weight matrix by 1 to ~20 rows (one token, or a draft tree). On some CPUs the BLAS
that ``torch.nn.functional.linear`` uses handles these skinny shapes badly: on the AMD EPYC this project is
developed on, MKL takes 16 ms for the 576 x 49152 LM head at 2 rows and 24 ms at 3 rows, but 8 ms at 1 row,
while oneDNN (also shipped inside PyTorch) takes 4-6 ms for 1 to 8 rows. Tree verification lives on exactly
these shapes, so the backend decides whether a 4-node tree costs 1.5x or 1.1x one token.

``set_linear_backend(model, "onednn")`` makes every float32 ``nn.Linear`` of ``model`` run through oneDNN
(``torch._C._nn.mkldnn_linear``) when gradients are off; training, other dtypes and other devices keep the stock
path. The parameters are untouched (the identity fingerprint, ``state_dict`` and saving are unchanged); each
layer keeps a oneDNN copy of its weight, repacked when the parameter changes. ``"auto"`` times a short forward
both ways and keeps the faster.

Greedy decoding stays lossless: the drafters' output is compared with the generate of the *same* model, and the
backend only changes float rounding (differences of ~1e-5 in the logits), the same class of difference as a
tree forward's batched matmuls versus plain decoding's one row. Benchmarks run every method on one backend and
can add ``vanilla@stock`` to show the stock baseline next to it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("stock", "onednn", "auto")
_STATE = "_selfspec_linear_backend"
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


class _OneDNNLinear:
    """A replacement ``forward`` for one ``nn.Linear``: oneDNN when it applies, the stock path otherwise."""

    def __init__(self, module: nn.Linear):
        self.module = module
        self._key = None
        self._weight = self._bias = None

    def _packed(self):
        weight, bias = self.module.weight, self.module.bias
        key = (weight.data_ptr(), weight._version, None if bias is None else (bias.data_ptr(), bias._version))
        if key != self._key:  # first call, or the parameter was replaced or changed in place: repack
            with torch.no_grad():
                self._weight = weight.detach().to_mkldnn()
                self._bias = None if bias is None else bias.detach().to_mkldnn()
            self._key = key
        return self._weight, self._bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu"
                or module.weight.dtype != torch.float32 or module.weight.device.type != "cpu" or x.numel() == 0):
            return F.linear(x, module.weight, module.bias)
        weight, bias = self._packed()
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = onednn_linear(rows, weight, module.bias, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def linear_backend_of(model: nn.Module) -> str:
    """The backend ``set_linear_backend`` last put on ``model`` (``"stock"`` if never called)."""
    return getattr(model, _STATE, "stock")


def set_linear_backend(model: nn.Module, backend: str = "auto") -> str:
    """Run ``model``'s linear layers on ``backend`` (in place); returns the backend now in effect.

    Args:
        backend: ``stock`` (PyTorch's default ``F.linear``), ``onednn``, or ``auto`` (oneDNN if this build has it,
            the model is a float32 CPU model, and a timed forward of 1 and 4 tokens is faster with it).

    Raises:
        ValueError: an unknown backend, or ``onednn`` where this PyTorch build has no oneDNN.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown linear backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "onednn" and not onednn_available():
        raise ValueError("this PyTorch build has no oneDNN (torch.backends.mkldnn); use --linear-backend stock")
    if backend == "auto":
        backend = _choose(model)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if backend == "onednn":
                if not isinstance(module.__dict__.get("forward"), _OneDNNLinear):
                    module.forward = _OneDNNLinear(module)
            elif isinstance(module.__dict__.get("forward"), _OneDNNLinear):
                del module.forward  # back to nn.Linear.forward
    setattr(model, _STATE, backend)
    return backend


@contextlib.contextmanager
def linear_backend(model: nn.Module, backend: str) -> Iterator[str]:
    """Use ``backend`` inside the block, then restore the previous one."""
    previous = linear_backend_of(model)
    try:
        yield set_linear_backend(model, backend)
    finally:
        set_linear_backend(model, previous)


def _choose(model: nn.Module) -> str:
    params = next(model.parameters(), None)
    if (not onednn_available() or params is None or params.device.type != "cpu"
            or params.dtype != torch.float32):
        return "stock"
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    previous = linear_backend_of(model)
    timings = {}
    for candidate in ("stock", "onednn", "stock", "onednn"):
        set_linear_backend(model, candidate)
        timings[candidate] = min(timings.get(candidate, float("inf")), _time_forward(model, ids))
    set_linear_backend(model, previous)
    return "onednn" if timings["onednn"] < timings["stock"] else "stock"


@torch.inference_mode()
def _time_forward(model: nn.Module, ids: torch.Tensor) -> float:
    """Seconds for a forward of 1 and of 4 new tokens after a 12-token prefix (best of 3)."""
    from transformers import DynamicCache

    best = float("inf")
    for _ in range(3):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :12], cache=cache, use_cache=True)
        start = time.perf_counter()
        model(input_ids=ids[:, 12:13], cache=cache, use_cache=True)
        model(input_ids=ids[:, 12:16], cache=cache, use_cache=True)
        best = min(best, time.perf_counter() - start)
    return best
