"""Probe: where coded_page_lse's time goes (ablations of the current kernel) and a decomposed kernel
q.k~ = q.lo + (q*step).level with the per-page product a batched tensor-core product of exact levels."""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from sparsekv.kernels import reference
from sparsekv.kernels.triton.coded import _lse, coded_lse_parts

_TWO_23 = tl.constexpr(8388608.0)
_TWO_23_BITS = tl.constexpr(0x4B000000)

OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _abl_kernel(q_ptr, kmin_ptr, kmax_ptr, codes_ptr, sp_ptr, len_ptr, out_ptr, part_ptr, n_slots, n_parts,
                scale, sq_b, sq_h, sm_b, sm_h, sm_c, sc_b, sc_h, sc_c, sc_p, ss_b, ss_h, so_b, so_h,
                HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                BLOCK_B: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                NO_LSE: tl.constexpr, NO_UNPACK: tl.constexpr, NO_DEQ: tl.constexpr, F32: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    kvh = row % HKV
    j = tl.arange(0, P)
    i = tl.arange(0, BLOCK_B)
    g = tl.arange(0, G_PAD)
    in_g = g < G
    in_b = (i < D // PER)[None, None, :]
    q_off = b * sq_b + (kvh * G + g)[:, None] * sq_h + i[None, :] * PER
    q_mask = in_g[:, None] & (i < D // PER)[None, :]
    n = tl.load(len_ptr + b)
    blk = tl.program_id(1)
    c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < n_slots
    c3 = c[:, None, None].to(tl.int64)
    m_mask = in_c[:, None, None] & in_b
    byte = tl.load(codes_ptr + b * sc_b + kvh * sc_h + c3 * sc_c + j[None, :, None] * sc_p + i[None, None, :],
                   mask=m_mask, other=0).to(tl.int32)
    m_off = b * sm_b + kvh * sm_h + c3 * sm_c + i[None, None, :] * PER
    logits = tl.zeros((BLOCK_C * P, G_PAD), dtype=tl.float32)
    for k in tl.static_range(PER):
        if NO_UNPACK:
            level = (byte + k).to(tl.float32)
        else:
            level = (((byte >> (k * BITS)) & LEVELS) | _TWO_23_BITS).to(tl.float32, bitcast=True) - _TWO_23
        if NO_DEQ:
            keys = tl.reshape(level, (BLOCK_C * P, BLOCK_B))
        else:
            lo = tl.load(kmin_ptr + m_off + k, mask=m_mask, other=0.0).to(tl.float32)
            step = (tl.load(kmax_ptr + m_off + k, mask=m_mask, other=0.0).to(tl.float32) - lo) / LEVELS
            keys = tl.reshape(lo + step * level, (BLOCK_C * P, BLOCK_B))
        q = tl.load(q_ptr + q_off + k, mask=q_mask, other=0.0)
        if F32:
            logits = tl.dot(keys, tl.trans(q.to(tl.float32)), logits, input_precision="tf32")
        else:
            logits = tl.dot(keys.to(q.dtype), tl.trans(q), logits)
    page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_c, other=-1)
    ok = (page[:, None] >= 0) & (page[:, None] * P + j[None, :] < n)
    logits = tl.where(ok[:, :, None], tl.reshape(logits * scale, (BLOCK_C, P, G_PAD)), float("-inf"))
    if NO_LSE:
        lse = tl.max(logits, 1)
        tot = tl.max(lse, 0)
    else:
        lse = _lse(logits, 1)
        tot = _lse(lse, 0)
    tl.store(out_ptr + b * so_b + (kvh * G + g)[None, :] * so_h + c[:, None], lse, mask=in_c[:, None] & in_g[None, :])
    tl.store(part_ptr + (row * G + g).to(tl.int64) * n_parts + blk, tot, mask=in_g)


@triton.jit
def _dec_kernel(q_ptr, kmin_ptr, kmax_ptr, codes_ptr, sp_ptr, len_ptr, out_ptr, part_ptr, n_slots, n_parts,
                scale, sq_b, sq_h, sm_b, sm_h, sm_c, sc_b, sc_h, sc_c, sc_p, ss_b, ss_h, so_b, so_h,
                HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                BLOCK_B: tl.constexpr, P: tl.constexpr, BLOCK_C: tl.constexpr, BITS: tl.constexpr,
                OPDT: tl.constexpr, NO_LSE: tl.constexpr, NO_QS: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0)
    b = (row // HKV).to(tl.int64)
    kvh = row % HKV
    j = tl.arange(0, P)
    i = tl.arange(0, BLOCK_B)
    g = tl.arange(0, G_PAD)
    in_g = g < G
    in_i = i < D // PER
    q_off = b * sq_b + (kvh * G + g)[:, None] * sq_h + i[None, :] * PER
    q_mask = in_g[:, None] & in_i[None, :]
    n = tl.load(len_ptr + b)
    blk = tl.program_id(1)
    c = blk * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = c < n_slots
    c64 = c.to(tl.int64)
    byte = tl.load(codes_ptr + b * sc_b + kvh * sc_h + c64[:, None, None] * sc_c + j[None, :, None] * sc_p
                   + i[None, None, :], mask=in_c[:, None, None] & in_i[None, None, :], other=0)
    m_off = b * sm_b + kvh * sm_h + c64[:, None] * sm_c + i[None, :] * PER  # (BLOCK_C, BLOCK_B)
    m_mask = in_c[:, None] & in_i[None, :]
    logits = tl.zeros((BLOCK_C, P, G_PAD), dtype=tl.float32)
    base = tl.zeros((BLOCK_C, G_PAD), dtype=tl.float32)
    for k in tl.static_range(PER):
        lo = tl.load(kmin_ptr + m_off + k, mask=m_mask, other=0.0).to(tl.float32)
        step = (tl.load(kmax_ptr + m_off + k, mask=m_mask, other=0.0).to(tl.float32) - lo) / LEVELS
        q = tl.load(q_ptr + q_off + k, mask=q_mask, other=0.0).to(tl.float32) * scale  # (G_PAD, BLOCK_B)
        base += tl.sum(lo[:, None, :] * q[None, :, :], axis=2)
        if NO_QS:
            qs = tl.broadcast_to(tl.trans(q)[None, :, :], (BLOCK_C, BLOCK_B, G_PAD))
        else:
            qs = step[:, :, None] * tl.trans(q)[None, :, :]  # (BLOCK_C, BLOCK_B, G_PAD)
        level = (byte >> (k * BITS)) & LEVELS
        if OPDT == 0:
            logits = tl.dot(level.to(tl.float16), qs.to(tl.float16), logits)
        elif OPDT == 1:
            logits = tl.dot(level.to(tl.bfloat16), qs.to(tl.bfloat16), logits)
        else:
            logits = tl.dot(level.to(tl.float32), qs, logits, input_precision="tf32")
    page = tl.load(sp_ptr + b * ss_b + kvh * ss_h + c, mask=in_c, other=-1)
    ok = (page[:, None] >= 0) & (page[:, None] * P + j[None, :] < n)
    logits = tl.where(ok[:, :, None], logits + base[:, None, :], float("-inf"))
    if NO_LSE:
        lse = tl.max(logits, 1)
        tot = tl.max(lse, 0)
    else:
        lse = _lse(logits, 1)
        tot = _lse(lse, 0)
    tl.store(out_ptr + b * so_b + (kvh * G + g)[None, :] * so_h + c[:, None], lse, mask=in_c[:, None] & in_g[None, :])
    tl.store(part_ptr + (row * G + g).to(tl.int64) * n_parts + blk, tot, mask=in_g)


def launch(kernel, q, kmin, kmax, codes, slot_page, seq_len, scale, bits, block=128, warps=4, heads=8, **flags):
    b, h, d = q.shape
    hkv, c, p = codes.shape[1], codes.shape[2], codes.shape[3]
    block_c = max(max(1, 16 // p), min(max(1, block // p), triton.next_power_of_2(c)))
    n_parts = triton.cdiv(c, block_c)
    out = torch.empty(b, h, c, dtype=torch.float32, device=q.device)
    part = torch.empty(b * h, n_parts, dtype=torch.float32, device=q.device)
    ck = kernel[(b * hkv, n_parts)](
        q, kmin, kmax, codes, slot_page, seq_len, out, part, c, n_parts, scale,
        q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2),
        codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
        slot_page.stride(0), slot_page.stride(1), out.stride(0), out.stride(1),
        HKV=hkv, G=h // hkv, G_PAD=max(heads, triton.next_power_of_2(h // hkv)), D=d,
        BLOCK_B=max(16, triton.next_power_of_2(d * bits // 8)), P=p, BLOCK_C=block_c, BITS=bits,
        num_warps=warps, **flags)
    return out, part, ck


ABL = dict(NO_LSE=False, NO_UNPACK=False, NO_DEQ=False, F32=False)
DEC = dict(OPDT=0, NO_LSE=False, NO_QS=False)
VARIANTS = [
    ("cur", None, {}),
    ("abl full", _abl_kernel, {}),
    ("abl no_lse", _abl_kernel, dict(NO_LSE=True)),
    ("abl no_unpack", _abl_kernel, dict(NO_UNPACK=True)),
    ("abl no_deq", _abl_kernel, dict(NO_DEQ=True)),
    ("abl f32 tf32", _abl_kernel, dict(F32=True)),
    ("dec fp16", _dec_kernel, {}),
    ("dec bf16", _dec_kernel, dict(OPDT=1)),
    ("dec fp16 no_lse", _dec_kernel, dict(NO_LSE=True)),
    ("dec fp16 no_qs", _dec_kernel, dict(NO_QS=True)),
    ("dec fp16 blk256", _dec_kernel, dict(block=256)),
    ("dec fp16 w8", _dec_kernel, dict(warps=8)),
]


def run_variant(kernel, flags, c, bits, scale):
    if kernel is None:
        return coded_lse_parts(c["q"], c["kmin"], c["kmax"], c["codes"][bits], c["slot_page"], c["seq_len"],
                               scale, bits) + (None,)
    f = dict(ABL if kernel is _abl_kernel else DEC)
    kw = {k: flags[k] for k in ("block", "warps", "heads") if k in flags}
    f.update({k: v for k, v in flags.items() if k not in kw})
    return launch(kernel, c["q"], c["kmin"], c["kmax"], c["codes"][bits], c["slot_page"], c["seq_len"], scale,
                  bits, **kw, **f)


def sass_hist(ck):
    try:
        sass = ck.asm["sass"]
    except Exception as e:  # noqa: BLE001
        return {"err": str(e)[:80]}
    hist = {}
    for line in sass.splitlines():
        parts = line.split("*/")
        if len(parts) < 2 or "/*" not in parts[0]:
            continue
        ins = parts[1].strip().split(" ")[0].rstrip(";")
        if ins.startswith("@"):
            ins = parts[1].strip().split(" ")[1]
        op = ins.split(".")[0]
        if op:
            hist[op] = hist.get(op, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: -kv[1])[:14])


def main():
    from sparsekv.bench.lowbit import coded_copies, time_piece
    from sparsekv.timing import Timer
    mode = sys.argv[1] if len(sys.argv) > 1 else "time"
    dev = torch.device("cuda")
    bits_list = [2, 1, 4] if mode == "time" else [2]
    copies = coded_copies("llama3-8b", 131072, 16, tuple(bits_list), dev, 4 if mode == "time" else 1)
    scale = 128 ** -0.5
    c0 = copies[0]
    if mode == "ncu":
        names = sys.argv[2].split(",")
        for name, kernel, flags in VARIANTS:
            if name in names:
                for _ in range(3):
                    run_variant(kernel, flags, c0, 2, scale)
        torch.cuda.synchronize()
        return
    timer = Timer(dev, reps=30)
    rows = []
    for bits in bits_list:
        exact = reference.coded_page_lse(c0["q"].double(), c0["kmin"].double(), c0["kmax"].double(),
                                         c0["codes"][bits], c0["slot_page"], c0["seq_len"], scale, bits)
        fin = exact.isfinite()
        for name, kernel, flags in VARIANTS:
            if bits != 2 and name != "cur":
                continue
            try:
                out, part, ck = run_variant(kernel, flags, c0, bits, scale)
                err = float((out[fin].double() - exact[fin]).norm() / exact[fin].norm())
                infm = bool(torch.equal(out.isinf(), exact.isinf()))
                us = time_piece(timer, lambda c, k=kernel, f=flags: run_variant(k, f, c, bits, scale), copies)
                row = {"bits": bits, "name": name, "us": round(us, 1), "rel_err": err, "inf_match": infm}
                if ck is not None:
                    row.update(n_regs=ck.n_regs, n_spills=ck.n_spills, smem=ck.metadata.shared)
                    if bits == 2:
                        row["sass"] = sass_hist(ck)
            except Exception as e:  # noqa: BLE001
                row = {"bits": bits, "name": name, "error": repr(e)[:300]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(f'b{r["bits"]} {r["name"]:32s} {r.get("us", "-"):>8} us err {r.get("rel_err", "-")} '
              f'regs {r.get("n_regs", "-")} spills {r.get("n_spills", "-")} {r.get("error", "")}')


def cpu_check():
    """Interpreter check of both kernels against float64 on a small awkward shape."""
    torch.manual_seed(0)
    b, hkv, g, d, c, p = 2, 2, 3, 32, 11, 16
    for bits in (1, 2, 4):
        k = torch.randn(b, hkv, c, p, d)
        kmin, kmax = k.amin(3), k.amax(3)
        slot_page = torch.arange(c).repeat(b, hkv, 1)
        slot_page[:, :, -2] = -1
        kmin[:, :, -2], kmax[:, :, -2] = float("inf"), float("-inf")
        seq_len = torch.tensor([c * p - 5, c * p - 40])
        codes = reference.key_codes(k, kmin, kmax, bits)
        q = torch.randn(b, hkv * g, d)
        exact = reference.coded_page_lse(q.double(), kmin.double(), kmax.double(), codes, slot_page, seq_len, 0.3,
                                         bits)
        for name, kernel, flags in VARIANTS:
            if name not in ("abl full", "dec fp16", "dec tf32"):
                continue
            f = dict(ABL if kernel is _abl_kernel else DEC)
            f.update(flags)
            if kernel is _abl_kernel:
                f["F32"] = True
            out, part, _ = launch(kernel, q, kmin, kmax, codes, slot_page, seq_len, 0.3, bits, **f)
            fin = exact.isfinite()
            print(bits, name, float((out[fin].double() - exact[fin]).norm() / exact[fin].norm()),
                  torch.equal(out.isinf(), exact.isinf()))


if __name__ == "__main__":
    cpu_check() if sys.argv[1:] == ["cpu"] else main()
