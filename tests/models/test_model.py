"""GPT stage module: names, layout-free init, the math against a plain reference, pipeline and TP contracts."""

import math

import pytest
import torch

from megazero.config.schema import ModelConfig
import torch.nn.functional as F

from megazero.models.build import build_gpt, count_parameters
from megazero.parallel.cross_entropy import vocab_parallel_cross_entropy

def Cfg(**overrides) -> ModelConfig:
    """A small model config; tests override what they exercise."""
    values = dict(layers=4, hidden=64, heads=4, seq_len=32, vocab_size=300, ffn_hidden=256)
    values.update(overrides)
    return ModelConfig(**values)


def tokens(cfg, b=2, s=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (b, s or cfg.seq_len), generator=g)


def perturb_vectors(model, seed=1):
    """Biases start at 0 and norms at 1; give them values so a mix-up would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def reference_logits(sd, cfg, x):
    """GPT-2 forward written from the spec's layout, with explicit per-head slicing and a masked softmax."""
    h, nh, d = cfg.hidden, cfg.heads, cfg.hidden // cfg.heads
    b, s = x.shape
    bias = lambda n: sd.get(n)  # noqa: E731
    ln = lambda t, n: F.layer_norm(t, (h,), sd[n + ".weight"], bias(n + ".bias"), 1e-5)  # noqa: E731
    t = sd["embed.tokens.weight"][x] + sd["embed.positions.weight"][:s]
    future = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    for i in range(cfg.layers):
        p = f"layers.{i}."
        a = ln(t, p + "ln1")
        w, wb = sd[p + "attn.qkv.weight"], bias(p + "attn.qkv.bias")
        heads = []
        for j in range(nh):
            rows = [slice(j * 3 * d + k * d, j * 3 * d + (k + 1) * d) for k in range(3)]
            q, k, v = (a @ w[r].T + (wb[r] if wb is not None else 0) for r in rows)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            heads.append(torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v)
        y = torch.cat(heads, -1) @ sd[p + "attn.proj.weight"].T
        t = t + (y + bias(p + "attn.proj.bias") if cfg.bias else y)
        m = ln(t, p + "ln2") @ sd[p + "mlp.fc1.weight"].T
        m = m + bias(p + "mlp.fc1.bias") if cfg.bias else m
        g = 0.5 * m * (1 + torch.tanh(math.sqrt(2 / math.pi) * (m + 0.044715 * m**3)))
        m = g @ sd[p + "mlp.fc2.weight"].T
        t = t + (m + bias(p + "mlp.fc2.bias") if cfg.bias else m)
    return ln(t, "final_norm") @ sd["embed.tokens.weight"][: cfg.vocab_size].T


def test_parameter_names_and_shapes():
    cfg = Cfg(layers=2)
    model = build_gpt(cfg, seed=0)
    h, f = 64, 256
    expected = {"embed.tokens.weight": (384, h), "embed.positions.weight": (32, h)}
    for i in range(2):
        for n, shape in {
            "ln1.weight": (h,), "ln1.bias": (h,), "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,),
            "attn.proj.weight": (h, h), "attn.proj.bias": (h,), "ln2.weight": (h,), "ln2.bias": (h,),
            "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,),
        }.items():
            expected[f"layers.{i}.{n}"] = shape
    expected |= {"final_norm.weight": (h,), "final_norm.bias": (h,)}
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert got == expected
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.layers["1"].attn.proj.weight.tp_split_dim == 1
    assert model.layers["1"].attn.qkv.weight.tp_split_dim == 0
    assert model.embed.tokens.weight.tp_split_dim == 0
    assert model.final_norm.weight.tp_split_dim is None


def test_bias_false_has_no_bias_parameters():
    cfg = Cfg(layers=2, bias=False)
    model = build_gpt(cfg, seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if n.endswith("bias")]
    assert len(names) == 2 + 2 * 6 + 1
    sd = model.state_dict()
    x = tokens(cfg)
    torch.testing.assert_close(model(x)[..., :300], reference_logits(sd, cfg, x), atol=1e-5, rtol=1e-5)


