"""Record and replay what the indexers of a DSA model (transformers' DeepSeek-V3.2, GLM-5) return, so that two
models whose attention rounds differently see the same top-k (a tie in the scores cannot make a comparison flaky)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def indexer_calls(model, replay=None, layers=None):
    """Record the top-k every indexer of ``model`` returns (``{layer: [int32 [B, S, k], ...]}``, in call order), or,
    with ``replay`` (such a record), run each indexer (its key cache updated as usual) and return the recorded top-k
    of that layer's next call instead, after checking its shape. ``layers``: the decoder layers (default
    ``model.model.layers``)."""
    record: dict = {}
    patched = []
    for layer in model.model.layers if layers is None else layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is None:  # GLM-5's "shared" layers reuse the previous layer's top-k
            continue
        idx, real = layer.self_attn.layer_idx, indexer.forward

        def forward(*args, _idx=idx, _real=real, **kwargs):
            got = _real(*args, **kwargs)
            if replay is None:
                record.setdefault(_idx, []).append(got.clone())
                return got
            want = replay[_idx].pop(0)
            assert want.shape == got.shape, (want.shape, got.shape)
            return want

        indexer.forward = forward
        patched.append(indexer)
    assert patched
    try:
        yield record
    finally:
        for indexer in patched:
            del indexer.forward
