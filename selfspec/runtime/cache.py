"""KV-cache rollback: after a verification, keep exactly the prefix plus the accepted path.

One function serves every drafter. It works on transformers' ``DynamicCache`` layers (``layer.keys`` /
``layer.values`` of shape ``[batch, kv_heads, seq, head_dim]``) through their public tensors.

``new_cache`` builds the cache the decode loop uses: a ``DynamicCache`` whose full-attention layers write into
preallocated buffers (``BufferedLayer``) instead of concatenating. Stock ``DynamicLayer.update`` copies the whole
cache on every forward (``torch.cat``): on the 2-core development CPU that was 20% of a SmolLM2 decode step at a
300-token context. Here an update is one slice copy of the new entries, and rollback only moves a view's end.
The sliding-window layers of a decoder that masks by layer type (Gemma 3, Qwen2 with ``use_sliding_window``) are
buffered too and keep every entry, so that a tree verified past the window can be rolled back; the masks
exclude what the window does not see (``sliding_window_by_layer_type``, ``decoding.generate.verify_forward``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


def grown_buffers(held: tuple[torch.Tensor, torch.Tensor] | None, needed: int, keys: torch.Tensor,
                  values: torch.Tensor, *, minimum: int = 64, current: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """New key and value buffers ``[batch, heads, size, dim]`` shaped like ``keys`` / ``values``, holding ``held``
    (the entries kept so far, or None) at their start. ``size`` is at least ``needed`` and ``minimum``, and doubles
    ``current`` (the buffer outgrown), so that appending one entry at a time reallocates log-many times. Shared by
    the base model's cache (``BufferedLayer``) and the drafters' one-layer caches (``attention.LayerCache``)."""
    size = max(needed, minimum, 2 * current.shape[-2] if current is not None else 0)
    batch, heads, _, dim = keys.shape
    key_buffer = keys.new_empty(batch, heads, size, dim)
    value_buffer = values.new_empty(batch, heads, size, values.shape[-1])
    if held is not None:
        length = held[0].shape[-2]
        key_buffer[:, :, :length] = held[0]
        value_buffer[:, :, :length] = held[1]
    return key_buffer, value_buffer


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` are views ``[:, :, :length]`` of buffers that grow by doubling.

    Everything that reads or rewrites ``layer.keys`` (the modeling code, ``keep_accepted``, ``crop``) keeps working:
    assigning a shorter view of the same buffer is how a rollback is expressed, and the next ``update`` writes
    after the view's end. The buffers are allocated at ``capacity`` entries on first use (default: the first
    update's length, rounded up).
    """

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = int(capacity)
        self._key_buffer = self._value_buffer = None

    def _reserve(self, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self._key_buffer is not None and self._key_buffer.shape[-2] >= needed \
                and self._key_buffer.shape[:2] == key_states.shape[:2]:
            return
        length = self.keys.shape[-2] if self.keys is not None and self.keys.numel() else 0
        held = (self.keys, self.values) if length else None
        self._key_buffer, self._value_buffer = grown_buffers(held, needed, key_states, value_states,
                                                             minimum=max(self.capacity, 64), current=self._key_buffer)
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        self._key_buffer[:, :, length:end] = key_states
        self._value_buffer[:, :, length:end] = value_states
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only batch rows ``index`` (in that order), buffers included."""
        length = self.keys.shape[-2]
        if self._key_buffer is None:
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
            return
        self._key_buffer = self._key_buffer.index_select(0, index)
        self._value_buffer = self._value_buffer.index_select(0, index)
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]


def sliding_window_by_layer_type(model) -> int | None:
    """The window of ``model``'s sliding-window layers where its decoder mixes them in by layer type
    (``config.layer_types``: Gemma 3, Qwen2 with ``use_sliding_window``), so that its forward takes one mask per
    layer type (``{"full_attention": ..., "sliding_attention": ...}``); None otherwise. Their caches keep every entry
    (``new_cache``) and tree verification masks the window itself (``decoding.generate.verify_forward``)."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in (getattr(config, "layer_types", None) or ()) else None


def new_cache(model, capacity: int = 0) -> DynamicCache:
    """A ``DynamicCache`` for ``model`` whose full-attention layers are ``BufferedLayer``; so are the sliding-window
    layers of a model that masks by layer type (``sliding_window_by_layer_type``): they keep entries past the
    window, which the masks exclude, so that a verified tree can be rolled back anywhere. Other special layers stay
    transformers' own. ``capacity``: entries to preallocate per layer (prompt + new tokens + the largest tree), so
    that decoding never reallocates."""
    cache = DynamicCache(config=model.config)
    sliding = sliding_window_by_layer_type(model)
    buffered = (DynamicLayer, DynamicSlidingWindowLayer) if sliding else (DynamicLayer,)
    if cache.layers:
        cache.layers = [BufferedLayer(capacity) if type(layer) in buffered else layer for layer in cache.layers]
    else:  # no config-derived layers: replicate buffered layers lazily
        cache.layer_class_to_replicate = lambda: BufferedLayer(capacity)
    return cache


def generate_kwargs(model, capacity: int) -> dict:
    """What to hand HF ``model.generate`` so that plain decoding runs as the speculative decoders do: on the
    project's kernels (any linear backend but ``stock``), ``{"cache": new_cache(model, capacity)}``, the buffered
    cache and with it the decoder layers' one-call path (``selfspec.runtime.lean``); on ``stock``, nothing:
    transformers' own cache, as shipped. The baselines of ``selfspec bench`` and ``selfspec demo`` use it."""
    from selfspec.runtime.kernels import linear_backend_of  # kernels imports this module (through lean)

    return {} if linear_backend_of(model) == "stock" else {"cache": new_cache(model, capacity)}


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: selfspec needs a transformers Cache with .layers")
    return layers


def cache_length(cache) -> int:
    return cache.get_seq_length()


def keep_accepted(cache, prefix_length: int, accepted: list[int], layers: range | None = None) -> None:
    """Shrink the cache to ``prefix_length`` entries, then the root and the accepted draft nodes.

    The verification forward appended the root at ``prefix_length`` and node ``i`` at ``prefix_length + 1 + i``.
    When the accepted nodes are ``0..k-1`` (always the case for chains) this is a plain crop; otherwise the accepted
    entries are gathered into place first. ``layers`` restricts the operation to some layer indices (a shallow
    drafter only ever writes its own layers).

    Raises:
        NotImplementedError: on a sliding-window layer that has already dropped old entries.
    """
    all_layers = _layers(cache)
    selected = range(len(all_layers)) if layers is None else layers
    k = len(accepted)
    new_length = prefix_length + 1 + k
    if _keep_in_buffers(all_layers, selected, prefix_length, accepted):
        return
    contiguous = accepted == list(range(k))
    if not contiguous:
        source = torch.tensor(accepted, dtype=torch.long) + (prefix_length + 1)
    for index in selected:
        layer = all_layers[index]
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if getattr(layer, "is_sliding", False) and getattr(layer, "cumulative_length", layer.keys.shape[-2]) != layer.keys.shape[-2]:
            raise NotImplementedError(
                "tree verification past a sliding window is not supported yet; use a prompt + max_new_tokens "
                "shorter than the model's sliding window"
            )
        keys, values = layer.keys, layer.values
        if not contiguous:
            src = source.to(keys.device)
            keys[:, :, prefix_length + 1:new_length] = keys.index_select(2, src)
            values[:, :, prefix_length + 1:new_length] = values.index_select(2, src)
        layer.keys = keys[:, :, :new_length]
        layer.values = values[:, :, :new_length]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = new_length


def _keep_in_buffers(all_layers, selected, prefix_length: int, accepted: list[int]) -> bool:
    """``keep_accepted`` as one extension call (``skinny.keep_entries``: the moves and every layer's new views)
    where every selected layer is a ``BufferedLayer`` with float32 CPU buffers holding the verified step, the path
    ascends, and the extension is already loaded (a GPU or stock run never builds it for this). False otherwise."""
    from selfspec.runtime import skinny  # skinny's kernels import this module's users, not this module

    if not skinny.loaded() or any(b <= a for a, b in zip(accepted, accepted[1:])):
        return False
    chosen = [all_layers[i] for i in selected]
    length = prefix_length + 1 + (accepted[-1] + 1 if accepted else 0)
    for layer in chosen:
        buffer = layer._key_buffer if type(layer) is BufferedLayer else None
        if (buffer is None or layer.keys is None or buffer.dtype != torch.float32 or buffer.device.type != "cpu"
                or layer.keys.shape[-2] < length):
            return False
    keys, values = skinny.keep_entries([layer._key_buffer for layer in chosen],
                                       [layer._value_buffer for layer in chosen], prefix_length, list(accepted))
    for layer, k, v in zip(chosen, keys, values):
        layer.keys, layer.values = k, v
    return True


def crop(cache, length: int, layers: range | None = None) -> None:
    """Drop every entry from position ``length`` on (in ``layers``, default all)."""
    all_layers = _layers(cache)
    for index in range(len(all_layers)) if layers is None else layers:
        layer = all_layers[index]
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = min(layer.cumulative_length, length)


def select_rows(cache, rows: list[int]) -> None:
    """Keep only batch rows ``rows`` (in that order) of every layer (rows that finished leave a batch)."""
    for layer in _layers(cache):
        keys = getattr(layer, "keys", None)
        index = torch.tensor(rows, dtype=torch.long, device=keys.device if keys is not None else "cpu")
        if isinstance(layer, BufferedLayer):
            layer.select_rows(index)
        else:  # transformers' own layers (sliding-window, indexed, linear-attention, dummy) select their own state
            layer.batch_select_indices(index)


def move_entries(cache, moves: list[tuple[int, int, int]]) -> None:
    """Copy, in every layer, the entry at slot ``src`` of batch row ``row`` to slot ``dst`` (``(row, src, dst)``
    triples): the per-row form of :func:`keep_accepted`, for a batch whose rows keep different paths."""
    if not moves:
        return
    rows, src, dst = (torch.tensor(col, dtype=torch.long) for col in zip(*moves))
    for layer in _layers(cache):
        device = layer.keys.device
        r, s, d = rows.to(device), src.to(device), dst.to(device)
        for tensor in (layer.keys, layer.values):
            view = tensor.transpose(1, 2)  # [batch, slots, heads, dim], sharing storage
            view[r, d] = view[r, s]
