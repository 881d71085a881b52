"""The fast paths: the lean decoding step, the label-shifted loss, and bf16 with its own tolerances. (fp32 parity with transformers, at 1e-5, is in test_model.py and
test_generation.py.)"""
import pytest
import torch
import torch.nn.functional as F
from conftest import padded_batch, tiny_config

from models.gpt2 import GPT2LMHeadModel, lm_loss, position_ids_from_mask

ATOL = 1e-5
# bf16 keeps 8 significant bits (relative step 2**-8 = 0.4%); through a few layers the logits of these tiny models
# stay within 3% of their largest magnitude (measured 0.4-0.9%).
BF16_REL = 3e-2


def model(name="h4-wide", seed=0, **overrides):
    torch.manual_seed(seed)
    m = GPT2LMHeadModel(tiny_config(name, **overrides)).eval()
    with torch.no_grad():  # larger weights than the 0.02 init so that logits are spread and argmax is meaningful
        for p in m.parameters():
            p.mul_(4.0 if p.dim() == 2 else 1.0)
    return m


def _to_bf16(m):
    copy = GPT2LMHeadModel(m.config)
    copy.load_state_dict(m.state_dict())
    return copy.to(torch.bfloat16).eval()


def test_decode_step_equals_the_checked_forward_with_a_cache():
    m = model()
    ids, mask = padded_batch([7, 3, 5], 7, m.config.vocab_size, "left", seed=1)
    nxt = torch.randint(0, m.config.vocab_size, (3, 1))
    full_mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    pos = position_ids_from_mask(full_mask)
    with torch.no_grad():
        cache_a = m.gpt.new_cache(3, 8)
        m.gpt(ids, mask, use_cache=True, past_key_values=cache_a)
        checked = m.gpt(nxt, full_mask, past_key_values=cache_a)["last_hidden_state"][:, -1]
        cache_b = m.gpt.new_cache(3, 8)
        m.gpt(ids, mask, use_cache=True, past_key_values=cache_b)
        lean = m.gpt.decode_step(nxt, pos[:, -1:], full_mask.bool()[:, None, None, :], cache_b)
        whole = m.gpt(torch.cat([ids, nxt], 1), full_mask)["last_hidden_state"][:, -1]
    assert lean.shape == (3, m.config.n_embd) and cache_b.length == 8
    torch.testing.assert_close(lean, checked, atol=ATOL, rtol=0)
    torch.testing.assert_close(lean, whole, atol=ATOL, rtol=0)


def test_generate_sees_weights_changed_behind_autograds_back():
    """Generation reads the weights as they are now: `p.data` edits (which bump no version counter) are seen. The
    decode-time views of the weights (modules/linear.py) must never go stale."""
    m = model()
    ids = torch.randint(0, m.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
    before = m.generate(ids, max_new_tokens=8)
    for layer in m.gpt.gpt_layers:
        layer.self_attention.key.weight.data.mul_(-3.0)
        layer.self_attention.value.weight.data.add_(0.5)
    fresh = GPT2LMHeadModel(m.config).eval()
    fresh.load_state_dict(m.state_dict())
    after = m.generate(ids, max_new_tokens=8)
    assert torch.equal(after, fresh.generate(ids, max_new_tokens=8))
    assert not torch.equal(after, before)


def test_label_shifted_loss_equals_the_logit_shifted_definition():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    labels = torch.randint(0, 11, (3, 6))
    labels[0, 2] = -100
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    targets = labels[:, 1:].masked_fill(~(mask[:, 1:].bool() & mask[:, :-1].bool()), -100)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11), targets.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(lm_loss(logits, labels, mask, 6), expected, atol=1e-6, rtol=0)
    expected_unmasked = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(lm_loss(logits, labels, None, 6), expected_unmasked, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["h3-inner", "h4-wide"])
def test_bf16_logits_are_close_to_fp32(name):
    m = model(name)
    ids, mask = padded_batch([9, 6, 2], 9, m.config.vocab_size, "left", seed=3)
    with torch.no_grad():
        ref = m(ids, mask)["logits"]
        low = _to_bf16(m)(ids, mask)["logits"]
    assert low.dtype == torch.bfloat16
    real = mask.bool()
    err = (low.float() - ref)[real].abs().max()
    assert err <= BF16_REL * ref[real].abs().max(), f"bf16 logits off by {err:.4f} (scale {ref[real].abs().max():.3f})"


