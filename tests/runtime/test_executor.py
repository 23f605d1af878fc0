"""The executor's eager fallback (sgl #22832): a batch the runner refuses is run eagerly, and its
outputs come from that eager forward, never from the graph's static buffers of an earlier replay."""
from attn_backends_runtime.testing.runner_checks import fallback_messages


def test_eager_fallback_returns_the_eager_outputs():
    msgs = fallback_messages()
    assert not msgs, "\n".join(msgs)
