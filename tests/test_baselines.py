"""The eviction baselines: StreamingLLM, H2O, TOVA, SnapKV.

The rule of each method is simulated in plain NumPy on random queries, keys and values (float64), over a prompt and
several decode steps of a batch with different lengths and GQA, and compared with what the method keeps, attends
and outputs. End to end on tiny models: a budget covering the context gives the dense tokens, a padded batch gives
what each sequence gives alone, and memory stops growing at the budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsekv
from sparsekv import H2OConfig, SnapKVConfig, StreamingLLMConfig, TOVAConfig
from sparsekv.cache import PagedKVCache
from sparsekv.kernels import reference
from sparsekv.methods import METHODS
from sparsekv.methods.base import Tally, all_slots
from sparsekv.methods.eviction import drop_lowest, keep_top
from sparsekv.tiny import ARCHITECTURES, byte_tokenizer, tiny_model


# ---------------------------------------------------------------------------------------------- configs and errors

@pytest.mark.parametrize("cls, kwargs, field", [
    (StreamingLLMConfig, dict(token_budget=4), "token_budget"),
    (StreamingLLMConfig, dict(token_budget=16, sink_tokens=-1), "sink_tokens"),
    (StreamingLLMConfig, dict(token_budget=16, page_size=16), "page_size"),
    (H2OConfig, dict(token_budget=0), "token_budget"),
    (H2OConfig, dict(token_budget="64"), "token_budget"),
    (H2OConfig, dict(token_budget=64, recent_fraction=1.5), "recent_fraction"),
    (H2OConfig, dict(token_budget=64, recent_fraction="half"), "recent_fraction"),
    (H2OConfig, dict(token_budget=64, dense_layers=-1), "dense_layers"),
    (TOVAConfig, dict(token_budget=0), "token_budget"),
    (TOVAConfig, dict(token_budget=8, page_size=3), "page_size"),
    (SnapKVConfig, dict(token_budget=16), "token_budget"),
    (SnapKVConfig, dict(token_budget=64, window=0), "window"),
    (SnapKVConfig, dict(token_budget=64, kernel=4), "kernel"),
    (SnapKVConfig, dict(token_budget=64, pooling="min"), "pooling"),
])
def test_bad_config_names_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)



def end_prompt(method, q, layer, plan, scale):
    """What the integration calls after a one-pass prompt's attention in layer 0."""
    method.prefill_chunk(0, q, layer, plan, scale)
    method.prefill(0, q, layer, plan, scale)

def test_dense_layers_beyond_the_model_are_refused():
    with pytest.raises(ValueError, match="dense_layers"):
        TOVAConfig(token_budget=8, dense_layers=5).build(num_layers=4)


def test_registered_and_exported():
    assert METHODS["streamingllm"] is StreamingLLMConfig and METHODS["h2o"] is H2OConfig
    assert METHODS["tova"] is TOVAConfig and METHODS["snapkv"] is SnapKVConfig
    assert all(METHODS[name]().name == name for name in ("streamingllm", "h2o", "tova", "snapkv"))


# ------------------------------------------------------------------------------- brute force on random attention