def test_bf16_greedy_agrees_where_fp32_is_decisive():
    """Where fp32's best logit leads the runner-up by more than the bf16 error bound, bf16 picks the same token."""
    m = model("h4-wide")
    ids = torch.randint(0, m.config.vocab_size, (64, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = m(ids)["logits"][:, -1]
        low = _to_bf16(m)(ids)["logits"][:, -1].float()
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * BF16_REL * ref.abs().max()
    assert decisive.sum() >= 16, "too few decisive rows to test"
    assert torch.equal(low.argmax(-1)[decisive], ref.argmax(-1)[decisive])
    # Whole greedy sequences: most rows agree token for token (a near-tie may flip one and change the rest).
    fp32_out = m.generate(ids[:16], max_new_tokens=6)
    bf16_out = _to_bf16(m).generate(ids[:16], max_new_tokens=6)
    assert (fp32_out == bf16_out).all(1).float().mean() >= 0.5


def _capture_caches(monkeypatch, m):
    """The KV caches that generate allocates (the ones decoding actually writes)."""
    made = []
    new_cache = m.gpt.new_cache
    monkeypatch.setattr(m.gpt, "new_cache", lambda *a, **k: made.append(new_cache(*a, **k)) or made[-1])
    return made


def test_bf16_generation_batched_left_padded_runs_with_a_bf16_cache(monkeypatch):
    m = _to_bf16(model("h3-inner"))
    ids, mask = padded_batch([5, 2, 4], 5, m.config.vocab_size, "left", seed=5)
    caches = _capture_caches(monkeypatch, m)
    out = m.generate(ids, mask, max_new_tokens=7, do_sample=True, top_p=0.9, generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 12) and out.dtype == torch.long
    assert len(caches) == 1 and caches[0].keys.dtype == torch.bfloat16 and caches[0].length == 11
    greedy = m.generate(ids, mask, max_new_tokens=7)
    for i in range(3):  # a padded row decodes as it would alone, in bf16 too
        alone = ids[i: i + 1, mask[i].bool()]
        assert torch.equal(m.generate(alone, max_new_tokens=7)[0, -7:], greedy[i, -7:])


def test_bf16_autocast_training_step_tracks_fp32():
    m = model("h4-wide", resid_pdrop=0.0)
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    m.train()
    fp32 = m(ids, labels=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = m(ids, labels=ids)
    assert low["loss"].dtype == torch.float32 and low["logits"].dtype == torch.bfloat16
    assert abs(low["loss"].item() - fp32["loss"].item()) <= 1e-2 * fp32["loss"].item()
    low["loss"].backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def _bf16_loss_and_grads(m, ids):
    m.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(ids, labels=ids)["loss"]
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in m.parameters()]


def test_bf16_autocast_training_takes_the_explicit_attention_and_agrees_with_sdpa(monkeypatch):
    """On the CPU, bf16 autocast with gradients takes the explicit attention (faster there than SDPA's backward);
    its loss and gradients agree with SDPA's at bf16's tolerance. fp32 training and bf16 without gradients keep
    SDPA."""
    import modules.attention as attention_module

    m = model("h4-wide")  # eval mode: no dropout, so both paths compute the same function
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    explicit = []
    real = attention_module.CausalSelfAttention.attention
    monkeypatch.setattr(attention_module.CausalSelfAttention, "attention",
                        lambda self, *a: explicit.append(1) or real(self, *a))
    loss, grads = _bf16_loss_and_grads(m, ids)
    assert explicit, "bf16 autocast training did not take the explicit attention"
    explicit.clear()
    m(ids, labels=ids)["loss"].backward()  # fp32 training
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        m(ids)
    assert not explicit, "fp32 training or bf16 inference left SDPA"
    monkeypatch.setattr(attention_module, "explicit_is_faster", lambda query, dropout: False)
    sdpa_loss, sdpa_grads = _bf16_loss_and_grads(m, ids)
    assert abs(loss.item() - sdpa_loss.item()) <= 1e-2 * sdpa_loss.item()
    flat, ref = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in sdpa_grads])
    assert (flat - ref).norm() <= BF16_REL * ref.norm()  # all gradients together: the key bias's is zero up to noise


