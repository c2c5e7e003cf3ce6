import pytest
import torch

from decoding import DrafterBase, DraftTree, generate, make_drafter
from selfspec.testing import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_max_new_tokens_below_one(model):
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        generate(model, None, torch.tensor([[1, 2]]), max_new_tokens=0)


def test_batch_larger_than_one(model):
    with pytest.raises(ValueError, match="batch size 1"):
        generate(model, None, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=4)


@pytest.mark.parametrize("bad", [96, 5000, -1])
def test_prompt_ids_outside_the_vocabulary(model, bad):
    with pytest.raises(ValueError, match=f"token id {bad}, outside the model's vocabulary \\(0..95\\)"):
        generate(model, None, torch.tensor([[1, bad, 2]]), max_new_tokens=4)


def test_empty_prompt(model):
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, None, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)


def test_prompt_plus_budget_beyond_context(model):
    prompt = torch.ones(1, 500, dtype=torch.long)  # tiny models have a 512-token context
    with pytest.raises(ValueError, match="exceeds the model's context of 512 tokens.*lower max_new_tokens to 12"):
        generate(model, None, prompt, max_new_tokens=20)
    assert generate(model, None, prompt, max_new_tokens=12).sequences.shape[1] == 512


def test_drafter_with_another_vocabulary(model):
    class Foreign(DrafterBase):
        vocab_size = 32000

        def propose(self, state):
            return None

    with pytest.raises(ValueError, match="vocabulary of 32000 but the model's has 96"):
        generate(model, Foreign(), torch.tensor([[1, 2]]), max_new_tokens=4)


def test_token_outside_vocabulary(model):
    class Bad(DrafterBase):
        def propose(self, state):
            return DraftTree.chain([500])

    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(model, Bad(), torch.tensor([[1, 2]]), max_new_tokens=4)


def test_cyclic_tree_from_a_drafter(model):
    class Cyclic(DrafterBase):
        def propose(self, state):
            return DraftTree(torch.tensor([1, 2]), torch.tensor([1, 0]))

    with pytest.raises(ValueError, match="parent"):
        generate(model, Cyclic(), torch.tensor([[1, 2]]), max_new_tokens=4)


def test_unknown_acceptance_and_greedy_with_temperature(model):
    with pytest.raises(ValueError, match="unknown acceptance"):
        generate(model, None, torch.tensor([[1]]), max_new_tokens=2, acceptance="magic")
    with pytest.raises(ValueError, match="temperature 0"):
        generate(model, None, torch.tensor([[1]]), max_new_tokens=2, temperature=0.5, acceptance="greedy")


def test_unknown_drafter_lists_known_ones(model):
    with pytest.raises(KeyError, match="available: .*none"):
        make_drafter("no-such-drafter", model)


def test_typical_acceptance_runs_and_is_opt_in(model):
    out = generate(model, None, torch.tensor([[1, 2, 3]]), max_new_tokens=6, temperature=0.8, seed=0,
                   acceptance="typical")
    assert out.sequences.shape[1] == 9


def test_seeded_sampling_is_deterministic(model):
    runs = [generate(model, None, torch.tensor([[1, 2, 3]]), max_new_tokens=12, temperature=1.0, seed=7).sequences
            for _ in range(2)]
    assert torch.equal(*runs)


def test_generation_config_is_honoured(model):
    from transformers import GenerationConfig

    prompt = torch.tensor([[1, 2, 3]])
    config = GenerationConfig(max_new_tokens=7, do_sample=False)
    out = generate(model, None, prompt, generation_config=config)
    reference = model.generate(prompt, generation_config=config, pad_token_id=0)
    assert out.sequences.tolist() == reference.tolist()
    sampled = GenerationConfig(max_new_tokens=5, do_sample=True, temperature=0.9, top_k=10, top_p=0.9)
    a = generate(model, None, prompt, generation_config=sampled, seed=3).sequences
    b = generate(model, None, prompt, max_new_tokens=5, temperature=0.9, top_k=10, top_p=0.9, seed=3).sequences
    assert torch.equal(a, b)