def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _pool(votes: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """SnapKV's pooling along positions: stride 1, zero padding of kernel // 2 on each side."""
    r = kernel // 2
    padded = np.concatenate([np.zeros(r), votes, np.zeros(r)])
    windows = np.stack([padded[i:i + kernel] for i in range(len(votes))])
    return windows.max(axis=1) if how == "max" else windows.mean(axis=1)


class Simulation:
    """One method's rule on one sequence, per KV head, in NumPy: the positions held and their scores."""

    def __init__(self, cfg, q, k, v, heads: int, kv_heads: int, scale: float):
        self.cfg, self.scale = cfg, scale
        self.h, self.hkv, self.g = heads, kv_heads, heads // kv_heads
        self.k, self.v = list(k), list(v)  # per position: (Hkv, D)
        self.held = [set(range(len(k))) for _ in range(kv_heads)]
        self.score = [dict() for _ in range(kv_heads)]  # H2O's accumulated attention
        self.compress_prompt(q)

    def weights(self, qh: np.ndarray, head: int, positions: list[int]) -> np.ndarray:
        kv = head // self.g
        logits = np.array([self.k[p][kv] @ qh for p in positions]) * self.scale
        return _softmax(logits)

    def compress_prompt(self, q):
        cfg, n = self.cfg, len(self.k)
        name = cfg.name
        keep = cfg.token_budget if name == "snapkv" else cfg.token_budget - 1
        for kv in range(self.hkv):
            group = range(kv * self.g, (kv + 1) * self.g)
            if name == "h2o":
                for i in range(n):
                    for hq in group:
                        for p, w in zip(range(i + 1), self.weights(q[i][hq], hq, list(range(i + 1)))):
                            self.score[kv][p] = self.score[kv].get(p, 0.0) + w
            if n <= keep:
                continue
            if name == "streamingllm":
                s = cfg.sink_tokens
                self.held[kv] = set(range(s)) | set(range(n - (keep - s), n))
            elif name == "h2o":
                recent = set(range(n - cfg.recent + 1, n))
                rest = sorted(set(range(n)) - recent, key=lambda p: -self.score[kv][p])
                self.held[kv] = recent | set(rest[:keep - len(recent)])
            elif name == "tova":
                w = np.mean([self.weights(q[n - 1][hq], hq, list(range(n))) for hq in range(self.h)], axis=0)
                self.held[kv] = set(np.argsort(-w, kind="stable")[:keep].tolist())
            elif name == "snapkv":
                start = max(0, n - cfg.window)
                votes = np.zeros(n)
                for i in range(start, n):
                    for hq in group:
                        votes[:i + 1] += self.weights(q[i][hq], hq, list(range(i + 1)))
                votes[start:] = 0.0
                pooled = _pool(votes, cfg.kernel, cfg.pooling)
                rest = sorted(range(start), key=lambda p: -pooled[p])  # stable: ties keep the earlier position
                self.held[kv] = set(range(start, n)) | set(rest[:keep - (n - start)])
        if name == "h2o":
            self.score = [{p: s for p, s in self.score[kv].items() if p in self.held[kv]} for kv in range(self.hkv)]

    def step(self, q, k, v) -> tuple[np.ndarray, list[int]]:
        """Appends a token, attends, applies the rule. Returns the output (H, D) and the count attended per KV
        head."""
        cfg, name = self.cfg, self.cfg.name
        self.k.append(k)
        self.v.append(v)
        n = len(self.k)
        for kv in range(self.hkv):
            self.held[kv].add(n - 1)
            self.score[kv][n - 1] = 0.0
        out, weights, attended = [], [], [len(h) for h in self.held]
        for hq in range(self.h):
            kv = hq // self.g
            pos = sorted(self.held[kv])
            w = self.weights(q[hq], hq, pos)
            out.append(sum(wi * self.v[p][kv] for wi, p in zip(w, pos)))
            weights.append(dict(zip(pos, w)))
        for kv in range(self.hkv):
            held = self.held[kv]
            if name == "h2o":
                for hq in range(kv * self.g, (kv + 1) * self.g):
                    for p, w in weights[hq].items():
                        self.score[kv][p] += w
            if name == "snapkv" or len(held) < cfg.token_budget:
                continue
            if name == "streamingllm":
                held.remove(min(p for p in held if p >= cfg.sink_tokens))
            elif name == "h2o":
                old = [p for p in held if p <= n - cfg.recent]
                held.remove(min(old, key=lambda p: self.score[kv][p]))
            elif name == "tova" and kv == 0:
                assert all(h == held for h in self.held)  # every head drops the same tokens
                mean = {p: np.mean([weights[hq][p] for hq in range(self.h)]) for p in held}
                victim = min(held, key=mean.get)
                for h in self.held:
                    h.remove(victim)
        return np.stack(out), attended


def _held(layer, b: int, kv: int) -> set[int]:
    sp = layer.slot_page[b, kv]
    return set(sp[sp >= 0].tolist())


CASES = [
    StreamingLLMConfig(token_budget=12, sink_tokens=3),
    StreamingLLMConfig(token_budget=40, sink_tokens=4),
    H2OConfig(token_budget=12, recent_fraction=0.25),
    H2OConfig(token_budget=9, recent_fraction=0.0),
    H2OConfig(token_budget=10, recent_fraction=1.0),
    TOVAConfig(token_budget=12),
    TOVAConfig(token_budget=1),
    SnapKVConfig(token_budget=12, window=4, kernel=3),
    SnapKVConfig(token_budget=10, window=3, kernel=5, pooling="avg"),
    SnapKVConfig(token_budget=40, window=4),
]


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.name}-{c.token_budget}")
@pytest.mark.parametrize("seed", [0, 100])
def test_keeps_exactly_what_its_rule_says(cfg, padding, seed, monkeypatch):
    monkeypatch.setattr(reference, "MASS_CHUNK_WEIGHTS", 300)  # several query chunks in the prompt scoring
    gen = torch.Generator().manual_seed(CASES.index(cfg) * 2 + (padding == "left") + seed)
    heads, kv_heads, d, steps = 4, 2, 8, 10
    lengths = [20, 9, 14]
    b, s = len(lengths), max(lengths)
    scale = d ** -0.5

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 1.5

    q, k, v = rand(b, heads, s, d), rand(b, kv_heads, s, d), rand(b, kv_heads, s, d)
    cols = torch.arange(s)
    lens = torch.tensor(lengths)
    valid = cols >= (s - lens)[:, None] if padding == "left" else cols < lens[:, None]
    method = cfg.build(num_layers=1)
    cache = PagedKVCache(1, cfg.page_size, method.max_pages)
    plan = cache.begin(s, valid, b, torch.device("cpu"))
    layer = cache.append(0, k, v)
    end_prompt(method, q, layer, plan, scale)

    sims = []
    for i in range(b):
        real = valid[i].nonzero().squeeze(1)
        qi, ki, vi = q[i][:, real].transpose(0, 1), k[i][:, real].transpose(0, 1), v[i][:, real].transpose(0, 1)
        sims.append(Simulation(cfg, qi.numpy(), ki.numpy(), vi.numpy(), heads, kv_heads, scale))
    for i, sim in enumerate(sims):
        assert [_held(layer, i, kv) for kv in range(kv_heads)] == sim.held

    for _ in range(steps):
        qt, kt, vt = rand(b, heads, d), rand(b, kv_heads, 1, d), rand(b, kv_heads, 1, d)
        cache.begin(1, None, b, torch.device("cpu"))
        layer = cache.append(0, kt, vt)
        tally = Tally(b, qt.device)
        out = method.decode(0, qt, layer, cache.seq_len, scale, tally)
        attended = tally.total
        for i, sim in enumerate(sims):
            ref, counts = sim.step(qt[i].numpy(), kt[i, :, 0].numpy(), vt[i, :, 0].numpy())
            np.testing.assert_allclose(out[i].numpy(), ref, rtol=1e-9, atol=1e-12)
            assert attended[i].tolist() == counts
            assert [_held(layer, i, kv) for kv in range(kv_heads)] == sim.held
            full = cfg.name == "snapkv" or cache.lengths[i] < cfg.token_budget
            budget_kept = min(cache.lengths[i], cfg.token_budget) if full else cfg.token_budget - 1
            if cfg.name != "snapkv":
                assert all(len(h) == budget_kept for h in sim.held)
        if cfg.name != "snapkv":
            assert layer.capacity <= cfg.token_budget