def test_cpu_training_with_attention_dropout_or_bf16_weights_takes_the_explicit_attention(monkeypatch):
    """fp32 training with attention dropout (where torch's CPU SDPA runs its math fallback with torch's mask) and
    training on bf16 weights take the explicit path; fp32 training without dropout and inference keep SDPA."""
    import modules.attention as attention_module
    from modules import dropout as hashed_dropout

    explicit = []
    real = attention_module.CausalSelfAttention.attention
    monkeypatch.setattr(attention_module.CausalSelfAttention, "attention",
                        lambda self, *a: explicit.append(1) or real(self, *a))
    torch.manual_seed(0)
    dropping = GPT2LMHeadModel(tiny_config("h4-wide", attn_pdrop=0.1)).train()
    ids = torch.randint(0, dropping.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    dropping(ids, labels=ids)["loss"].backward()
    # the explicit path with the hashed dropout's one-pass mask; with it off (GPT2_FAST_DROPOUT=0), SDPA's own dropout
    assert len(explicit) == (dropping.config.n_layer if hashed_dropout.available() else 0)
    explicit.clear()
    with torch.no_grad():
        dropping.eval()(ids)
    plain = GPT2LMHeadModel(tiny_config("h4-wide")).train()
    plain(ids, labels=ids)["loss"].backward()
    assert not explicit, "inference or training without dropout left SDPA"
    plain.to(torch.bfloat16)(ids, labels=ids)["loss"].backward()
    assert len(explicit) == plain.config.n_layer


def test_autocast_decoding_writes_bf16_projections_into_an_fp32_cache(monkeypatch):
    m = model("h5")
    ids = torch.randint(0, m.config.vocab_size, (16, 5), generator=torch.Generator().manual_seed(7))
    ref = m.generate(ids, max_new_tokens=6)
    caches = _capture_caches(monkeypatch, m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m.generate(ids, max_new_tokens=6)
    assert len(caches) == 1 and caches[0].keys.dtype == torch.float32 and caches[0].values.dtype == torch.float32
    assert caches[0].length == 10  # the prompt and 5 decoded tokens were written into it
    # the bf16-rounded projections are stored exactly: each cached key is representable in bf16
    written = caches[0].keys[:, :, :, :10]  # (layers, B, heads, tokens, head_dim)
    assert torch.equal(written, written.to(torch.bfloat16).float())
    assert (out == ref).all(1).float().mean() >= 0.5  # autocast decoding follows fp32's greedy path on most rows


def _decode_path(monkeypatch, path: str) -> list:
    """Linear's one-token products on `path`: "kernel" (the rows kernel, where it pays here) or "torch" (the kernel
    said not to pay, as on CPUs without AVX2: the row-blocked product for one row, (W x^T)^T for more), two threads.
    Returns the list each product taken appends its name to (rows_linear, blocked_product, weight_first)."""
    from modules import linear
    from modules import rows as row_kernel

    if path == "kernel" and not (row_kernel.available() and row_kernel.pays(torch.float32, 8)):
        pytest.skip("the rows kernel does not run or pay on this machine")
    if path == "torch":
        monkeypatch.setattr(row_kernel, "pays", lambda dtype, rows: False)
    torch.set_num_threads(2)  # restored by conftest's restore_threads
    used = []
    for owner, name in ((row_kernel, "rows_linear"), (linear, "blocked_product"), (linear, "weight_first")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name: used.append(_name) or _real(*a))
    return used


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [1, 2, 3, 8])
@pytest.mark.parametrize("out_features", [80, 81])  # 81: rows left over for every block count > 1
def test_decode_linear_kernel_equals_f_linear(monkeypatch, path, bias, batch, out_features):
    """modules.linear.Linear: single tokens in inference take the rows kernel where it pays, else the row-blocked
    batched product (one row) or (W @ x.T).T (several); the values are F.linear's to fp32 rounding, with rows left
    over and with or without a bias."""
    from modules.linear import Linear

    used = _decode_path(monkeypatch, path)
    torch.manual_seed(0)
    layer = Linear(48, out_features, bias=bias)
    x = torch.randn(batch, 1, 48)
    want = F.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        got = layer(x)
    expected = "rows_linear" if path == "kernel" else "blocked_product" if batch == 1 else "weight_first"
    assert used == [expected]
    assert got.shape == (batch, 1, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer(x), want)  # with autograd on (training), F.linear itself
    with torch.no_grad():  # a prompt of 2 rows: the kernel's few-row product (tests/test_prompt_kernel.py), F.linear's
        # values to rounding; of 9 rows by a weight this small: F.linear itself
        two, nine = torch.ones(1, 2, 48), torch.ones(1, 9, 48)
        torch.testing.assert_close(layer(two), F.linear(two, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert torch.equal(layer(nine), F.linear(nine, layer.weight, layer.bias))


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("in_features", [48, 1])
def test_blocked_linear_cuts_the_rows_into_the_blocks_it_is_given(monkeypatch, batch, in_features):
    """blocked_linear: F.linear's values to fp32 rounding for every block count, the product cut into exactly that many
    blocks where each holds a row (2 to out_features), F.linear itself for one block or more blocks than rows."""
    from modules import linear

    shapes = []
    real = linear.blocked_product
    monkeypatch.setattr(linear, "blocked_product", lambda x, views: shapes.append(views.weight.shape) or real(x, views))
    torch.manual_seed(0)
    weight, bias = torch.randn(81, in_features), torch.randn(81)
    x = torch.randn(batch, in_features)
    want = F.linear(x, weight, bias)
    for blocks in (1, 2, 3, 4, 7, 81, 82):
        shapes.clear()
        torch.testing.assert_close(linear.blocked_linear(x, weight, bias, blocks), want, atol=1e-5, rtol=1e-5)
        assert shapes == ([] if blocks in (1, 82) else [(blocks, in_features, 81 // blocks)]), blocks


def test_row_blocks_are_views_of_the_weight_with_the_rest_apart():
    """row_blocks: (blocks, in, size) views of the weight's first blocks x size rows (no copy), the bias alike, the rows
    left over as `rest` (None where none are); None for one block, fewer rows than blocks or a strided weight."""
    from modules.linear import row_blocks

    weight, bias = torch.randn(81, 48), torch.randn(81)
    for blocks in (2, 3, 81):
        views = row_blocks(weight, bias, blocks)
        size = 81 // blocks
        assert views.weight.shape == (blocks, 48, size) and views.weight.data_ptr() == weight.data_ptr()
        assert torch.equal(views.weight.transpose(1, 2).reshape(-1, 48), weight[: blocks * size])
        assert views.bias.shape == (blocks, 1, size) and views.bias.data_ptr() == bias.data_ptr()
        if blocks * size == 81:
            assert views.rest is None
        else:
            rest = blocks * size
            assert torch.equal(views.rest[0], weight[rest:]) and torch.equal(views.rest[1], bias[rest:])
    assert row_blocks(weight, None, 2).bias is None and row_blocks(weight, None, 2).rest[1] is None
    assert row_blocks(weight[:80], bias[:80], 2).rest is None
    assert row_blocks(weight, bias, 1) is None
    assert row_blocks(weight, bias, 82) is None
    assert row_blocks(torch.randn(48, 81).t(), bias, 2) is None


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("bias", [True, False])
def test_decode_linear_views_follow_the_weights(monkeypatch, path, bias):
    """The decode views are built once per layer and must never go stale: in-place steps, `.data` edits,
    load_state_dict (copying or assigning), a replaced parameter and a changed thread count are all seen; unchanged
    weights keep the views they have."""
    from modules.linear import Linear

    _decode_path(monkeypatch, path)
    torch.manual_seed(0)
    layer = Linear(16, 24, bias=bias)
    x = torch.randn(1, 1, 16)

    def check():
        with torch.no_grad():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)

    check()
    if path == "torch":
        views = layer._blocks
        assert views is not None and views[1] is not None
        check()
        assert layer._blocks is views  # nothing changed: the same views
    layer.weight.grad = torch.ones_like(layer.weight)
    torch.optim.SGD(layer.parameters(), lr=0.5).step()  # in place
    check()
    layer.weight.data.mul_(-2.0)  # behind autograd's back
    check()
    state = {"weight": torch.randn(24, 16)} | ({"bias": torch.randn(24)} if bias else {})
    layer.load_state_dict(state)
    check()
    layer.load_state_dict({k: torch.randn_like(v) for k, v in state.items()}, assign=True)
    check()
    layer.weight = torch.nn.Parameter(torch.randn(24, 16))
    check()
    if bias:
        layer.bias.data = torch.randn(24)
        check()
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            check()
    finally:
        torch.set_num_threads(threads)


def test_prepared_rows_serve_their_row_count_only(monkeypatch):
    """Within prepared_rows(model, rows) a decode step of that many rows takes the product prepared on entry; another
    row count prepares its own; the prepared products are dropped on exit."""
    from torch import nn

    from modules import rows as row_kernel
    from modules.linear import Linear, prepared_rows

    if not (row_kernel.available() and row_kernel.pays(torch.float32, 3)):
        pytest.skip("the rows kernel does not run or pay on this machine")
    calls = []
    real = row_kernel.run
    monkeypatch.setattr(row_kernel, "run", lambda call, x: calls.append(call) or real(call, x))
    torch.manual_seed(0)
    layer = Linear(48, 80)
    with torch.no_grad(), prepared_rows(nn.Sequential(layer), 3) as layers:
        assert layers == [layer] and layer.rows_call[0] == 3
        for rows in (3, 2, 3):
            x = torch.randn(rows, 1, 48)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
            assert (calls[-1] is layer.rows_call[1]) == (rows == 3), rows
    assert layer.rows_call is None


def test_clear_derived_weights_counts_the_copies_it_drops():
    """clear_derived_weights: every int8 / int4 copy a quantized call left on the layers and the LM head dropped and
    counted; nothing left to count after."""
    from models.generation import generate
    from modules.linear import Linear, clear_derived_weights

    m = model()
    layers = sum(type(mod) is Linear for mod in m.modules())
    generate(m, torch.tensor([[1, 2, 3]]), max_new_tokens=2, quantize="int8")
    assert clear_derived_weights(m) == layers + 1  # each layer's copy and the LM head's
    assert clear_derived_weights(m) == 0
