"""A datastore drafter: continuations of the current context found in text the model wrote before.

Prompt lookup finds repeats inside one conversation. A model also repeats itself *across* conversations: a small
instruct model opens, lists, explains and closes its answers with the same phrases. A datastore of its own earlier
answers (the self-distilled conversations the drafters train on) holds those phrases; retrieval drafts them, with no
model and no training (REST, He et al. 2023; SuffixDecoding's global tree, 2024).

Index: every position of the tokenized corpus, sorted by the tokens *before and at* it read backwards (a suffix array
of the reversed text, cut at ``context`` tokens). The positions where the current sequence's last ``n`` tokens occur
are then one contiguous range of that order, found token by token from the end of the sequence, each step a binary
search inside the previous range: the longest match costs ``n`` searches. The continuations of (up to
``max_occurrences`` of) those positions are counted into a tree (``lookup.tree.count_tree``).

A directory holds ``tokens.npy`` (the corpus, documents separated by -1), ``order.npy`` (the index), ``config.json``
and a card; ``selfspec datastore`` builds one from any ShareGPT/Alpaca dataset. Memory: a loaded datastore holds
about 20 bytes per corpus token (35 MB for the 1.77M tokens of the self-distilled corpus); building sorts by
``context`` keys at once, about 4 x (context + 4) bytes per token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from decoding.drafter import DecodeState, DrafterBase
from decoding.tree import DraftTree
from lookup.tree import count_tree
from selfspec.runtime.io import CONFIG_NAME, README_NAME, atomic_directory, verify_directory

FORMAT = "selfspec-datastore-1"
SEPARATOR = -1  # between documents, and before the first one: never matches a token
TOKENS_NAME, ORDER_NAME = "tokens.npy", "order.npy"


class Datastore:
    """A token corpus and its reversed-context index (see the module docstring). Build with ``Datastore.build``,
    then ``save`` / ``Datastore.load``.

    Attributes:
        tokens: ``[N]`` int32, documents separated by ``SEPARATOR``.
        order: ``[P]`` int32, the non-separator positions sorted by their reversed context.
        context: how many tokens (ending at a position) the order sorts by; the longest match it can find.
        meta: what ``config.json`` records (vocabulary size, tokenizer, source...).
    """

    def __init__(self, tokens: np.ndarray, order: np.ndarray, context: int, meta: dict | None = None):
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.order = np.ascontiguousarray(order, dtype=np.int32)
        self.context = int(context)
        self.meta = dict(meta or {})
        # padded so that reading ``context`` tokens back or forward from any position stays in bounds
        self._padded = np.concatenate([np.full(self.context, SEPARATOR, np.int32), self.tokens,
                                       np.full(self.context, SEPARATOR, np.int32)])
        # The first ``_packed`` tokens of every position's reversed context packed into one int64, ascending in
        # ``order``: the range of a match of up to that many tokens is two binary searches, with no gather. Longer
        # matches refine that (by then small) range token by token.
        top = int(self.tokens.max()) + 2 if self.tokens.size else 2
        self._bits = max(1, top.bit_length())
        self._packed = max(1, min(self.context, 63 // self._bits))
        keys = np.zeros(self.order.size, dtype=np.int64)
        at = self.order.astype(np.int64) + self.context  # each position in the padded corpus
        for k in range(self._packed):  # token + 1, so that the separator (-1) packs as 0
            column = self._padded[at - k].astype(np.int64) + 1
            keys |= column << (self._bits * (self._packed - 1 - k))
        self._keys = keys

    def __deepcopy__(self, memo: dict) -> Datastore:
        return self  # read-only: the per-row forks of a batch (decoding.batch.fork) share one index

    # ------------------------------------------------------------------ building and storage

    @classmethod
    def build(cls, documents: Iterable[Sequence[int]], *, context: int = 16, meta: dict | None = None) -> Datastore:
        """Index ``documents`` (token id sequences).

        Raises:
            ValueError: ``context`` below 1, a negative token id, or no token at all.
        """
        if context < 1:
            raise ValueError(f"datastore context must be >= 1, got {context}")
        parts = [np.array([SEPARATOR], np.int32)]
        for document in documents:
            ids = np.asarray(document, dtype=np.int64)
            if ids.size == 0:
                continue
            if ids.min() < 0:
                raise ValueError("datastore documents must hold token ids >= 0")
            parts += [ids.astype(np.int32), np.array([SEPARATOR], np.int32)]
        tokens = np.concatenate(parts)
        positions = np.flatnonzero(tokens != SEPARATOR)
        if positions.size == 0:
            raise ValueError("datastore: the documents hold no token")
        padded = np.concatenate([np.full(context, SEPARATOR, np.int32), tokens])
        # np.lexsort sorts by its last key first: the token at the position, then the one before it, and so on
        keys = [padded[positions + context - k] for k in range(context - 1, -1, -1)]
        order = positions[np.lexsort(keys)]
        meta = {**(meta or {}), "num_tokens": int(positions.size),
                "num_documents": int((tokens == SEPARATOR).sum() - 1)}
        return cls(tokens, order, context, meta)

    def save(self, directory: str | Path, card: str | None = None) -> Path:
        """Write the datastore to ``directory`` atomically (complete or absent, never half-written)."""
        config = {"format": FORMAT, "context": self.context, **self.meta}
        with atomic_directory(directory) as tmp:
            np.save(tmp / TOKENS_NAME, self.tokens)
            np.save(tmp / ORDER_NAME, self.order)
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
            if card:
                (tmp / README_NAME).write_text(card)
        return Path(directory)

    @classmethod
    def load(cls, directory: str | Path) -> Datastore:
        """Read a directory ``save`` wrote.

        Raises:
            FileNotFoundError: no such directory.
            DamagedDirectoryError: a file missing, truncated or changed since it was written.
            ValueError: not a datastore directory (heads, a model...), or an index that does not fit its corpus.
        """
        directory = Path(directory)
        verify_directory(directory, "datastore")
        config = json.loads((directory / CONFIG_NAME).read_text())
        if config.get("format") != FORMAT:
            raise ValueError(f"{directory} is not a datastore (config.json format {config.get('format')!r}, "
                             f"expected {FORMAT!r}); build one with `selfspec datastore --data DATASET --out DIR`")
        tokens = np.load(directory / TOKENS_NAME, allow_pickle=False)
        order = np.load(directory / ORDER_NAME, allow_pickle=False)
        if order.size != config.get("num_tokens") or (order.size and not 0 <= order.min() <= order.max() < tokens.size):
            raise ValueError(f"datastore {directory}: its index does not fit its corpus; build it again")
        meta = {k: v for k, v in config.items() if k not in ("format", "context")}
        return cls(tokens, order, config["context"], meta)

    # ------------------------------------------------------------------ queries

    def match(self, sequence: Sequence[int], max_ngram: int | None = None) -> tuple[int, int, int]:
        """``(n, lo, hi)``: the longest ``n`` (at most ``max_ngram`` and ``context``) for which the last ``n`` tokens
        of ``sequence`` occur in the corpus, and the range ``order[lo:hi]`` of the positions where they end;
        ``(0, 0, 0)`` when not even the last token occurs."""
        limit = min(self.context, len(sequence), max_ngram or self.context)
        query = []  # the sequence read backwards, as packed (token + 1), while the packing can hold it
        for k in range(min(limit, self._packed)):
            value = int(sequence[-1 - k]) + 1
            if not 0 < value < (1 << self._bits):
                break  # a token id the corpus never holds: no match reaches past it
            query.append(value)
        n = lo = hi = 0
        for j in range(len(query), 0, -1):  # the longest packed prefix that occurs
            low = 0
            for k in range(j):
                low |= query[k] << (self._bits * (self._packed - 1 - k))
            high = low | ((1 << (self._bits * (self._packed - j))) - 1)
            lo = int(np.searchsorted(self._keys, low, "left"))
            hi = int(np.searchsorted(self._keys, high, "right"))
            if lo < hi:
                n = j
                break
        if n == 0:
            return 0, 0, 0
        while n == len(query) and n < limit:
            # within [lo, hi) the positions are sorted by the token n places back: one more binary search
            earlier = self._padded[self.order[lo:hi] + (self.context - n)]
            want = int(sequence[-1 - n])
            start = int(np.searchsorted(earlier, want, "left"))
            stop = int(np.searchsorted(earlier, want, "right"))
            if start == stop:
                break
            lo, hi, n = lo + start, lo + stop, n + 1
            query.append(want + 1)
        return n, lo, hi

    def continuations(self, lo: int, hi: int, depth: int, max_occurrences: int) -> np.ndarray:
        """``[k, depth]``: the ``depth`` tokens after up to ``max_occurrences`` of the positions ``order[lo:hi]``
        (spread evenly over the range when it holds more), ``SEPARATOR`` past the end of a document."""
        positions = self.order[lo:hi].astype(np.int64)
        if positions.size > max_occurrences:
            positions = positions[np.linspace(0, positions.size - 1, max_occurrences).round().astype(np.int64)]
        after = positions[:, None] + self.context + 1 + np.arange(depth)
        return self._padded[np.minimum(after, self._padded.size - 1)]


class DatastoreDrafter(DrafterBase):
    """Drafts what followed the current context's longest match in a ``Datastore``.

    Args:
        datastore: the corpus and its index.
        nodes: node budget of the tree. 2 by default: merged with prompt lookup (6 nodes), a replay of MT-bench 1-40's
            answers against a 2-core Xeon's cost curve with the decoder stack in one call predicted 1.76x for 2
            nodes, 1.65x for 4, 1.59x for 6 (docs/RESULTS.md, "One call for the whole stack").
        num_tokens: deepest draft.
        min_ngram: shortest match that drafts (a one-token match says little about the next tokens).
        max_ngram: longest match sought (at most the datastore's ``context``).
        min_score: nodes reached by fewer than this share of the occurrences are not drafted.
        max_occurrences: occurrences counted per step (a common phrase occurs thousands of times).

    Raises:
        ValueError: sizes below 1, ``min_ngram > max_ngram``, ``min_score`` outside [0, 1).
    """

    #: what it drafts with, as a benchmark records it (``selfspec.bench.methods.drafter_settings``)
    SETTINGS = ("nodes", "num_tokens", "min_ngram", "max_ngram", "min_score", "max_occurrences")

    def __init__(self, datastore: Datastore, *, nodes: int = 2, num_tokens: int = 4, min_ngram: int = 2,
                 max_ngram: int = 16, min_score: float = 0.05, max_occurrences: int = 64):
        for name, value in (("nodes", nodes), ("num_tokens", num_tokens), ("min_ngram", min_ngram),
                            ("max_ngram", max_ngram), ("max_occurrences", max_occurrences)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DatastoreDrafter {name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"DatastoreDrafter min_ngram ({min_ngram}) exceeds max_ngram ({max_ngram})")
        if not 0.0 <= min_score < 1.0:
            raise ValueError(f"DatastoreDrafter min_score must be in [0, 1), got {min_score}")
        self.datastore = datastore
        self.nodes, self.num_tokens, self.min_ngram, self.max_ngram = nodes, num_tokens, min_ngram, max_ngram
        self.min_score, self.max_occurrences = min_score, max_occurrences
        self.vocab_size = datastore.meta.get("vocab_size")

    def propose(self, state: DecodeState) -> DraftTree | None:
        sequence = state.sequence[0].detach().cpu().numpy()
        n, lo, hi = self.datastore.match(sequence, self.max_ngram)
        if n < self.min_ngram:
            return None
        continuations = self.datastore.continuations(lo, hi, self.num_tokens, self.max_occurrences)
        return count_tree(continuations.tolist(), self.nodes, min_score=self.min_score, stop_token=SEPARATOR)


_OPTIONS = {"nodes": int, "num_tokens": int, "min_ngram": int, "max_ngram": int, "min_score": float,
            "max_occurrences": int}


def make_datastore_drafter(model: Any, heads_dir: str | None = None, **options: Any) -> DatastoreDrafter:
    """Registry factory: ``--draft datastore --heads DIR`` (a directory ``selfspec datastore`` built); options as
    ``DatastoreDrafter``'s.

    Raises:
        ValueError: no directory, an unknown option, or a datastore built with another vocabulary than the model's.
    """
    if heads_dir is None:
        raise ValueError("the datastore drafter needs its directory: --draft datastore --heads DIR (build one with "
                         "`selfspec datastore --data DATASET --out DIR`)")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown datastore drafter option(s) {unknown}; known: {sorted(_OPTIONS)}")
    datastore = Datastore.load(heads_dir)
    vocab = datastore.meta.get("vocab_size")
    model_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and model_vocab is not None and vocab != model_vocab:
        raise ValueError(f"datastore {heads_dir} was tokenized for a vocabulary of {vocab} tokens, the model has "
                         f"{model_vocab}: build a datastore with this model's tokenizer (`selfspec datastore "
                         "--model MODEL ...`)")
    return DatastoreDrafter(datastore, **{k: _OPTIONS[k](v) for k, v in options.items()})