def test_count_parameters():
    for cfg in (Cfg(), Cfg(bias=False), Cfg(layers=3, ffn_hidden=96)):
        model = build_gpt(cfg, seed=0)
        assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    # GPT-2 small with the vocabulary padded to 50304 (nanoGPT's figure 124.48M incl. positions).
    gpt2 = Cfg(layers=12, hidden=768, heads=12, seq_len=1024, vocab_size=50257, ffn_hidden=3072)
    assert count_parameters(gpt2) == 124_475_904


def test_init_depends_only_on_seed_and_name():
    cfg = Cfg()
    whole = dict(build_gpt(cfg, seed=5).named_parameters())
    tail = dict(build_gpt(cfg, seed=5, layer_ids=range(2, 4), first_stage=False).named_parameters())
    assert set(tail) == {n for n in whole if n.startswith(("layers.2.", "layers.3.", "final_norm"))} | {
        "embed.tokens.weight"
    }
    for n, p in tail.items():
        assert torch.equal(p, whole[n]), n
    other = dict(build_gpt(cfg, seed=6).named_parameters())
    for n, p in whole.items():
        if n.endswith("weight") and ".ln" not in n and "norm" not in n:
            assert not torch.equal(p, other[n]), n
    # different names draw different values with the same seed
    assert not torch.equal(whole["layers.0.mlp.fc1.weight"], whole["layers.1.mlp.fc1.weight"])


def test_init_statistics():
    cfg = Cfg(layers=8, hidden=128, heads=4, ffn_hidden=512, init_std=0.02)
    model = build_gpt(cfg, seed=0)
    sd = model.state_dict()
    # 65536 samples: the sample std has relative standard error 1/sqrt(2n) ~ 0.3%; allow 3%.
    residual = 0.02 / math.sqrt(2 * 8)
    for name, std in [
        ("layers.3.mlp.fc2.weight", residual),
        ("layers.5.attn.proj.weight", residual),
        ("layers.3.mlp.fc1.weight", 0.02),
        ("layers.3.attn.qkv.weight", 0.02),
        ("embed.tokens.weight", 0.02),
        ("embed.positions.weight", 0.02),
    ]:
        w = sd[name]
        assert abs(w.std().item() / std - 1) < 0.03, (name, w.std().item(), std)
        assert abs(w.mean().item()) < 4 * std / math.sqrt(w.numel()), name
    assert torch.equal(sd["layers.0.attn.qkv.bias"], torch.zeros(384))
    assert torch.equal(sd["layers.0.ln1.weight"], torch.ones(128))
    assert torch.equal(sd["final_norm.bias"], torch.zeros(128))


@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_reference_attention(bias):
    cfg = Cfg(bias=bias, init_std=0.2)  # large enough that activations reach GELU's curved region
    model = build_gpt(cfg, seed=1)
    perturb_vectors(model)
    x = tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(
            model(x)[..., :300], reference_logits(model.state_dict(), cfg, x), atol=2e-5, rtol=1e-5
        )


def test_loss_and_grads_match_cross_entropy_over_real_vocab():
    cfg = Cfg(layers=2)
    model = build_gpt(cfg, seed=2)
    x = tokens(cfg, seed=1)
    t = tokens(cfg, seed=2)
    t[0, :5] = -100
    loss = model(x, t)
    assert loss.shape == t.shape and loss.dtype == torch.float32
    assert torch.all(loss[0, :5] == 0)
    loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(x)
    assert logits.shape == (2, 32, 384)
    ref = F.cross_entropy(logits[..., :300].reshape(-1, 300), t.reshape(-1), reduction="none").view_as(t)
    torch.testing.assert_close(loss.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
    ref.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)


def test_cross_entropy_bf16_logits_and_grad_dtype():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 256, generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 200, (3, 5), generator=g)
    loss = vocab_parallel_cross_entropy(logits, t, 0, 200)
    ref = F.cross_entropy(logits.float()[..., :200].reshape(-1, 200), t.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.view(3, 5).detach(), atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.all(logits.grad[..., 200:] == 0)


def test_padded_vocab_never_predicted_nor_counted():
    cfg = Cfg(layers=2)
    model = build_gpt(cfg, seed=3)
    x, t = tokens(cfg), tokens(cfg, seed=4)
    with torch.no_grad():
        before = model(x, t)
        logits = model(x)
        assert torch.all(logits[..., 300:] == float("-inf"))
        assert torch.all(torch.isfinite(logits[..., :300]))
        model.embed.tokens.weight[300:] = 50.0  # would dominate every softmax if it were counted
        torch.testing.assert_close(model(x, t), before, atol=0, rtol=0)
        assert model(x).argmax(-1).max() < 300


def test_causal():
    cfg = Cfg(layers=2)
    model = build_gpt(cfg, seed=4)
    x = tokens(cfg)
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:, :300], b[:, 10:, :300])


