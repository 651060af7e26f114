"""The attention functions: the matmul attention equals SDPA and is taken exactly where it is faster (CPU training
in half precision), including under reentrant activation checkpointing."""

import pytest
import torch
from conftest import tiny_config
from test_modeling import model_for, pixels
from torch.nn import functional as F

from hf_vit.model.attention import matmul_attention_forward


def test_inference_under_autocast_keeps_the_residual_stream_in_fp32(monkeypatch):
    import hf_vit.model.attention as attention

    model, x = model_for(tiny_config(zero_init_head=False)), pixels()
    monkeypatch.setattr(attention, "prefers_matmul_attention", lambda query, training: False)  # SDPA here too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tracked = model(x, output_hidden_states=True)
        with torch.no_grad():
            untracked = model(x, output_hidden_states=True)
    assert [h.dtype for h in untracked.hidden_states] == [torch.float32] * 3
    for free, kept in zip(untracked.hidden_states, tracked.hidden_states):
        assert torch.equal(free, kept)
    assert torch.equal(untracked.logits, tracked.logits)


def test_matmul_attention_computes_what_sdpa_computes():
    module = torch.nn.Module()  # the attention function reads only `.training`
    qkv = torch.randn(2, 17, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    query, key, value = (part.transpose(1, 2) for part in qkv.unbind(2))
    output, probs = matmul_attention_forward(module, query, key, value, None, scaling=8**-0.5)
    reference = F.scaled_dot_product_attention(query, key, value).transpose(1, 2)
    assert probs is None and output.shape == (2, 17, 4, 8)
    torch.testing.assert_close(output, reference, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(output)
    (ours,) = torch.autograd.grad(output, qkv, grad)
    (theirs,) = torch.autograd.grad(reference, qkv, grad)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)


@pytest.fixture
def matmul_attention_calls(monkeypatch):
    """A list that gets an entry each time the model runs `matmul_attention_forward`."""
    import hf_vit.model.attention as attention

    calls = []
    matmul_attention = attention.matmul_attention_forward
    monkeypatch.setattr(
        attention,
        "matmul_attention_forward",
        lambda *args, **kwargs: calls.append(1) or matmul_attention(*args, **kwargs),
    )
    return calls


def test_cpu_bf16_training_takes_the_matmul_attention_path(matmul_attention_calls):
    calls = matmul_attention_calls
    config = tiny_config(zero_init_head=False)
    model, x = model_for(config), pixels()
    labels = torch.tensor([1, 3])
    reference = model(x, labels=labels)
    reference.loss.backward()
    reference_grads = [p.grad.clone() for p in model.parameters()]
    assert calls == []  # fp32 keeps SDPA
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert calls == []  # so does inference
    model.train().zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(x, labels=labels)
    assert len(calls) == config.num_hidden_layers
    low.loss.backward()
    torch.testing.assert_close(low.logits.float(), reference.logits, atol=0.1, rtol=0.1)
    for p, expected in zip(model.parameters(), reference_grads):
        cosine = F.cosine_similarity(p.grad.flatten(), expected.flatten(), dim=0)
        assert cosine > 0.99, cosine


def test_matmul_attention_is_preferred_only_for_cpu_half_precision_training():
    from hf_vit.model.attention import MATMUL_ATTENTION_MAX_TOKENS, prefers_matmul_attention

    def query(tokens=197, dtype=torch.bfloat16):
        return torch.empty(1, 2, tokens, 8, dtype=dtype)

    assert prefers_matmul_attention(query(), training=True)
    assert prefers_matmul_attention(query(dtype=torch.float16), training=True)
    assert prefers_matmul_attention(query().requires_grad_(), training=False)  # eval mode with autograd (saliency)
    assert not prefers_matmul_attention(query(), training=False)  # inference
    assert not prefers_matmul_attention(query(dtype=torch.float32), training=True)
    assert prefers_matmul_attention(query(MATMUL_ATTENTION_MAX_TOKENS), training=True)
    assert not prefers_matmul_attention(query(MATMUL_ATTENTION_MAX_TOKENS + 1), training=True)


def test_reentrant_checkpointing_recomputes_with_the_same_attention_path(matmul_attention_calls):
    # The reentrant forward runs without autograd, its recomputation with it: both must take the matmul path, or
    # the gradients would belong to a different computation than the loss.
    calls = matmul_attention_calls
    config = tiny_config(zero_init_head=False)
    x, labels = pixels(), torch.tensor([1, 3])
    grads = []
    for checkpointing in (False, True):
        model = model_for(config).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=labels).loss
        loss.backward()
        assert len(calls) == config.num_hidden_layers * (2 if checkpointing else 1)
        grads.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, atol=1e-6, rtol=1e-5)


def test_compiling_the_model_warns_nothing():
    # the attention lookup runs in every forward: a compiled model traces it without a warning (an lru_cache there made
    # Dynamo warn at every compilation)
    import warnings

    from hf_vit import VisionTransformerModel

    torch.manual_seed(0)
    model = VisionTransformerModel(tiny_config(attn_implementation="sdpa")).eval()
    pixels = torch.randn(2, 3, model.config.image_size, model.config.image_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(pixels).last_hidden_state, model(pixels).last_hidden_state)
    assert [str(warning.message) for warning in caught] == []
