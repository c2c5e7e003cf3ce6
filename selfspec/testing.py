"""What the tests share: tiny random models (``selfspec.runtime.tiny``), reference drafters that show the decode loop
is lossless whatever is proposed, and assertions several test modules make."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Sequence

import torch
from transformers import DynamicCache

import decoding
from decoding.drafter import DecodeState, DrafterBase, SamplingParams
from decoding.tree import DraftTree, TreeTemplate
from early_exit.classifier import new_classifier
from medusa.heads import MedusaHeads
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.prompts import encode_prompt
from selfspec.runtime.tiny import ARCHITECTURES, TINY_CONFIGS, byte_tokenizer, tiny_config, tiny_model

__all__ = [
    "ARCHITECTURES", "LLAMA_FAMILY", "MEDUSA_TEST_TREES", "TINY_CONFIGS", "OracleDrafter", "RandomDrafter",
    "assert_linear_backend_is_exact_and_lossless", "assert_random_trees_decode_losslessly", "attention_classifier",
    "byte_tokenizer", "early_exit_overrides", "greedy_reference", "hf_greedy_continuations", "load_script",
    "prefilled_state", "prefix_heads", "random_prompt",
    "randomize_heads", "sequential_heads", "snapshot", "tiny_config", "tiny_model", "write_prompt_response_data",
]


def assert_random_trees_decode_losslessly(model, seeds_and_lengths=((1, 3), (2, 17)), max_new_tokens: int = 20) -> None:
    """Greedy tree decoding equals ``model.generate`` with random 6-node trees that often hold the true
    continuation (so deep paths are accepted and verified), for each ``(seed, prompt length)``."""
    vocab = model.config.vocab_size
    for seed, length in seeds_and_lengths:
        prompt = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
        expected = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                  min_new_tokens=max_new_tokens)
        drafter = RandomDrafter(vocab, size=6, seed=seed, reference=expected, hit_rate=0.7)
        out = decoding.generate(model, drafter, prompt, max_new_tokens=max_new_tokens, eos_token_id=None)
        assert out.sequences.tolist() == expected.tolist(), f"tree decoding diverged (seed {seed}, length {length})"
        assert out.stats.tau > 1.5, f"too few drafts accepted to exercise verification (tau {out.stats.tau:.2f})"


def assert_linear_backend_is_exact_and_lossless(model, backend: str, kernel_calls: list) -> None:
    """Put ``model`` (on the stock path) on linear ``backend`` and check: logits equal stock's (float32 rounding
    aside), every ``nn.Linear`` of the forward went through the kernel (``kernel_calls`` collects one entry per call,
    by a patch the caller set up), the parameters are untouched, and tree decoding stays lossless."""
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        stock = model(ids).logits
        identity = base_model_identity(model)
        assert set_linear_backend(model, backend) == backend
        fast = model(ids).logits
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-4)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len(kernel_calls) == linears, f"{len(kernel_calls)} of {linears} linear layers ran on {backend}"
    assert base_model_identity(model) == identity  # parameters untouched: heads still recognise the model
    assert_random_trees_decode_losslessly(model)


class OracleDrafter(DrafterBase):
    """Proposes the true continuation (a reference sequence) as a chain: every node is accepted, so
    tau equals depth + 1. Where the reference ends it proposes nothing."""

    def __init__(self, reference: torch.Tensor, depth: int):
        self.reference = reference.reshape(-1)
        self.depth = depth

    def propose(self, state: DecodeState) -> DraftTree | None:
        start = state.sequence.shape[1]
        tokens = self.reference[start:start + self.depth]
        if tokens.numel() == 0:
            return None
        return DraftTree.chain(tokens)


class RandomDrafter(DrafterBase):
    """Proposes a random tree of random tokens each step (random shape unless ``parents`` is fixed)."""

    def __init__(self, vocab_size: int, size: int = 8, seed: int = 0, parents: list[int] | None = None,
                 reference: torch.Tensor | None = None, hit_rate: float = 0.0):
        self.vocab_size = vocab_size
        self.size = size
        self.parents = parents
        self.generator = torch.Generator().manual_seed(seed)
        # With a reference, some nodes copy the true token so that deep partial acceptances happen too.
        self.reference = None if reference is None else reference.reshape(-1)
        self.hit_rate = hit_rate

    def propose(self, state: DecodeState) -> DraftTree | None:
        g = self.generator
        if self.parents is not None:
            parents = torch.tensor(self.parents)
        else:
            parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, self.size)])
        tree = DraftTree(torch.randint(0, self.vocab_size, (len(parents),), generator=g), parents)
        if self.reference is None or self.hit_rate <= 0:
            return tree
        start = state.sequence.shape[1]
        positions = start + tree.depth - 1
        tokens = tree.tokens.clone()
        hit = (torch.rand(len(tokens), generator=g) < self.hit_rate) & (positions < self.reference.numel())
        tokens[hit] = self.reference[positions[hit]]
        return DraftTree(tokens, parents)


def write_prompt_response_data(path: Path, n: int = 6) -> Path:
    """``n`` prompt/response records of simple arithmetic, as JSONL at ``path``."""
    lines = [json.dumps({"prompt": f"Question {i}: what is {i} plus {i}?", "response": f"{i} plus {i} is {2 * i}."})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def early_exit_overrides(tmp_path: Path, out: str, **extra) -> list[str]:
    """``key=value`` overrides of configs/early_exit/tiny.yaml for a run that must learn in a few steps."""
    # 6 records, 2 held out, batch 4: every step trains on the same 4 examples, so the loss is a function of the
    # parameters alone and must fall.
    base = {"output_dir": str(tmp_path / out), "data.source": str(write_prompt_response_data(tmp_path / "data.jsonl")),
            "data.eval_samples": 2, "data.max_length": 64, "optim.batch_size": 4, "optim.epochs": 50,
            "optim.lr": 0.003, "logging.log_every": 1}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


#: tiny architectures the partial-forward drafters (early exit, layer skip) support
LLAMA_FAMILY = ("llama", "qwen2", "mistral", "qwen3")


def random_prompt(n: int = 7, seed: int = 1) -> torch.Tensor:
    """``[1, n]`` random ids of the tiny models' vocabulary (ids 0 and 1, pad and bos, left out)."""
    return torch.randint(2, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def prefilled_state(model, ids: torch.Tensor) -> DecodeState:
    """The decode loop's state after prefill: every prompt token but the last (the root) in the cache."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-1], cache=cache, use_cache=True)
    return DecodeState(model=model, cache=cache, sequence=ids, sampling=SamplingParams())


def snapshot(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every layer's keys and values, to show that a drafter left the cache as it found it."""
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def attention_classifier(model, exit_layer: int = 2, scale: float = 0.3, seed: int = 0, **options):
    """An attention-adapter classifier with random, nonzero weights (zero init would hide every bug)."""
    classifier = new_classifier(model, exit_layer, adapter="attention", adapter_layers=1, **options)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in classifier.attention.named_parameters():
            if not name.startswith("norm"):
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * scale)
    return classifier


