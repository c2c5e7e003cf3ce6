"""Where one forward's time goes on the skinny backend, per token count.

    python scripts/forward_breakdown.py --tokens 1,8,16
    python scripts/forward_breakdown.py --tokens 1,8,16 --unfused

As decoding runs it (the default), a Llama-family decoder is one extension call for the whole stack of layers
(``selfspec.runtime.lean.FUSED_STACK``): the table splits a forward into that call, the LM head and everything
outside them (embedding, final norm, rotary tables, cache bookkeeping, transformers' Python). ``--unfused`` turns the
fused stack and fused layers off (``lean.FUSED_STACK`` / ``lean.FUSED_LAYERS``: the same arithmetic, bitwise, one
kernel call per matmul) so that the layers split further into their linear kernels, the attention kernel and the
rest (norms, rotary, cache writes, Python); that forward is slower than the one decoding runs, by the Python the
fused calls save, which the two tables side by side show.

Each part is timed by wrapping the extension's entry points, the decoder layers' calls and the LM head with a clock
(~0.3 us a call); each forward runs ``n`` new tokens over ``--prefix`` cached ones and is rolled back after. Medians
of ``--repeats`` rounds, the token counts interleaved within a round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from selfspec.bench.cost import cpu_model
from selfspec.runtime import cache as kv
from selfspec.runtime import lean, skinny
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.layers import decoder_layers
from selfspec.runtime.models import load_model

PARTS = ("linear", "head", "attention", "layers", "stack")


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
    parser.add_argument("--unfused", action="store_true",
                        help="one kernel call per matmul (lean.FUSED_STACK and FUSED_LAYERS off), split further")
    args = parser.parse_args(argv)
    if args.unfused:
        lean.FUSED_STACK = lean.FUSED_LAYERS = False
    torch.set_num_threads(args.threads)
    sizes = sorted({int(n) for n in args.tokens.split(",")})
    model, _ = load_model(args.model)
    model.eval()
    if set_linear_backend(model, "skinny") != "skinny":
        sys.exit("the skinny backend is not available here")
    spent = dict.fromkeys(PARTS, 0.0)
    clocked = skinny._module = _Clocked(skinny.extension(), spent)
    stack_call = skinny.decoder_stack  # the whole-stack call runs on an extension object, not through _module
    skinny.decoder_stack = lambda *stack_args: clocked._timed("stack", stack_call, *stack_args)
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
                linears = spent["linear"] - spent["head"]
                rows[n].append({"total": total, "stack": spent["stack"], "linears": linears, "head": spent["head"],
                                "attention": spent["attention"],
                                "in layers": spent["layers"] - linears - spent["attention"],
                                "outside": total - spent["stack"] - spent["layers"] - spent["head"]})
        if round_ == 0 and not args.unfused and spent["stack"] == 0.0:
            sys.exit("this model's decoder does not run as one fused call here; rerun with --unfused")
    if args.unfused:
        columns = ("total", "linears", "head", "attention", "in layers", "outside")
        header = ("total", "layers' linears", "LM head", "attention", "rest of the layers", "outside the layers")
    else:
        columns = ("total", "stack", "head", "outside")
        header = ("total", "decoder stack (one call)", "LM head", "outside them")
    how = "one kernel call per matmul (--unfused)" if args.unfused else "as decoding runs it"
    print(f"forward ms by part, skinny backend, {how}, {cpu_model()}, {args.threads} threads, {args.prefix} cached "
          f"tokens, median of {args.repeats} rounds")
    print("| tokens | " + " | ".join(header) + " |")
    print("|---:|" + "---:|" * len(header))
    for n in sizes:
        cells = " | ".join(f"{statistics.median(r[c] for r in rows[n]) * 1e3:.2f}" for c in columns)
        print(f"| {n} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
