"""The transformers versions selfspec can drive, checked once when ``selfspec.runtime`` is imported."""

from __future__ import annotations

import transformers

#: transformers 5.24 renamed the models' ``past_key_values`` argument to ``cache``, which selfspec passes. An older
#: model takes ``cache=`` into its ``**kwargs`` and ignores it: every step after the prefill would run without the
#: KV cache and decode wrong tokens (seen on 5.17: the second token already differs from ``generate``).
MIN_TRANSFORMERS = (5, 24)


def check_transformers(version: str | None = None) -> None:
    """Raises: RuntimeError: an installed transformers older than ``MIN_TRANSFORMERS`` (the message says how to
    upgrade)."""
    version = version or transformers.__version__
    found = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if found < MIN_TRANSFORMERS:
        wanted = ".".join(map(str, MIN_TRANSFORMERS))
        raise RuntimeError(f"selfspec needs transformers>={wanted} (its models take the KV cache as `cache=`); found "
                           f"transformers {version}. Upgrade: pip install -U 'transformers>={wanted},<6'")