def prefix_heads(model, seed: int = 0, sequential: bool = True, mlp: int = 24, **overrides) -> MedusaHeads:
    """Heads with a random, clearly non-identity prefix block (its zero-initialised projections randomised too)."""
    if sequential:
        heads = sequential_heads(model, seed=seed, prefix_attention=True, prefix_mlp_size=mlp, **overrides)
    else:
        overrides = {"num_heads": 3, **overrides}
        heads = randomize_heads(MedusaHeads.for_model(model, prefix_attention=True, prefix_mlp_size=mlp, **overrides),
                          scale=0.1, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in heads.prefix.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * p.shape[-1] ** -0.5)
        heads.prefix.token_proj.weight.mul_(10.0)  # the tiny models' embeddings are ~0.1 in norm
    return heads


def sequential_heads(model, seed: int = 0, **overrides) -> MedusaHeads:
    """Random heads in which both the parent state and the token matter: small ResBlock weights (larger ones grow
    the state 3x per depth until it drowns the token) and a token projection scaled up to the tiny models'
    ~0.1-norm embeddings, so ``U e`` is about as large as ``W s``."""
    overrides = {"num_heads": 3, **overrides}
    heads = randomize_heads(MedusaHeads.for_model(model, sequential=True, **overrides), scale=0.1, seed=seed)
    with torch.no_grad():
        heads.token_weight.mul_(100.0)  # randn * 10
        if heads.lm_head_weight is not None:  # private LM heads: spread over the vocabulary, unlike the tiny base's
            weight = heads.lm_head_weight
            weight.copy_(torch.empty(weight.shape, dtype=weight.dtype).normal_(  # drawn on the CPU, for any device
                0.0, 1.0, generator=torch.Generator().manual_seed(seed)))
    return heads


