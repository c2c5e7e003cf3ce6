"""Prompt lookup decoding (n-gram lookup): drafts from the text itself, with no model and no training.

When the last ``n`` tokens already occurred earlier in the sequence (prompt or answer so far), the tokens that
followed that occurrence are proposed as a chain. It costs a few microseconds per step, and it is right often
exactly where model-based drafts are weak: copied names, code, quoted text, and the repetitions small models make.
Registered as the ``lookup`` drafter (entry point ``selfspec.drafters``); ``--draft medusa+lookup`` merges it with
another drafter's tree (``decoding.combine``)::

    from decoding import combine, generate
    from lookup import LookupDrafter
    out = generate(model, LookupDrafter(num_tokens=6), input_ids, max_new_tokens=128)
"""

from lookup.drafter import LookupDrafter, lookup_continuation, lookup_continuations, make_lookup_drafter

__all__ = ["LookupDrafter", "lookup_continuation", "lookup_continuations", "make_lookup_drafter"]
