"""Where one forward's time goes on the skinny backend: the linear kernels (the LM head apart), the attention kernel,
the rest of the decoder layers (norms, rotary, cache writes, Python) and everything outside them, per token count.

    python scripts/forward_breakdown.py --tokens 1,8,16

Each part is timed by wrapping the extension's entry points and the decoder layers' calls with a clock (~0.3 us a
call, a few hundred calls a forward); each forward runs ``n`` new tokens over ``--prefix`` cached ones and is
rolled back after. Medians of ``--repeats`` rounds, the token counts interleaved within a round. What no kernel
does (the last two columns) is what fused operations and less Python can still take off a step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from selfspec.bench.cost import cpu_model
from selfspec.runtime import cache as kv
from selfspec.runtime import skinny
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.layers import decoder_layers
from selfspec.runtime.models import load_model

PARTS = ("linear", "head", "attention", "layers")


class _Clocked:
    """The extension module with ``linear`` and ``attention`` timed into ``spent``."""

    def __init__(self, module, spent: dict):
        self._module, self._spent = module, spent

    def _timed(self, part: str, function, *args):
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            self._spent[part] += time.perf_counter() - start

    def linear(self, *args):
        return self._timed("linear", self._module.linear, *args)

    def attention(self, *args):
        return self._timed("attention", self._module.attention, *args)

    def __getattr__(self, name):
        return getattr(self._module, name)


def _clock_calls(module, part: str, spent: dict) -> None:
    call = module.forward

    def clocked(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - start

    module.forward = clocked


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", default="1,8,16")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = sorted({int(n) for n in args.tokens.split(",")})
    model, _ = load_model(args.model)
    model.eval()
    if set_linear_backend(model, "skinny") != "skinny":
        sys.exit("the skinny backend is not available here")
    spent = dict.fromkeys(PARTS, 0.0)
    skinny._module = _Clocked(skinny.extension(), spent)
    for layer in decoder_layers(model):
        _clock_calls(layer, "layers", spent)
    _clock_calls(model.get_output_embeddings(), "head", spent)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, args.prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    cache = kv.new_cache(model, capacity=args.prefix + max(sizes) + 8)
    model(input_ids=ids[:, :args.prefix], cache=cache, use_cache=True)
    rows: dict[int, list[dict]] = {n: [] for n in sizes}
    for round_ in range(args.repeats + 2):  # two rounds of warm-up
        for n in sizes:
            for part in PARTS:
                spent[part] = 0.0
            start = time.perf_counter()
            model(input_ids=ids[:, args.prefix:args.prefix + n], cache=cache, use_cache=True)
            total = time.perf_counter() - start
            kv.crop(cache, args.prefix)
            if round_ >= 2:
                # the head's forward calls the linear kernel: its time is in both; keep it in "head" only
                rows[n].append({"total": total, "linears": spent["linear"] - spent["head"], "head": spent["head"],
                                "attention": spent["attention"],
                                "in layers": spent["layers"] - (spent["linear"] - spent["head"]) - spent["attention"],
                                "outside": total - spent["layers"] - spent["head"]})
    columns = ("total", "linears", "head", "attention", "in layers", "outside")
    print(f"forward ms by part, skinny backend, {cpu_model()}, {args.threads} threads, {args.prefix} cached tokens, "
          f"median of {args.repeats} rounds")
    print("| tokens | total | layers' linears | LM head | attention | rest of the layers | outside the layers |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        cells = " | ".join(f"{statistics.median(r[c] for r in rows[n]) * 1e3:.2f}" for c in columns)
        print(f"| {n} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
