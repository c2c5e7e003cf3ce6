"""Losses through an LM head that never hold a full ``[positions, vocab]`` block of logits: summed cross entropy,
summed KL to a reference distribution, and rank counts for accuracies, each computed one chunk of rows at a time.
"""

from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of ``features @ weight.T + bias`` whose backward is computed during the forward, one
    chunk at a time: ``d loss / d logits = softmax - onehot`` needs no stored logits, so memory is one
    ``[chunk, vocab]`` block and the LM head runs once forward and once for the gradients (no recomputation)."""

    @staticmethod
    def forward(ctx, features, weight, bias, targets, chunk_size):
        total = torch.zeros((), dtype=torch.float32, device=features.device)
        grad_features = torch.zeros_like(features) if features.requires_grad else None
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        for start in range(0, features.shape[0], chunk_size):
            f, t = features[start:start + chunk_size], targets[start:start + chunk_size]
            logits = torch.nn.functional.linear(f, weight, bias).float()  # [chunk, vocab]
            total += torch.nn.functional.cross_entropy(logits, t, reduction="sum")
            d_logits = logits.softmax(-1)
            d_logits[torch.arange(len(t)), t] -= 1.0
            d_logits = d_logits.to(f.dtype)
            if grad_features is not None:
                grad_features[start:start + chunk_size] = d_logits @ weight
            if grad_weight is not None:
                grad_weight += d_logits.T @ f
            if grad_bias is not None:
                grad_bias += d_logits.sum(0)
        grads = (grad_features, grad_weight, grad_bias)
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in grads))
        ctx.has = (grad_features is not None, grad_weight is not None, grad_bias is not None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grads = [g * grad_output if has else None for g, has in zip(ctx.saved_tensors, ctx.has)]
        return grads[0], grads[1], grads[2], None, None


def _chunk_loss(features, weight, bias, targets):
    logits = torch.nn.functional.linear(features, weight, bias).float()  # [chunk, vocab]
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def _chunk_kl(features, reference, weight, bias):
    log_q = torch.log_softmax(torch.nn.functional.linear(features, weight, bias).float(), dim=-1)  # [chunk, vocab]
    log_p = torch.log_softmax(torch.nn.functional.linear(reference, weight, bias).float(), dim=-1)
    return torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="sum")


def _chunked(fn, tensors, params, chunk_size: int) -> torch.Tensor:
    """Sum of ``fn`` over row chunks of ``tensors``; with autograd on, each chunk's logits are recomputed in
    backward (activation checkpointing), so memory holds one ``[chunk_size, vocab]`` block at a time."""
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*tensors, *params))
    for start in range(0, tensors[0].shape[0], chunk_size):
        parts = [t[start:start + chunk_size] for t in tensors]
        if needs_grad:
            total = total + torch.utils.checkpoint.checkpoint(fn, *parts, *params, use_reentrant=False)
        else:
            total = total + fn(*parts, *params)
    return total


def chunked_cross_entropy(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 1024, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Summed cross entropy of ``features @ weight.T (+ bias)`` ([n, hidden] -> [n, vocab]) against ``targets``,
    never holding more than one chunk of logits (gradients are formed chunk by chunk during the forward)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (features, weight, bias)):
        return _LinearCrossEntropy.apply(features, weight, bias, targets, chunk_size)
    return _chunked(lambda f, t, w, b: _chunk_loss(f, w, b, t), (features, targets), (weight, bias), chunk_size)


def chunked_kl(features: torch.Tensor, reference: torch.Tensor, weight: torch.Tensor, chunk_size: int = 1024,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Summed KL(reference distribution || features' distribution) through the same LM head, chunked."""
    return _chunked(lambda f, r, w, b: _chunk_kl(f, r, w, b), (features, reference), (weight, bias), chunk_size)


@torch.no_grad()
def chunked_rank_counts(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, top_k: int = 10,
                        chunk_size: int = 1024, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[top_k]`` counts: how often the target is the rank-``r`` prediction of ``features @ weight.T``."""
    counts = torch.zeros(top_k, dtype=torch.long)
    for start in range(0, features.shape[0], chunk_size):
        logits = torch.nn.functional.linear(features[start:start + chunk_size], weight, bias)
        top = logits.topk(top_k, dim=-1).indices  # [chunk, top_k]
        counts += (top == targets[start:start + chunk_size, None]).sum(0).cpu()
    return counts
