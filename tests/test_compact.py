"""s2s/models/compact.py: a weight's nonzero block multiplied in its place; the echo's idle units silenced."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_model import Pages, random_tokens

from s2s import S2SModel
from s2s.models import compact
from s2s.models.shipped import shipped
from s2s.training.echo_init import silence_idle_units


def sparse_weight(out: int = 96, inputs: int = 80, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(out, inputs)
    rows, cols = torch.randperm(out, generator=g)[:20], torch.randperm(inputs, generator=g)[:12]
    w[rows[:, None], cols] = torch.randn(20, 12, generator=g)
    return w


def ws_cols(w: torch.Tensor) -> list[int]:
    return w.ne(0).any(0).nonzero().flatten().tolist()


def test_the_block_gives_the_dense_product_and_is_what_is_multiplied() -> None:
    w = sparse_weight()
    for shape in [(80,), (3, 80), (2, 5, 80)]:
        x = torch.randn(shape)
        torch.testing.assert_close(compact.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-6)
    assert compact._blocks[w].block.shape == (20, 12)


def test_weights_of_one_input_are_one_block() -> None:
    ws = (sparse_weight(seed=1), sparse_weight(out=40, seed=2), torch.zeros(8, 80))
    x = torch.randn(5, 80)
    got = compact.linears(x, *ws)
    for y, w in zip(got, ws, strict=True):
        torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-6)
    assert compact._blocks[ws[0]].block.shape == (40, 12 + 12 - len(set(ws_cols(ws[0])) & set(ws_cols(ws[1]))))
    dense = (torch.randn(96, 80), sparse_weight(seed=3))  # over `WORTH` of them nonzero: each multiplied as it is
    for y, w in zip(compact.linears(x, *dense), dense, strict=True):
        torch.testing.assert_close(y, F.linear(x, w))
    assert compact._blocks[dense[0]].block is None


def test_a_weight_changed_in_place_is_multiplied_as_it_is_now() -> None:
    w, x = sparse_weight(), torch.randn(4, 80)
    compact.linear(x, w)
    w.add_(torch.randn_like(w))  # dense now
    torch.testing.assert_close(compact.linear(x, w), F.linear(x, w))
    assert compact._blocks[w].block is None
    w.zero_()
    assert compact.linear(x, w).eq(0).all() and compact.linear(x, w).shape == (4, 96)


def test_a_view_made_each_call_is_kept_by_its_base() -> None:
    heads = sparse_weight(out=3 * 32).view(3, 32, 80)
    x = torch.randn(2, 80)
    first = compact.linear(x, heads.view(-1, 80))
    block = compact._blocks[heads._base]
    torch.testing.assert_close(compact.linear(x, heads.view(-1, 80)), first)
    assert compact._blocks[heads._base] is block


def test_a_weight_of_other_memory_or_type_is_not_given_the_old_block() -> None:
    """Views of one base with equal shapes, a weight's data swapped, its type changed, other companions."""
    stack, x = torch.stack([sparse_weight(seed=4), sparse_weight(seed=5)]), torch.randn(3, 80)
    for w in (stack[0], stack[1]):
        torch.testing.assert_close(compact.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-6)
    w = sparse_weight(seed=6)
    compact.linear(x, w)
    w.data = sparse_weight(seed=7)
    torch.testing.assert_close(compact.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-6)
    w.data = w.data.double()
    torch.testing.assert_close(compact.linear(x.double(), w), F.linear(x.double(), w))
    q, k1, k2 = sparse_weight(seed=8), sparse_weight(seed=9), sparse_weight(seed=10)
    compact.linears(x, q, k1)
    torch.testing.assert_close(compact.linears(x, q, k2)[1], F.linear(x, k2), rtol=1e-5, atol=1e-6)


def test_a_block_made_in_inference_mode_serves_autograd_and_inference_weights_are_dense() -> None:
    w, x = sparse_weight(seed=11), torch.randn(3, 80, requires_grad=True)
    with torch.inference_mode():
        compact.linear(x.detach(), w)
    compact.linear(x, w).sum().backward()  # a frozen weight, an input that wants its gradient
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, -1))
    with torch.inference_mode():
        frozen = sparse_weight(seed=12)
        compact.linear(x.detach(), frozen)
    assert frozen not in compact._blocks


def test_training_multiplies_the_dense_weight() -> None:
    w = sparse_weight().requires_grad_()
    x = torch.randn(3, 80)
    compact.linear(x, w).sum().backward()
    assert w.grad is not None and w.grad.ne(0).any()
    assert w not in compact._blocks


def test_the_shipped_echo_paged_forward_equals_its_reference() -> None:
    """The paged forward (the blocks) against the no-cache reference (dense matmuls): a prompt, then steps."""
    model = S2SModel.from_pretrained(shipped("model"))
    cfg = model.config
    tokens = random_tokens(cfg, 40, seed=3)
    ref = model(tokens[None])[0]
    pages = Pages(cfg, page_size=16)
    out, _ = pages.step(model, [(0, tokens[:24], 0)])
    got = [out.state[0]]
    for t in range(24, 40):
        out, _ = pages.step(model, [(0, tokens[t : t + 1], t)])
        got.append(out.state[0])
    scale = ref.abs().max()
    for i, state in enumerate(got):
        assert (state - ref[23 + i]).abs().max() <= 1e-5 * scale, i
    assert compact._blocks[model.heads].block is not None  # (the heads' view, made each call, keyed by the heads)
    for layer in model.backbone.layers:  # q, k and v as one block, a small part of them
        attn = layer.self_attn
        block = compact._blocks[attn.q_proj.weight].block
        assert block is not None and block.numel() < 0.2 * 3 * attn.q_proj.weight.numel()


def test_silencing_idle_units_changes_no_output() -> None:
    """Units whose down column is zero, given random gate and up rows (as `planted_init` leaves them), then
    silenced: the same logits, and those rows zero."""
    model = S2SModel.from_pretrained(shipped("model"))
    g = torch.Generator().manual_seed(0)
    idle = []
    with torch.no_grad():
        for layer in model.backbone.layers:
            mlp = layer.mlp
            units = mlp.down_proj.weight.eq(0).all(0)
            shape = (int(units.sum()), mlp.gate_proj.in_features)
            mlp.gate_proj.weight[units] = torch.randn(shape, generator=g)
            mlp.up_proj.weight[units] = torch.randn(shape, generator=g) * 0.02
            idle.append(units)
    tokens = random_tokens(model.config, 30, seed=1)[None]
    before = model(tokens)
    silence_idle_units(model)
    assert torch.equal(model(tokens), before)
    for layer, units in zip(model.backbone.layers, idle, strict=True):
        mlp = layer.mlp
        assert units.any() and mlp.gate_proj.weight[units].eq(0).all() and mlp.up_proj.weight[units].eq(0).all()
