"""selfspec from transformers' own ``model.generate``: ``custom_generate`` pointed at this package's directory.

    from selfspec.hf import CUSTOM_GENERATE
    out = model.generate(input_ids, custom_generate=CUSTOM_GENERATE, trust_remote_code=True,
                         draft="eagle+lookup", heads="heads/smollm2-135m-instruct-eagle3", max_new_tokens=128)

transformers runs ``custom_generate/generate.py`` from that directory (a local "repository", hence
``trust_remote_code=True``) in place of its own decoding loop; it decodes with ``decoding.generate`` and any
registered drafter, and returns the same ``[batch, prompt + new]`` tensor ``generate`` returns: greedy output
token-identical to plain ``model.generate``, sampling with the same distribution.
"""

from pathlib import Path

#: the directory to pass as ``custom_generate=`` (it holds ``custom_generate/generate.py``)
CUSTOM_GENERATE = str(Path(__file__).resolve().parent)

__all__ = ["CUSTOM_GENERATE"]
