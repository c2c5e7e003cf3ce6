"""How much of a decode forward is the Python around the kernels? A probe, not a decoding path: every Llama decoder
layer's ``forward`` is swapped for a lean one that calls the skinny kernels directly (no module calls, no per-call
checks, one fused RMSNorm op, rotary in four ops), and whole forwards are timed against transformers' own layers,
interleaved in one process, both on the skinny backend (same linear and attention kernels).

    python scripts/lean_layer_probe.py --tokens 1,4,8,16

The lean layer is what a leaner decoding path for Llama-family models could save; it is checked to give the same
argmax as transformers' layers (its RMSNorm rounds differently) and is used nowhere else.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from selfspec.bench.cost import cpu_model
from selfspec.runtime import cache as kv
from selfspec.runtime import skinny
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.models import load_model


def _packed(linear) -> torch.Tensor:
    return linear.forward._weight  # the skinny backend's packed copy (packed by a first forward)


def lean_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                 position_embeddings=None, **kwargs):
    attn, mlp = self.self_attn, self.mlp
    shape = hidden_states.shape[:-1]
    n = shape[-1]
    norm = self.input_layernorm
    x = F.rms_norm(hidden_states, norm.weight.shape, norm.weight, norm.variance_epsilon).view(n, -1)
    d = attn.head_dim
    q = skinny.linear(x, _packed(attn.q_proj), attn.q_proj.out_features, None).view(1, n, -1, d).transpose(1, 2)
    k = skinny.linear(x, _packed(attn.k_proj), attn.k_proj.out_features, None).view(1, n, -1, d).transpose(1, 2)
    v = skinny.linear(x, _packed(attn.v_proj), attn.v_proj.out_features, None).view(1, n, -1, d).transpose(1, 2)
    cos, sin = position_embeddings
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = d // 2
    q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
    k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
    k, v = cache.update(k, v, attn.layer_idx)
    mask = attention_mask
    if mask is not None:
        mask = mask[:, :, :, :k.shape[-2]]
    out = skinny.attention(q, k, v, mask, attn.scaling).view(n, -1)
    o = skinny.linear(out, _packed(attn.o_proj), attn.o_proj.out_features, None)
    h = hidden_states + o.view(hidden_states.shape)
    norm = self.post_attention_layernorm
    y = F.rms_norm(h, norm.weight.shape, norm.weight, norm.variance_epsilon).view(n, -1)
    gate = skinny.linear(y, _packed(mlp.gate_proj), mlp.gate_proj.out_features, None)
    up = skinny.linear(y, _packed(mlp.up_proj), mlp.up_proj.out_features, None)
    down = skinny.linear(F.silu(gate).mul_(up), _packed(mlp.down_proj), mlp.down_proj.out_features, None)
    return h + down.view(h.shape)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,4,8,16")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = sorted({int(n) for n in args.tokens.split(",")})
    model, _ = load_model("smollm2-135m-instruct")
    model.eval()
    set_linear_backend(model, "skinny")
    layers = model.model.layers
    stock_forward = type(layers[0]).forward
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, args.prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    cache = kv.new_cache(model, capacity=args.prefix + max(sizes) + 8)
    model(input_ids=ids[:, :args.prefix], cache=cache, use_cache=True)

    def forward(lean: bool, n: int) -> torch.Tensor:
        for layer in layers:
            if lean:
                layer.forward = lean_forward.__get__(layer)
            else:
                layer.__dict__.pop("forward", None)
        mask = torch.ones(1, 1, n, args.prefix + n, dtype=torch.bool).tril(args.prefix) if n > 1 else None
        try:
            return model(input_ids=ids[:, args.prefix:args.prefix + n], cache=cache, use_cache=True,
                         attention_mask=mask).logits
        finally:
            kv.crop(cache, args.prefix)

    for n in sizes:
        forward(False, n)  # packs every weight on the transformers path first
        a, b = forward(False, n), forward(True, n)
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            sys.exit(f"{n} tokens: the lean layer changes an argmax")
    assert stock_forward is type(layers[0]).forward
    times: dict = {}
    for round_ in range(args.repeats + 2):
        for n in sizes:
            for lean in ((False, True) if round_ % 2 else (True, False)):
                start = time.perf_counter()
                forward(lean, n)
                if round_ >= 2:
                    times.setdefault((lean, n), []).append((time.perf_counter() - start) * 1e3)
    print(f"forward ms, skinny kernels, {cpu_model()}, {args.threads} threads, {args.prefix} cached tokens, median of "
          f"{args.repeats} interleaved rounds")
    print("| layers | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for lean in (False, True):
        cells = " | ".join(f"{statistics.median(times[(lean, n)]):.1f}" for n in sizes)
        print(f"| {'lean (probe)' if lean else 'transformers'} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
