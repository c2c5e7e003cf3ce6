"""Drafts with no model and no training: what followed the same context before.

- ``LookupDrafter`` (``--draft lookup``): prompt lookup. Earlier occurrences of the sequence's longest repeated
  suffix, in the prompt or the answer so far, and what followed them, counted into a tree. It costs ~0.05 ms a step,
  and it is right often exactly where model-based drafts are weak: copied names, code, quoted text, and the
  repetitions small models make.
- ``DatastoreDrafter`` (``--draft datastore:DIR``): the same over an index of other conversations, best the model's
  own answers (``selfspec datastore --data DIR --out STORE`` builds one), which holds the phrases a model repeats
  across conversations.

Both merge with other drafters into one tree (``decoding.combine``; ``--draft medusa+lookup+datastore:STORE``)::

    from decoding import combine, generate
    from lookup import DatastoreDrafter, Datastore, LookupDrafter
    drafter = combine(LookupDrafter(), DatastoreDrafter(Datastore.load("runs/datastore")))
    out = generate(model, drafter, input_ids, max_new_tokens=128)
"""

from lookup.datastore import Datastore, DatastoreDrafter, make_datastore_drafter
from lookup.drafter import LookupDrafter, lookup_continuation, lookup_continuations, make_lookup_drafter
from lookup.tree import count_tree

__all__ = ["Datastore", "DatastoreDrafter", "LookupDrafter", "count_tree", "lookup_continuation",
           "lookup_continuations", "make_datastore_drafter", "make_lookup_drafter"]
