"""``MedusaDrafter``: every head's top-k from the hidden state the last verification produced, in a static tree
(or, with ``dynamic``, in the part of it the heads are most confident of at this step).

Drafting costs no base forward: the decode loop already has the final hidden state that predicted the root. Per
step the work is one batched ResBlock matmul per layer, ONE LM-head matmul for all heads, one top-k, and one
gather into the tree template; nothing loops over tree nodes in Python.

Sequential heads (``MedusaConfig.sequential``) condition each depth on the path above it, so a depth's candidates
differ per parent: the drafter runs one batched step per depth over the tree's nodes that have children there
(``SequentialPlan``, index tensors precomputed from the template), still without a loop over nodes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, Union

import torch
from torch import nn

from decoding import by_machine
from decoding.drafter import ContextDrafter, DecodeState
from decoding.tree import ROOT, DraftTree, TreeTemplate
from medusa.dynamic import DynamicTreeSelector, SequentialBeam
from medusa.export import import_fasterdecoding, is_fasterdecoding_dir
from medusa.heads import MedusaHeads
from medusa.trees import DEFAULT_TREE_SIZE, default_tree
from selfspec.runtime.attention import LayerCache
from selfspec.runtime.kernels import check_draft_weights, using_draft_weights

#: A tree: a template, Medusa choices, a size for ``default_tree``, or (from the command line) a string holding
#: a size, a JSON list of choices, or the path of a JSON file with one.
TreeSpec = Union[TreeTemplate, Sequence[Sequence[int]], int, str, None]


def resolve_tree(tree: TreeSpec, heads: MedusaHeads) -> TreeTemplate:
    """The tree template ``tree`` names for ``heads``; ``None`` is the heads' saved tree, else ``default_tree``.

    Raises:
        ValueError: invalid choices, a tree deeper than there are heads, or a string that is none of the above
            (a string that names no file is parsed as JSON).
    """
    config = heads.config
    if isinstance(tree, str):
        text = tree.strip()
        if text.isdigit():
            tree = int(text)
        else:
            if Path(text).is_file():
                text = Path(text).read_text()
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                raise ValueError(f"tree {tree!r} is not a size, a JSON list of choices, or a JSON file") from None
            # A heads config.json (or any object with a "tree" / "choices" list) names its tree too.
            if isinstance(parsed, dict):
                parsed = parsed.get("tree", parsed.get("choices"))
            if not isinstance(parsed, list):
                raise ValueError(f"tree {tree!r} holds no list of choices")
            tree = parsed
    if tree is None:  # an empty saved tree is a choice (calibration found no tree that pays), not a missing one
        tree = config.tree if config.tree is not None else DEFAULT_TREE_SIZE
    if isinstance(tree, int) and not isinstance(tree, bool):
        tree = default_tree(config.head_accuracy, tree, num_heads=config.num_heads)
    template = tree if isinstance(tree, TreeTemplate) else TreeTemplate(tree)
    if template.max_depth > config.num_heads:
        raise ValueError(f"tree is {template.max_depth} deep but there are only {config.num_heads} Medusa heads")
    ranks = config.draft_vocab_size or config.vocab_size
    if template.max_rank > ranks:
        raise ValueError(f"tree uses rank {template.max_rank - 1}, beyond the heads' draft vocabulary of {ranks}")
    return template


class SequentialPlan:
    """How sequential heads fill a static tree, one depth (one head) at a time.

    Level ``d`` runs head ``d`` on the rows ``inputs[d]`` (nodes at depth ``d`` that have children; the root for
    ``d = 0``), each from the state its parent's row produced at level ``d - 1`` (``state_rows[d]``) and its own
    token; the rank-``r`` candidate of a row becomes the token of its child of rank ``r``
    (``children[d]``, ``child_rows[d]``, ``child_ranks[d]``).
    """

    def __init__(self, template: TreeTemplate):
        parents, depth = template.parents.tolist(), template.depth.tolist()
        expanded = {p for p in parents if p != ROOT}
        self.inputs, self.state_rows, self.children, self.child_rows, self.child_ranks, self.ranks = \
            [], [], [], [], [], []
        inputs, state_rows = [ROOT], [0]
        for level in range(template.max_depth):
            row = {node: r for r, node in enumerate(inputs)}
            children = [i for i, d in enumerate(depth) if d == level + 1]
            self.inputs.append(torch.tensor(inputs))
            self.state_rows.append(torch.tensor(state_rows))
            self.children.append(torch.tensor(children))
            self.child_rows.append(torch.tensor([row[parents[i]] for i in children]))
            self.child_ranks.append(template.rank[children])
            self.ranks.append(int(template.rank[children].max()) + 1)
            state_rows = [row[parents[i]] for i in children if i in expanded]
            inputs = [i for i in children if i in expanded]

    def fill(self, heads: MedusaHeads, hidden: torch.Tensor, root: int, template: TreeTemplate) -> DraftTree:
        """The step's tree from the hidden state ``[1, hidden]`` that predicted ``root``."""
        tokens = torch.zeros(len(template), dtype=torch.long, device=hidden.device)
        state, row_tokens = hidden, torch.tensor([root], device=hidden.device)
        for level in range(len(self.inputs)):
            if level:
                row_tokens = tokens[self.inputs[level]]
            state = heads.step(state[self.state_rows[level]], row_tokens, level)  # [rows, hidden]
            logits, ids = heads.head_draft_logits(state, level)
            top = logits.topk(self.ranks[level], dim=-1).indices  # [rows, ranks]
            if ids is not None:
                top = ids[top]
            tokens[self.children[level]] = top[self.child_rows[level], self.child_ranks[level]]
        return template.with_tokens(tokens)