def test_h2o_scores_follow_their_tokens_through_a_reorder():
    """Beam search reorders the batch: accumulated scores and dropped counts must move with their rows."""
    cfg = H2OConfig(token_budget=6, recent_fraction=0.34)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 10, 8, generator=gen, dtype=torch.float64) for h in (2, 1, 1))
    method = cfg.build(1)
    cache = PagedKVCache(1, 1)
    plan = cache.begin(10, torch.tensor([[True] * 10, [False] * 3 + [True] * 7]), 2, torch.device("cpu"))
    layer = cache.append(0, k, v)
    end_prompt(method, q, layer, plan, 0.3)
    before = {name: t.clone() for name, t in layer.slot_state.items()}
    held, dropped = layer.slot_page.clone(), list(layer.dropped)
    cache.reorder(torch.tensor([1, 0]))
    assert torch.equal(layer.slot_page, held.flip(0)) and layer.dropped == dropped[::-1]
    assert all(torch.equal(layer.slot_state[n], t.flip(0)) for n, t in before.items())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_h2o_prompt_scores_from_the_prompt_attentions_lse(dtype):
    """A chunked, left-padded prompt: H2O's accumulated scores from the log-sum-exps that the prompt's attention
    hands to ``prefill_chunk`` equal those it computes itself (the kernel's first pass)."""
    from sparsekv.integrations.transformers import prompt_attention

    mask = torch.tensor([[True] * 13, [False] * 4 + [True] * 9])
    scores = []
    for reuse in (True, False):
        method = H2OConfig(token_budget=64).build(1)
        cache = PagedKVCache(1, 1)
        g = torch.Generator().manual_seed(5)
        for start, end in ((0, 6), (6, 13)):
            q, k, v = (torch.randn(2, h, end - start, 8, generator=g, dtype=dtype) for h in (4, 2, 2))
            plan = cache.begin(end - start, mask[:, start:end], 2, torch.device("cpu"), prompt_end=end == 13)
            layer = cache.append(0, k, v)
            _, lse = prompt_attention(q, layer, plan, 0.35)
            method.prefill_chunk(0, q, layer, plan, 0.35, lse if reuse else None)
        scores.append(layer.slot_state["h2o_score"].clone())
    assert scores[0].abs().sum() > 0
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=1e-7)