#: static trees the Medusa tests decode with: chains, branchy, full, wide, and a size grown from accuracies
MEDUSA_TEST_TREES = {"chain4": TreeTemplate.chain(4).choices,
         "branchy": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 1, 0], [1, 1, 0],
                     [0, 0, 0, 0]],
         "default16": 16,
         "full3x3x2": [[a] for a in range(3)] + [[a, b] for a in range(3) for b in range(3)]
         + [[a, b, c] for a in range(3) for b in range(3) for c in range(2)],
         "wide": [[r] for r in range(24)] + [[r, 0] for r in range(6)] + [[0, r] for r in range(1, 5)]
         + [[0, 0, 0], [1, 0, 0], [0, 0, 0, 0]]}


def greedy_reference(model, ids, max_new_tokens):
    """``model.generate`` greedy, exactly ``max_new_tokens`` long (no EOS stop): what a drafter must reproduce."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, pad_token_id=0)


def randomize_heads(heads: MedusaHeads, scale: float = 0.5, seed: int = 0) -> MedusaHeads:
    """Non-zero ResBlock weights (deterministic), so heads differ from the base LM head and from each other."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.device, p.dtype))
    return heads


def hf_greedy_continuations(model, tokenizer, texts, max_new_tokens: int) -> dict[str, list[list[int]]]:
    """``{text: [[prompt + continuation ids]]}``: HF greedy ``generate`` on each chat-templated prompt, stopping at
    the tokenizer's EOS, the reference every drafter on a real model must reproduce."""
    eos = tokenizer.eos_token_id
    out = {}
    for text in texts:
        ids = encode_prompt(tokenizer, text)
        out[text] = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                                   temperature=None, top_p=None, top_k=None).tolist()
    return out


def eagle_draft(model, seed: int = 0, draft_vocab_size: int | None = None, share_lm_head: bool = True,
                aux_layers=None, scale: float = 0.3, intermediate_size: int | None = None):
    """An EAGLE-3 draft model for ``model`` with random, nonzero weights (deterministic in ``seed``); with a
    draft vocabulary, a random subset of the base vocabulary (so draft column != token id); ``intermediate_size``:
    the draft layer's MLP width (None: the base's)."""
    from eagle.model import EagleConfig, EagleDraftModel, default_aux_layers
    from selfspec.runtime.identity import base_model_identity
    from selfspec.runtime.layers import num_decoder_layers

    vocab = model.config.vocab_size
    size = draft_vocab_size or vocab
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=gen)[:size].sort().values if size < vocab else torch.arange(vocab)
    config = EagleConfig(hidden_size=model.config.hidden_size, vocab_size=vocab, draft_vocab_size=size,
                         aux_layers=list(aux_layers or default_aux_layers(num_decoder_layers(model))),
                         share_lm_head=share_lm_head, base_model=base_model_identity(model),
                         intermediate_size=intermediate_size)
    draft = EagleDraftModel(config, model, ids)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
                        * scale * p.shape[-1] ** -0.5 * 3)
    draft.refresh_shared()
    return draft.eval()