def test_activation_checkpointing_gives_identical_grads():
    """Full and partial (model.checkpoint_layers: the first k layers) recomputation give the same gradients as
    none, bit for bit with dropout on; and exactly the checkpointed layers run their forward twice."""
    x, t = tokens(Cfg(), seed=5), tokens(Cfg(), seed=6)
    grads, forwards = [], []
    for ckpt, k in ((False, 0), (True, 0), (True, 1)):
        cfg = Cfg(dropout=0.1, activation_checkpointing=ckpt, checkpoint_layers=k)
        model = build_gpt(cfg, seed=7).train()
        calls = [0] * len(model.layers)
        for i, layer in enumerate(model.layers.values()):
            # a pre-hook: recomputation stops early (non-reentrant checkpointing), so post-hooks do not fire
            layer.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        torch.manual_seed(0)
        model(x, t).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        forwards.append(calls)
    assert len(forwards[0]) >= 2
    assert forwards == [[1] * len(forwards[0]), [2] * len(forwards[0]), [2] + [1] * (len(forwards[0]) - 1)]
    for g in grads[1:]:
        for n in grads[0]:
            assert torch.equal(grads[0][n], g[n]), n


def test_dropout_active_in_train_only():
    cfg = Cfg(layers=1, dropout=0.5)
    model = build_gpt(cfg, seed=0)
    x = tokens(cfg)
    with torch.no_grad():
        assert not torch.equal(model.train()(x), model(x))
        assert torch.equal(model.eval()(x), model(x))


def test_pipeline_stages_chain_to_the_whole_model():
    cfg = Cfg()
    x, t = tokens(cfg, seed=8), tokens(cfg, seed=9)
    whole = build_gpt(cfg, seed=11)
    first = build_gpt(cfg, seed=11, layer_ids=range(0, 2), first_stage=True, last_stage=False)
    last = build_gpt(cfg, seed=11, layer_ids=range(2, 4), first_stage=False, last_stage=True)
    assert first.shares_embedding_across_stages and last.shares_embedding_across_stages
    assert not whole.shares_embedding_across_stages
    assert "embed.positions.weight" not in dict(last.named_parameters())
    assert "final_norm.weight" not in dict(first.named_parameters())

    ref = whole(x, t)
    ref.mean().backward()
    hidden = first(x)
    assert hidden.shape == (2, 32, 64)
    loss = last(hidden, t)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    loss.mean().backward()
    wg = {n: p.grad for n, p in whole.named_parameters()}
    for stage in (first, last):
        for n, p in stage.named_parameters():
            if n != "embed.tokens.weight":
                torch.testing.assert_close(p.grad, wg[n], atol=1e-7, rtol=1e-5, msg=n)
    # tied embedding: the two stage copies' grads sum to the whole model's
    tied = first.embed.tokens.weight.grad + last.embed.tokens.weight.grad
    torch.testing.assert_close(tied, wg["embed.tokens.weight"], atol=1e-7, rtol=1e-5)


# --- tensor parallel (2 gloo ranks) ------------------------------------------------------------


def test_layer_norm_returns_the_autocast_dtype():
    """CUDA autocast runs layer_norm in fp32 and returns fp32; the model's norm must hand bf16 to the tensor-parallel
    collectives that follow. An fp32 input under CPU autocast is the same situation (the norm computes in fp32)."""
    from megazero.models.gpt2 import LayerNorm

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    norm = LayerNorm(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = torch.nn.functional.layer_norm(x, (16,), norm.weight, norm.bias)
        y = norm(x)
    assert plain.dtype == torch.float32  # the situation: the norm itself computed and returned fp32
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, plain.to(torch.bfloat16))  # the same values, rounded once
    assert norm(x).dtype == torch.float32  # no autocast: a plain LayerNorm
    assert isinstance(norm, torch.nn.LayerNorm) and [n for n, _ in norm.named_parameters()] == ["weight", "bias"]