def test_chunk_after_the_prompt_is_refused_by_an_evicting_method():
    method = TOVAConfig(token_budget=4).build(1)
    cache = PagedKVCache(1, 1)
    x = torch.randn(1, 1, 6, 4)
    plan = cache.begin(6, None, 1, torch.device("cpu"))
    end_prompt(method, torch.randn(1, 1, 6, 4), cache.append(0, x, x), plan, 0.5)
    cache.begin(3, None, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="one token per forward pass"):
        cache.append(0, x[:, :, :3], x[:, :, :3])


def test_compact_keeps_held_tokens_in_order_and_moves_state():
    cache = PagedKVCache(1, 2)
    k = torch.arange(2 * 1 * 9 * 1, dtype=torch.float32).view(2, 1, 9, 1)
    cache.begin(9, torch.tensor([[True] * 9, [False] * 4 + [True] * 5]), 2, torch.device("cpu"))
    layer = cache.append(0, k, -k)
    layer.free(torch.tensor([[[0, 2]], [[1, 0]]]), torch.tensor([[[True, True]], [[True, False]]]))
    layer.slot_state["s"] = layer.slot_page.double()
    keys = {b: layer.k[b, 0][layer.slot_page[b, 0] >= 0].flatten().tolist() for b in range(2)}
    order = layer.compact(3)
    assert layer.capacity == 3 and layer.k.shape[2] == 4 and order.tolist() == [[[1, 3, 4]], [[0, 2, 1]]]
    assert layer.slot_page.tolist() == [[[1, 3, 4, -1]], [[0, 2, -1, -1]]]
    assert torch.equal(layer.slot_state["s"], layer.slot_page.double())
    assert {b: layer.k[b, 0][layer.slot_page[b, 0] >= 0].flatten().tolist() for b in range(2)} == keys
    assert layer.cur_slot.tolist() == [[2], [1]]  # the slots of each row's last page
    assert torch.equal(layer.kmax[0, 0, :3], torch.tensor([[3.0], [7.0], [8.0]]))


@pytest.mark.parametrize("seed", range(6))
def test_decode_eviction_drops_what_keep_top_drops(seed):
    """``drop_lowest`` (a decode step's eviction) frees the slot ``keep_top`` frees, in rows holding ``keep`` + 1
    tokens at scattered slots, and leaves rows holding ``keep`` or fewer alone; scores with ties and +inf (protected
    tokens), in float32 and float64."""
    g = torch.Generator().manual_seed(seed)
    keep, rows, heads, n = 5, 4, 3, 9
    cache = PagedKVCache(1, 1)
    cache.begin(n, None, rows, torch.device("cpu"))
    layer = cache.append(0, torch.randn(rows, heads, n, 2, generator=g), torch.randn(rows, heads, n, 2, generator=g))
    held = [keep + 1, keep + 1, keep, 2]
    drop = torch.stack([torch.stack([torch.randperm(n, generator=g) >= held[b] for _ in range(heads)])
                        for b in range(rows)])
    layer.free(all_slots(layer), torch.cat([drop, torch.zeros(rows, heads, 1, dtype=torch.bool)], dim=2))
    score = torch.randint(0, 3, layer.slot_page.shape, generator=g).to(torch.float64 if seed % 2 else torch.float32)
    score = score.masked_fill(torch.rand(score.shape, generator=g) < 0.2, float("inf"))
    before = layer.slot_page.clone()
    keep_top(layer, score, keep)
    want = layer.slot_page.clone()
    layer.slot_page.copy_(before)
    drop_lowest(layer.slot_page, layer.slot_ids, score, keep)
    assert torch.equal(layer.slot_page, want)
    assert torch.equal(want[2:], before[2:]) and not torch.equal(want[:2], before[:2])