# ---------------------------------------------------------------- recipe runs (shared by the recipes' tests)

def repetitive_conversations(path: Path, n: int, seed: int = 0, words: Sequence[str] | None = None) -> Path:
    """``n`` ShareGPT conversations of repetitive text a tiny model can learn something about in a few steps, made
    of ``words`` (default: eight short English words)."""
    g = torch.Generator().manual_seed(seed)
    words = list(words or ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"])
    rows = []
    for i in range(n):
        picks = torch.randint(len(words), (6,), generator=g).tolist()
        reply = " ".join(words[j] for j in picks) + " " + " ".join(words[j] for j in picks)
        rows.append({"id": i, "conversations": [{"from": "human", "value": f"say {i}"}, {"from": "gpt", "value": reply}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_recipe(script: Path, argv: list[str], *, processes: int = 1, wrapper: str | None = None,
                  check: bool = True):
    """Run a ``train/*.py`` launcher in a subprocess: ``processes`` > 1 through ``accelerate launch`` (DDP on the
    CPU over gloo), or ``python -c wrapper`` (a script that runs the launcher itself, e.g. to inject a kill)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if processes > 1:
        # `accelerate launch --cpu --num_processes N` starts ONE process in accelerate 1.x (its simple launcher);
        # --multi_gpu spawns N, and ACCELERATE_USE_CPU keeps them on the CPU (DDP over gloo).
        env["ACCELERATE_USE_CPU"] = "1"
        # A port of its own: two launches at once (pytest-xdist workers) on accelerate's default 29500 meet in one
        # rendezvous and hang until the timeout.
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes",
               str(processes), "--num_machines", "1", "--main_process_port", str(_free_port()), "--mixed_precision",
               "no", "--dynamo_backend", "no", str(script), *argv]
    elif wrapper:
        cmd = [sys.executable, "-c", wrapper, *argv]
    else:
        cmd = [sys.executable, str(script), *argv]
    result = subprocess.run(cmd, cwd=Path(script).resolve().parents[1], env=env, capture_output=True, text=True,
                            timeout=300)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def logged_losses(run_dir: Path) -> list[float]:
    """The training losses a recipe logged to ``run_dir/metrics.jsonl``, in order."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["loss"] for line in lines if "loss" in line]


def assert_same_run(straight: Path, resumed: Path, last_losses: int) -> None:
    """A run that was cut (time budget, signal, kill) and resumed ends as the ``straight`` one did: the same saved
    weights (``heads/model.safetensors``) and the same ``last_losses`` logged losses."""
    import pytest
    from safetensors.torch import load_file

    expected = load_file(str(straight / "heads" / "model.safetensors"))
    got = load_file(str(resumed / "heads" / "model.safetensors"))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    assert logged_losses(resumed)[-last_losses:] == pytest.approx(logged_losses(straight)[-last_losses:], rel=1e-5)


def assert_decodes_like_references(model, tokenizer, drafter, references: dict[str, list[list[int]]],
                                   max_new_tokens: int) -> list[float]:
    """Decode each prompt of ``references`` (``hf_greedy_continuations``) with ``drafter`` and assert the output
    equals HF greedy ``generate``'s; returns the tau of each prompt."""
    taus = []
    for text, expected in references.items():
        ids = encode_prompt(tokenizer, text)
        out = decoding.generate(model, drafter, ids, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
        assert out.sequences.tolist() == expected, text
        taus.append(out.stats.tau)
    return taus


def load_script(name: str):
    """``scripts/<name>.py`` of this repository imported as a module (scripts are entry points, not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