class MedusaDrafter(ContextDrafter):
    """Drafts a tree from Medusa heads: depth ``d`` holds head ``d - 1``'s top-k tokens.

    Args:
        heads: the heads (on the base model's device; they share its LM head).
        tree: see ``TreeSpec``; default: the heads' saved tree, else a ``DEFAULT_TREE_SIZE``-node tree grown
            from their measured accuracies.
        dynamic: if set, every step verifies only the ``dynamic`` nodes whose paths the heads are most confident
            of at that step. Parallel heads pick them from ``tree`` as a pool (``DynamicTreeSelector``); sequential
            heads grow them, ``tree``'s depth deep, from the ``width`` best paths per depth with ``top_k`` children
            each (``SequentialBeam``, EAGLE-2 style). ``None``: the static tree as it is.
        draft_weights: what the heads' own layers read on the skinny backend (``float16``, ``float32``, ``q8_0``,
            ``q4_1``; ``selfspec.runtime.kernels.set_draft_weights``), over the process-wide choice; None (default):
            the process-wide choice. It may change what is accepted, never what is output.

    Raises:
        ValueError: the tree does not fit the heads, ``dynamic`` is not between 1 and the tree's size, or an unknown
            ``draft_weights``.
    """

    hidden_layers = (-1,)
    #: what it drafts with, as a benchmark records it (``selfspec.bench.methods.drafter_settings``)
    SETTINGS = ("tree_nodes", "tree_depth", "dynamic", "width", "top_k", "draft_weights")

    def __init__(self, heads: MedusaHeads, tree: TreeSpec = None, *, dynamic: int | str | None = None,
                 width: int | str | None = None, top_k: int | str | None = None, draft_weights: str | None = None):
        check_draft_weights(draft_weights, "medusa drafter")
        self.draft_weights = draft_weights
        #: where the drafting came from: "given", or (``load``) "default" / "calibrated for <machine class>"
        #: (``decoding.by_machine``), with " + options" where options overrode part of it
        self.policy_source = "given"
        self.heads = heads.eval()
        saved = heads.config.dynamic_tree
        if tree is None and dynamic is None and saved:  # the calibrated default
            dynamic = saved["size"]
            width = saved.get("width") if width is None else width
            top_k = saved.get("top_k") if top_k is None else top_k
        width, top_k = 4 if width is None else width, 4 if top_k is None else top_k
        self.template = resolve_tree(tree, heads)
        sequential = heads.config.sequential
        self.beam = self.selector = self.plan = None
        if dynamic is not None and sequential:
            depth = self.template.max_depth or heads.num_heads
            self.beam = SequentialBeam(depth, int(dynamic), int(width), int(top_k))
        elif dynamic is not None:
            self.selector = DynamicTreeSelector(self.template, int(dynamic))
        elif sequential:
            self.plan = SequentialPlan(self.template)
        self._depth = self.beam.depth if self.beam is not None else self.template.max_depth
        self._ranks = self.template.max_rank
        # Prefix attention: its KV cache of verified positions, and its output at the last one (the start state).
        self.context_cache = LayerCache() if heads.prefix is not None else None
        self._start: torch.Tensor | None = None

    @property
    def tree_nodes(self) -> int:
        """Nodes of the static tree (a dynamic tree's pool or depth template)."""
        return len(self.template)

    @property
    def tree_depth(self) -> int:
        return int(self.template.max_depth)

    @property
    def dynamic(self) -> int | None:
        """A dynamic tree's node budget (None: the static tree as it is)."""
        chosen = self.beam if self.beam is not None else self.selector
        return None if chosen is None else int(chosen.size)

    @property
    def width(self) -> int | None:
        return None if self.beam is None else self.beam.width

    @property
    def top_k(self) -> int | None:
        return None if self.beam is None else self.beam.top_k

    def begin(self, state: DecodeState) -> None:
        with using_draft_weights(self.draft_weights):
            super().begin(state)

    def observe(self, state: DecodeState) -> None:
        with using_draft_weights(self.draft_weights):
            super().observe(state)

    def extend_context(self, state: DecodeState, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Run the prefix attention over the positions the last forward added to the base cache; each one's next
        token is in ``state.sequence`` by now (the last one's is the root)."""
        start, new = int(positions[0, 0]), positions.shape[1]
        next_tokens = state.sequence[:, start + 1:start + new + 1].to(hidden.device)
        self._start = self.heads.context(hidden, next_tokens, positions, self.context_cache)[:, -1:]

    def propose(self, state: DecodeState) -> DraftTree | None:
        with using_draft_weights(self.draft_weights):
            return self._propose(state)

    def _propose(self, state: DecodeState) -> DraftTree | None:
        hidden = state.hidden.get(-1)
        if hidden is None:
            raise RuntimeError("MedusaDrafter needs the last hidden state (hidden_layers=(-1,)) in DecodeState.hidden")
        if self._depth == 0:
            return None
        heads = self.heads
        start = hidden[:, -1:] if self.context_cache is None else self._start  # [1, 1, hidden]
        if self.beam is not None:
            with torch.no_grad():
                return self.beam.draft(heads, start[0], state.root)
        if self.plan is not None:
            with torch.no_grad():
                return self.plan.fill(heads, start[0], state.root, self.template)
        with torch.no_grad():
            features = heads.head_features(start, num_heads=self._depth)
            logits, ids = heads.draft_logits(features)
            logits = logits.reshape(self._depth, -1)  # [depth, columns]
            if self.selector is None:
                top = logits.topk(self._ranks, dim=-1).indices  # [depth, ranks]
                return self.template.fill(top if ids is None else ids[top])
            top = logits.log_softmax(dim=-1).topk(self._ranks, dim=-1)
            return self.selector.select(top.indices if ids is None else ids[top.indices], top.values)


def load(base_model: nn.Module, heads_dir: str | Path, *, tree: TreeSpec = None, dynamic: int | str | None = None,
         width: int | str | None = None, top_k: int | str | None = None, dtype: torch.dtype | None = None,
         merge_adapter: bool = False, draft_weights: str | None = None) -> MedusaDrafter:
    """Load the heads in ``heads_dir`` onto ``base_model`` and wrap them in a drafter for ``decoding.generate``.

    The drafting is this machine's saved one (``MedusaConfig.drafting_for``), else the heads' default; ``tree`` (a
    size, choices or a template), ``dynamic`` (a dynamic tree's size; 0: a static tree even where a dynamic one is
    saved), ``width`` and ``top_k`` override it.

    ``heads_dir`` may also hold heads published with FasterDecoding/Medusa (``medusa_lm_head.safetensors`` or
    ``.pt`` beside a config with ``medusa_num_heads``; ``medusa.export.import_fasterdecoding``); their LM heads are
    their own. Medusa-2 heads (trained with a LoRA backbone) need the adapted model: load it with
    ``selfspec.runtime.models.load_model(heads_dir)``, or pass ``merge_adapter=True`` to merge the adapter into
    ``base_model`` in place. Either way, decoding then reproduces the adapted model's own greedy output.

    Raises:
        FileNotFoundError: the heads directory or one of its files is missing.
        selfspec.runtime.identity.BaseModelMismatchError: the heads were trained for another base model.
        ValueError: an invalid heads directory or tree.
    """
    if is_fasterdecoding_dir(heads_dir):  # heads published with FasterDecoding/Medusa
        heads = import_fasterdecoding(heads_dir, base_model)
        if dtype is not None:
            heads = heads.to(dtype)
    else:
        heads = MedusaHeads.from_pretrained(heads_dir, base_model, dtype=dtype, merge_adapter=merge_adapter)
    saved, where, source = by_machine.saved_for(heads.config.drafting_for, next(base_model.parameters()).device)
    given = [v for v in (tree, dynamic, width, top_k, draft_weights) if v is not None]
    source = "options" if tree is not None else source + " + options" * bool(given)
    static = dynamic is not None and str(dynamic) == "0"  # a static tree, never a saved dynamic tree
    if static:
        dynamic = None
    if tree is None:  # the saved drafting (this machine's entry, else the default): its tree (a dynamic tree's pool
        tree = resolve_tree(saved["tree"], heads)  # or depth; a saved null: the default size), its dynamic tree
        if dynamic is None and not static and saved["dynamic_tree"]:
            dynamic = saved["dynamic_tree"]["size"]
            width = saved["dynamic_tree"].get("width") if width is None else width
            top_k = saved["dynamic_tree"].get("top_k") if top_k is None else top_k
    drafter = MedusaDrafter(heads, tree=tree, dynamic=dynamic, width=width, top_k=top_k, draft_weights=draft_weights)
    drafter.policy_source = source
    return drafter


def make_medusa_drafter(model: nn.Module, heads_dir: str | Path | None = None, **options) -> MedusaDrafter:
    """Registry factory: ``selfspec generate --draft medusa --heads DIR`` (options: ``tree``, ``dynamic`` (0: a
    static tree even where a dynamic one is saved), ``width``, ``top_k``, ``draft_weights``).

    Raises:
        ValueError: no heads directory, or an unknown option.
    """
    if heads_dir is None:
        raise ValueError("the medusa drafter needs a heads directory (--heads DIR)")
    known = {"tree", "dynamic", "width", "top_k", "draft_weights"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown medusa drafter option(s) {unknown}; known: {sorted(known)}")
    return load(model, heads_dir, **options)
