"""Two versions of the skinny kernel, interleaved in one process: a change to the kernel measured against what it
replaces under the same machine conditions (a VM's speed drifts between runs; within one process, alternating call
by call, both versions see the same moment).

    python scripts/kernel_ab.py --old c2c0220                          # a git revision's kernel vs this checkout's
    python scripts/kernel_ab.py --old c2c0220 --linears --tokens 1,8,12,16,24
    python scripts/kernel_ab.py --old c2c0220 --cflags=-mno-avx512f --linears  # the AVX2 code on an AVX-512 CPU
    python scripts/kernel_ab.py --old 8ba5874 --attention --tokens 1,4,8,9,12,16

Default: whole forwards of the model over ``--prefix`` cached tokens with every linear on the skinny kernel, the
two builds swapped under the same packed weights before each forward (the pack layout must be the same in both,
which is checked). ``--linears``: only the model's linear layers, called in forward order on its own weights
(``--copies`` copies of them so that they stream from memory as in a forward). Medians of ``--repeats`` rounds,
the order of the two alternating per round; every output of the two builds is compared first.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from selfspec.bench.cost import cpu_model
from selfspec.runtime import cache as kv
from selfspec.runtime import lean, skinny
from selfspec.runtime.attention import GQA_SDPA, use_attention
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.models import load_model

ROOT = Path(__file__).resolve().parent.parent


def kernel_source(spec: str) -> Path:
    """A file path, or a git revision whose kernel source is written to a temporary file."""
    if Path(spec).is_file():
        return Path(spec)
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{spec}:{skinny.SOURCE.relative_to(ROOT)}"],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="kernel-ab-")) / "skinny_linear.cpp"
    path.write_text(text)
    return path


def build(source: Path, extra: list[str]):
    flags = list(skinny.cflags()) + extra
    key = hashlib.sha256((source.read_text() + " ".join(flags) + torch.__version__).encode()).hexdigest()[:12]
    directory = Path(tempfile.gettempdir()) / "selfspec-kernel-ab" / key
    directory.mkdir(parents=True, exist_ok=True)
    return skinny.compile_extension(f"skinny_ab_{key}", source, flags, directory)


def check_same(builds: dict, weights: list[torch.Tensor], sizes: list[int]) -> None:
    old, new = builds["old"], builds["new"]
    if old.lanes() != new.lanes():
        sys.exit(f"the two builds pack differently ({old.lanes()} vs {new.lanes()} lanes): nothing to compare")
    for weight in weights[:8] + weights[-1:]:
        packed = new.pack(weight)
        if not torch.equal(packed, old.pack(weight)):
            sys.exit("the two builds pack weights differently: nothing to compare")
        for n in sizes:
            x = torch.randn(n, weight.shape[1])
            a, b = old.linear(x, packed, weight.shape[0], None), new.linear(x, packed, weight.shape[0], None)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def time_rounds(run, labels: list[str], sizes: list[int], repeats: int) -> dict:
    times: dict = {}
    for round_ in range(repeats + 2):  # two rounds of warm-up
        for n in sizes:
            for label in labels if round_ % 2 else labels[::-1]:
                start = time.perf_counter()
                run(label, n)
                if round_ >= 2:
                    times.setdefault((label, n), []).append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="git revision or .cpp file of the kernel to compare against")
    parser.add_argument("--new", default=str(skinny.SOURCE), help="the other kernel (default: this checkout's)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", default="1,2,4,8,12,16,24")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linears", action="store_true", help="time the linear layers only")
    parser.add_argument("--attention", action="store_true",
                        help="time the attention kernel only: the model's heads over --prefix cached keys, 30 layers'"
                             " worth (outputs must be bitwise equal)")
    parser.add_argument("--copies", type=int, default=1, help="with --linears: copies of the weights to stream")
    parser.add_argument("--grids", action="store_true",
                        help="with --linears: each weight packed as a forward streams it, on its exact GGUF grid where"
                             " it lies on one (outputs of the two builds must be bitwise equal)")
    parser.add_argument("--cflags", default="", help="extra compiler flags for both builds (e.g. -mno-avx512f)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    sizes = [int(n) for n in args.tokens.split(",")]
    extra = args.cflags.split()
    builds = {"old": build(kernel_source(args.old), extra), "new": build(kernel_source(args.new), extra)}
    model, _ = load_model(args.model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    check_same(builds, [m.weight.detach() for m in linears], sizes)
    labels = ["old", "new"]
    with torch.inference_mode():
        if args.attention:
            config = model.config
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            keys = {n: (torch.randn(1, heads, n, dim), torch.randn(1, kv_heads, args.prefix + n, dim),
                        torch.randn(1, kv_heads, args.prefix + n, dim),
                        None if n == 1 else torch.ones(1, 1, n, args.prefix + n, dtype=torch.bool).tril(args.prefix))
                    for n in sizes}
            for n, (q, k, v, mask) in keys.items():
                if not torch.equal(builds["old"].attention(q, k, v, mask, dim ** -0.5),
                                   builds["new"].attention(q, k, v, mask, dim ** -0.5)):
                    sys.exit(f"{n} queries: the two builds' attention differs")

            def run(label, n):
                module, (q, k, v, mask) = builds[label], keys[n]
                for _ in range(config.num_hidden_layers):
                    module.attention(q, k, v, mask, dim ** -0.5)
        elif args.linears:
            skinny._module = builds["new"]  # pack_exact packs with the new build (the layout is checked equal above)

            def packed(weight):  # the weight as a forward streams it (its exact grid with --grids), checked equal
                if not args.grids:
                    return builds["new"].pack(weight)
                panels = skinny.pack_exact(weight)
                x = torch.randn(max(sizes), weight.shape[1])
                if not torch.equal(builds["old"].linear(x, panels, weight.shape[0], None),
                                   builds["new"].linear(x, panels, weight.shape[0], None)):
                    sys.exit(f"a {tuple(weight.shape)} weight on its grid: the two builds' outputs differ")
                return panels

            layers = [(packed(m.weight.detach()), m.out_features, m.in_features)
                      for _ in range(args.copies) for m in linears]
            inputs = {n: {k: torch.randn(n, k) for k in {k for _, _, k in layers}} for n in sizes}

            def run(label, n):
                module = builds[label]
                for packed, out_features, in_features in layers:
                    module.linear(inputs[n][in_features], packed, out_features, None)
        else:
            skinny._module = builds["new"]  # packs with the new build; the layout is checked equal above
            # The whole-stack call (lean.FUSED_STACK) is an object of the build that made it: with it, both sides
            # would run one build. Per-layer calls look the build up each time, so the swap below takes effect.
            lean.FUSED_STACK = False
            set_linear_backend(model, "skinny")
            if not all(hasattr(b, "attention") for b in builds.values()):
                # a build from before the attention kernel: both sides attend with SDPA
                print("one build has no attention kernel: both forwards use SDPA's", file=sys.stderr)
                use_attention(model, GQA_SDPA)
            ids = torch.randint(0, model.config.vocab_size, (1, args.prefix + max(sizes)))
            cache = kv.new_cache(model, capacity=args.prefix + max(sizes) + 8)
            model(input_ids=ids[:, :args.prefix], cache=cache, use_cache=True)

            def run(label, n):
                skinny._module = builds[label]
                model(input_ids=ids[:, args.prefix:args.prefix + n], cache=cache, use_cache=True)
                kv.crop(cache, args.prefix)

        medians = time_rounds(run, labels, sizes, args.repeats)
    what = ("attention of every layer" if args.attention
            else f"linear layers{' on their grids' if args.grids else ''}" if args.linears
            else f"forward over {args.prefix} cached tokens")
    what += f" ({cpu_model()})"
    print(f"{what}, ms (ratio to 1 token), median of {args.repeats} interleaved rounds, {args.threads} threads"
          f"{', ' + args.cflags if args.cflags else ''}")
    print("| kernel | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for label, spec in (("old", args.old), ("new", args.new)):
        one = medians.get((label, 1))
        cells = [f"{medians[(label, n)]:.1f}" + (f" ({medians[(label, n)] / one:.2f}x)" if one else "")
                 for n in sizes]
        print(f"| {label}: {Path(spec).name if Path(spec).is_file() else spec} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