def _eviction_inputs(name: str, g: torch.Generator) -> tuple:
    """slot_page (3, 2, 10) of rows holding 6, 5 and 2 of 9 slots, and the keep-score arguments of ``name``."""
    rows, kv_heads, heads, n = 3, 2, 4, 9
    held = torch.tensor([6, 5, 2]).view(rows, 1, 1)
    order = torch.stack([torch.stack([torch.randperm(n, generator=g) for _ in range(kv_heads)]) for _ in range(rows)])
    slot_page = torch.where(order < held, order + 3 * held, -1)
    slot_page = torch.cat([slot_page, torch.full((rows, kv_heads, 1), -1)], dim=2)
    seq_len = slot_page.amax(dim=(1, 2)) + 1
    weights = torch.rand(rows, heads, n + 1, generator=g)
    if name == "streamingllm":
        return slot_page, (2,)
    if name == "h2o":
        cur = slot_page.argmax(dim=2)
        return slot_page, (torch.rand(rows, kv_heads, n + 1, generator=g), cur, weights, seq_len, 3)
    return slot_page, (weights, heads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, cls", [("streamingllm", "StreamingLLM"), ("h2o", "H2O"), ("tova", "TOVA")])
def test_step_eviction_on_cuda_does_what_the_eager_step_does(name, cls):
    """A decode step's eviction compiled by torch.compile on CUDA (``EvictionMethod.step_eviction``) frees the
    slots, counts the tokens and (H2O) accumulates the scores that its torch ops do on the CPU; on CUDA every tensor
    is the view of a pool's first rows (``PagedLayer.rows``), whose other row it leaves alone. Rows, budgets and
    counting vary from call to call, as over a server's steps, within torch.compile's recompilation limit."""
    import importlib
    module = importlib.import_module(f"sparsekv.methods.{'streaming' if name == 'streamingllm' else name}")
    step = getattr(module, cls).step_eviction
    for seed, (rows, keep, count) in enumerate([(3, 5, True), (2, 4, True), (3, 5, False), (1, 3, True),
                                                (3, 2, False), (2, 5, True)]):
        slot_page, args = _eviction_inputs(name, torch.Generator().manual_seed(seed))
        slot_page, args = slot_page[:rows], [a[:rows] if isinstance(a, torch.Tensor) else a for a in args]
        tensors = [a for a in (slot_page, *args) if isinstance(a, torch.Tensor)]
        pools = [torch.cat([t, t[:1]]).cuda() for t in tensors]  # a spare last row, a copy of row 0
        views = iter(pool[:-1] for pool in pools)
        on_cuda = [next(views) if isinstance(a, torch.Tensor) else a for a in (slot_page, *args)]
        on_cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in (slot_page, *args)]
        states = []
        for moved in (on_cpu, on_cuda):
            device = moved[0].device
            counted = torch.zeros(slot_page.shape[:2], dtype=torch.long, device=device) if count else None
            step(moved[0], torch.arange(slot_page.shape[2], device=device), counted, keep, *moved[1:])
            states.append([t.cpu() for t in (moved[0], counted, *moved[1:]) if isinstance(t, torch.Tensor)])
        for cpu, cuda in zip(*states):
            torch.testing.assert_close(cuda, cpu)
        assert not torch.equal(states[0][0], slot_page)
        for pool, t in zip(pools, tensors):
            assert torch.equal(pool[-1].cpu(), t[0])


