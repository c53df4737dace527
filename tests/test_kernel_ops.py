"""The decode ops as registered ``torch.library`` ops: schemas and fake implementations (``opcheck``), tracing by
torch.compile and meta tensors, and the observers of ``kernels.observe``."""

import pytest
import torch

from sparsekv import kernels
from sparsekv.cache import PagedKVCache
from sparsekv.kernels import reference as ref

B, H, HKV, D, P = 2, 4, 2, 8, 4
OPS = ("page_scores", "select_pages", "quest_select", "raas_select", "coded_scores", "lowbit_select", "code_page",
       "sparse_decode", "attend", "attend_with_weights", "attention_mass", "window_token_maxima",
       "sparse_decode_tokens", "append_token", "append_pages", "raas_update", "landmark_means", "landmark_page_scores",
       "landmark_select", "page_means", "spread_stats", "spread_page_scores", "spread_select", "page_stats",
       "merge_lse")


def filled_layer(dtype=torch.float32, lengths=(11, 6), seed=0, device="cpu"):
    """A one-layer paged cache holding random keys and values (left-padded batch of the given lengths)."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    valid = torch.arange(s).unsqueeze(0) >= (s - torch.tensor(lengths)).unsqueeze(1)
    cache = PagedKVCache(num_layers=1, page_size=P)
    cache.begin(s, valid.to(device), B, torch.device(device))
    layer = cache.append(0, torch.randn(B, HKV, s, D, generator=g).to(device, dtype),
                         torch.randn(B, HKV, s, D, generator=g).to(device, dtype))
    return cache, layer


def op_args(dtype=torch.float32):
    """Small random arguments for each op, by name (positional, as the reference takes them)."""
    g = torch.Generator().manual_seed(1)
    cache, layer = filled_layer(dtype)
    seq_len = cache.seq_len
    q = torch.randn(B, H, D, generator=g).to(dtype)
    scores = ref.page_scores(q, layer.kmin, layer.kmax, layer.slot_page)
    slots = ref.select_pages(scores, layer.cur_slot, 2)
    q_pos = (seq_len - 1).view(B, 1)
    k_flat, v_flat = layer.k.flatten(2, 3), layer.v.flatten(2, 3)
    tokens = torch.randint(-1, k_flat.shape[2], (B, HKV, 5), generator=g)
    key_pos = layer.token_position()[:, 0].flatten(1)  # (B, N)
    k_new, v_new = torch.randn(2, B, HKV, D, generator=g).to(dtype)
    return {
        "page_scores": (q, layer.kmin, layer.kmax, layer.slot_page, True),
        "select_pages": (scores, layer.cur_slot, 2),
        "quest_select": (q, layer.kmin, layer.kmax, layer.slot_page, layer.cur_slot, 3, False),
        "raas_select": (q, layer.kmin, layer.kmax, layer.slot_page, layer.cur_slot, torch.tensor([1, 2]), 3),
        "coded_scores": (q, layer.kmin, layer.kmax, ref.key_codes(layer.k, layer.kmin, layer.kmax, 2),
                         layer.slot_page, seq_len, 0.3, 2, True),
        "lowbit_select": (q, layer.k, layer.kmin, layer.kmax, ref.key_codes(layer.k, layer.kmin, layer.kmax, 2),
                          layer.slot_page, layer.cur_slot, seq_len, seq_len - 2, torch.full((B, H, 2), -1), 0.3, 2, 2,
                          2, True),
        "code_page": (layer.k, layer.kmin, layer.kmax, torch.zeros(*layer.k.shape[:4], D // 4, dtype=torch.uint8),
                      layer.cur_slot, 2),
        "sparse_decode": (q, layer.k, layer.v, layer.slot_page, slots, seq_len, 0.3),
        "attend": (q.unsqueeze(2), layer.k, layer.v, layer.slot_page, slots, q_pos, 0.3),
        "attend_with_weights": (q.unsqueeze(2), layer.k, layer.v, layer.slot_page, slots, q_pos, 0.3),
        "attention_mass": (torch.randn(B, H, 3, D, generator=g).to(dtype), layer.k, layer.slot_page, slots,
                           torch.stack([seq_len - 3, seq_len - 1, torch.full_like(seq_len, -1)], 1), 0.3),
        "window_token_maxima": (torch.randn(B, H, 3, D, generator=g).to(dtype), k_flat, key_pos,
                                torch.stack([seq_len - 3, seq_len - 2, seq_len - 1], 1), seq_len - 1, 0.3),
        "sparse_decode_tokens": (q, k_flat, v_flat, tokens, 0.3),
        "append_token": (layer.k, layer.v, layer.kmin, layer.kmax, layer.slot_page, layer.cur_slot, seq_len,
                         k_new, v_new, False),
        "append_pages": (layer.k, layer.v, layer.kmin, layer.kmax, layer.slot_page, layer.cur_slot,
                         torch.randn(1, HKV, 6, D, generator=g).to(dtype),
                         torch.randn(1, HKV, 6, D, generator=g).to(dtype), int(seq_len[1]), 1),
        "raas_update": (scores, layer.slot_page, layer.cur_slot, torch.zeros_like(layer.slot_page), seq_len,
                        torch.tensor([2, 1]), torch.tensor([1, 0]), P, layer.capacity, 1, 0.5, None, 0.3),
        "landmark_means": (layer.k, torch.zeros(*layer.k.shape[:3], 2, D, dtype=dtype), layer.slot_page,
                           layer.cur_slot, seq_len),
        "landmark_page_scores": (q, ref.page_landmarks(layer.k, layer.slot_page, seq_len, 2).to(dtype),
                                 layer.slot_page, seq_len, P, 0.3, True),
        "landmark_select": (q, layer.k, ref.page_landmarks(layer.k, layer.slot_page, seq_len, 2).to(dtype),
                            layer.slot_page, layer.cur_slot, seq_len, 0.3, 2, 1, True),
        "page_means": (layer.k[:1], torch.zeros(1, *layer.k.shape[1:3], 2, D, dtype=dtype),
                       torch.tensor([0, 1, 2, P, P + 1, -1])),
        "spread_stats": (layer.k, torch.zeros(*layer.k.shape[:3], 2, D, dtype=dtype), layer.slot_page,
                         layer.cur_slot, seq_len),
        "spread_page_scores": (q, ref.page_spreads(layer.k, layer.slot_page, seq_len).to(dtype), layer.slot_page,
                               1.5, True),
        "spread_select": (q, layer.k, ref.page_spreads(layer.k, layer.slot_page, seq_len).to(dtype),
                          layer.slot_page, layer.cur_slot, seq_len, 1.5, 2, 1, True),
        "page_stats": (layer.k[:1], torch.zeros(1, *layer.k.shape[1:3], 2, D, dtype=dtype),
                       torch.tensor([0, 1, 2, P, P + 1, -1])),
        "merge_lse": (torch.randn(1, H, 5, D, generator=g).to(dtype), torch.randn(1, H, 5, generator=g),
                      torch.randn(1, H, 5, D, generator=g).to(dtype), torch.randn(1, H, 5, generator=g)),
    }


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    """Schema (mutations declared), fake implementation against the reference, and AOT dispatch with dynamic
    shapes, for each registered op."""
    torch.library.opcheck(getattr(torch.ops.sparsekv, name).default, op_args()[name])


@pytest.mark.parametrize("name", OPS)
def test_names_call_the_registered_ops(name):
    """The package's names keep the reference's signature and results; on CPU they run the reference."""
    public = getattr(kernels, name)
    assert public.__doc__ == getattr(ref, name).__doc__
    args = op_args()
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args[name]]
    got = public(*args[name])
    want = getattr(ref, name)(*before)
    if name in ("append_token", "append_pages"):
        got, want = args[name][:6], before[:6]  # the mutated state
    if name == "raas_update":
        got, want = [args[name][i] for i in (1, 3)], [before[i] for i in (1, 3)]  # slot_page and stamp
    if name == "lowbit_select":
        got, want = [args[name][i] for i in (4, 9)], [before[i] for i in (4, 9)]  # codes and chosen
    if name == "code_page":
        got, want = args[name][3], before[3]  # codes
    if name in ("landmark_means", "page_means", "spread_stats", "page_stats"):
        got, want = args[name][1], before[1]  # means or stats
    if name in ("landmark_select", "spread_select"):
        got, want = (got, args[name][2]), (want, before[2])  # the choice and the means or stats
    for g, w in zip(*(t if isinstance(t, (tuple, list)) else (t,) for t in (got, want))):
        assert torch.equal(g, w)


def test_meta_tensors_give_shapes_and_dtypes():
    for name, args in op_args(torch.bfloat16).items():
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        out = getattr(kernels, name)(*meta)
        real = getattr(ref, name)(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        for m, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (out, real))):
            if r is None:
                assert m is None
            else:
                assert m.device.type == "meta" and (m.shape, m.dtype) == (r.shape, r.dtype), name


@pytest.mark.parametrize("device,backend", [
    ("cpu", "aot_eager"),
    *([("cuda", "aot_eager"), ("cuda", "inductor")] if torch.cuda.is_available() else []),
])
def test_quest_step_compiles_in_one_graph(device, backend):
    """A whole Quest decode step (append, select, attend) traced by torch.compile without a graph break, through
    AOT autograd (which functionalizes append_token's mutations and the attended tokens' running totals), the
    appended state, totals and output equal to eager (on CUDA, with the Triton kernels)."""

    def step(layer_k, layer_v, kmin, kmax, slot_page, cur_slot, attended, seq_len, q, k_new, v_new):
        kernels.append_token(layer_k, layer_v, kmin, kmax, slot_page, cur_slot, seq_len - 1, k_new, v_new, False)
        slots = kernels.quest_select(q, kmin, kmax, slot_page, cur_slot, 2)
        return kernels.sparse_decode(q, layer_k, layer_v, slot_page, slots, seq_len, D ** -0.5, attended), slots

    cache, layer = filled_layer(device=device)
    layer.grow(layer.capacity + 1)  # a free slot for the page the token may start
    attended = torch.full((B, HKV), 3, dtype=torch.long, device=device)
    state = (layer.k, layer.v, layer.kmin, layer.kmax, layer.slot_page, layer.cur_slot, attended)
    g = torch.Generator().manual_seed(2)
    inputs = (cache.seq_len + 1, torch.randn(B, H, D, generator=g).to(device),
              *torch.randn(2, B, HKV, D, generator=g).to(device))
    eager_state = [t.clone() for t in state]
    eager = step(*eager_state, *inputs)
    compiled = torch.compile(step, fullgraph=True, backend=backend)(*state, *inputs)
    for got, want in zip((*state, *compiled), (*eager_state, *eager)):
        assert torch.equal(got, want)
    assert torch.equal(attended, 3 + kernels.count_attended(layer.slot_page, eager[1], inputs[0], P))


def test_observers_see_every_call_with_named_arguments():
    args = op_args()
    seen = []
    with kernels.observe(lambda name, arguments, result: seen.append((name, dict(arguments), result))):
        out = kernels.page_scores(*args["page_scores"][:4])
        slots = kernels.select_pages(out, args["select_pages"][1], num_pages=2)
        kernels.count_attended(args["sparse_decode"][3], slots, args["sparse_decode"][5], P)  # not an op
    kernels.page_scores(*args["page_scores"][:4])  # outside the block: not observed
    assert [s[0] for s in seen] == ["page_scores", "select_pages"]
    assert seen[0][1]["per_query_head"] is False and seen[0][2] is out
    assert seen[1][1]["scores"] is out and seen[1][1]["num_pages"] == 2 and seen[1][2] is slots


def test_merge_lse_gives_the_attention_over_both_parts():
    """Attention over two disjoint key sets, merged by their log-sum-exp (float64), is the attention over the
    union; a position with no key in one part takes the other's."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, 6, D, generator=g, dtype=torch.float64) for _ in range(3))
    kk, vv = (torch.randn(1, H, 9, D, generator=g, dtype=torch.float64) for _ in range(2))
    keys, values = torch.cat([k, kk], 2), torch.cat([v, vv], 2)

    def part(keys, values):
        logits = q @ keys.transpose(-1, -2) * 0.3
        return torch.softmax(logits, -1) @ values, torch.logsumexp(logits, -1)

    out, lse = ref.merge_lse(*part(k, v), *part(kk, vv))
    want, want_lse = part(keys, values)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    a, lse_a = part(k, v)
    empty = torch.full_like(lse_a, float("-inf"))
    out, lse = ref.merge_lse(a, lse_a, torch.zeros_like(a), empty)
    assert torch.equal(out, a) and torch.equal(lse, lse_a)