def test_one_token_pages_store_no_key_bounds():
    cache = PagedKVCache(1, 1)
    cache.begin(5, None, 1, torch.device("cpu"))
    layer = cache.append(0, torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))
    assert torch.equal(layer.kmin, layer.k[:, :, :, 0]) and torch.equal(layer.kmax, layer.k[:, :, :, 0])
    assert cache.resident_bytes() == 2 * layer.k.numel() * 4 + layer.slot_page.numel() * 8


# ------------------------------------------------------------------------------------------------- end to end

def _generate(model, cfg, ids, mask=None, new=12):
    with sparsekv.apply(model, cfg) as session:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[:, ids.shape[1]:], session


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_budget_covering_the_context_gives_the_dense_tokens(arch):
    model = tiny_model(arch, layers=2)
    ids = torch.randint(3, 259, (2, 30), generator=torch.Generator().manual_seed(1))
    dense, _ = _generate(model, sparsekv.DenseConfig(), ids)
    for cfg in (StreamingLLMConfig(token_budget=42), H2OConfig(token_budget=42), TOVAConfig(token_budget=42),
                SnapKVConfig(token_budget=30, window=8), H2OConfig(token_budget=64, dense_layers=1)):
        tokens, session = _generate(model, cfg, ids)
        assert torch.equal(tokens, dense), cfg
        assert session.stats.summary()["fraction"] == 1.0


@pytest.mark.parametrize("cfg", [StreamingLLMConfig(token_budget=20), H2OConfig(token_budget=20),
                                 TOVAConfig(token_budget=20), SnapKVConfig(token_budget=20, window=6),
                                 H2OConfig(token_budget=20, dense_layers=1)], ids=lambda c: c.name)
def test_padded_batch_equals_each_sequence_alone(cfg):
    model = tiny_model("qwen2", layers=2, dtype=torch.float64)
    tok = byte_tokenizer()
    texts = ["The grass is green. The sky is blue. The sun", "Pass key 4821.", "Here we go again, and again"]
    batch = tok(texts, return_tensors="pt", padding=True)
    together, _ = _generate(model, cfg, batch["input_ids"], batch["attention_mask"])
    for i, text in enumerate(texts):
        alone, _ = _generate(model, cfg, tok([text], return_tensors="pt")["input_ids"])
        assert torch.equal(together[i], alone[0]), text


@pytest.mark.parametrize("cfg", [StreamingLLMConfig(token_budget=16), H2OConfig(token_budget=16),
                                 TOVAConfig(token_budget=16, dense_layers=1)], ids=lambda c: c.name)
def test_memory_stops_growing_at_the_budget(cfg):
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(2))
    sizes = []
    with sparsekv.apply(model, cfg) as session, torch.no_grad():
        out = model(ids, use_cache=True)
        cache = session.cache
        for _ in range(30):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            sizes.append(cache.resident_bytes())
        for idx, layer in enumerate(cache.pages.layers):
            held = (layer.slot_page >= 0).sum(-1)
            expected = 40 if idx < cfg.dense_layers else cfg.token_budget - 1
            assert (held == expected).all()
    evicting = [l for i, l in enumerate(cache.pages.layers) if i >= cfg.dense_layers]
    assert all(layer.capacity == cfg.token_budget for layer in evicting)
    if cfg.dense_layers == 0:
        assert len(set(sizes[5:])) == 1  # from the step that reached the budget on
    assert session.stats.summary()["attended_per_head"] < session.stats.summary()["context_per_head"]


def test_snapkv_keeps_the_compressed_prompt_plus_every_decode_token():
    model = tiny_model("mistral", layers=2)
    ids = torch.randint(3, 259, (1, 120), generator=torch.Generator().manual_seed(4))
    cfg = SnapKVConfig(token_budget=24, window=8)
    _, session = _generate(model, cfg, ids, new=10)
    _, dense = _generate(model, sparsekv.DenseConfig(page_size=1), ids, new=10)
    for layer in session.cache.pages.layers:
        assert ((layer.slot_page >= 0).sum(-1) == 24 + 9).all()  # the 10th token is never fed back
    assert session.cache.resident_bytes() < dense.cache.resident_bytes() / 2
    assert session.stats.summary()["attended_per_head"] == 24 + (1 + 9) / 2  # steps attend 25 .. 33
