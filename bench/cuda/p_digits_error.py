#!/usr/bin/env python3
"""The decode codes kernel's error from the form P takes in its value product, emulated on the CPU
(numpy) on the data of tests/cuda/cuda_cache_test.cc: keys and values quantized as kivi's groups
(per channel over the group's rows), every other step of the kernel exact (float64), so what is
printed is the error that P's rounding alone adds to the output, beside the tests' bounds.

  fp16 hi+lo       main's attend_codes_half.cu: P (relative to the softmax's reference, up to 2^8)
                   as two fp16 parts, ~2^-22 of P
  digits, P sum    docs/benchmarks/cuda/pending_s65's patch as stop 64 wrote it: P / the unit's
                   largest P of its vector as round(P' 32512) (two balanced s8 digits), while the
                   zero points and the softmax's sum weigh the rows by P itself
  digits, own sum  the same digits, the zero points and the softmax's sum weighing the rows by the
                   rounded P' as the codes' sums do (the patch as stop 65 revised and ran it:
                   docs/benchmarks/cuda/device_s65)
  digits, zero own the zero points by the rounded P', the softmax's sum P's own, so the
                   probabilities keep their precision (docs/benchmarks/cuda/pending_s66)

With P itself beside the rounded P', a row's rounding (up to 2^-16 of the unit's largest P) meets
scale * code -- up to the channel's whole range in its group -- instead of its value's distance from
the output.

    /usr/bin/python3 bench/cuda/p_digits_error.py      (~5 s)
"""
import numpy as np

UNIT = 32          # rows a unit: P's digits are relative to the unit's largest P of each query vector
R = 127.0 * 256    # kDigitRange: two balanced s8 digits


def normal(rng, shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def step_rows(rng, n, D):
    """Step(): normal keys and values, every 97th key element x40, every 131st value element x25."""
    k, v = normal(rng, (n, D)), normal(rng, (n, D))
    k.reshape(-1)[::97] *= 40
    v.reshape(-1)[::131] *= 25
    return k, v


def quantize(x, bits, rows):
    """Per channel over groups of `rows` rows (the kernel's groups): scale * code and zero, exactly."""
    sc_code, zero = np.zeros_like(x), np.zeros_like(x)
    for r0 in range(0, len(x), rows):
        g = x[r0:r0 + rows]
        lo, hi = g.min(0), g.max(0)
        scale = np.where(hi > lo, (hi - lo) / (2 ** bits - 1), 1.0)
        sc_code[r0:r0 + rows] = np.rint((g - lo) / scale) * scale
        zero[r0:r0 + rows] = lo
    return sc_code, zero


def attend(P, sc_code, zero, form):
    """Output of one vector's rows [Hq, n] with P exact ([Hq, n], relative to the row max)."""
    Hq, n = P.shape
    L = P.sum(1, keepdims=True)
    ref = P @ (sc_code + zero) / L
    if form == "fp16 hi+lo":
        Pr = P * 2.0 ** 8  # the reference may lag the max by kLeanSlack: P up to 2^8
        hi = Pr.astype(np.float16).astype(np.float64)
        lo = (Pr - hi).astype(np.float16).astype(np.float64)
        out = ((hi + lo) @ sc_code / 2.0 ** 8 + P @ zero) / L
        return ref, out
    pad = (-n) % UNIT
    Pu = np.concatenate([P, np.zeros((Hq, pad))], 1).reshape(Hq, -1, UNIT)
    m = Pu.max(2, keepdims=True)
    m[m == 0] = 1
    Pq = (np.rint(Pu / m * R) / R * m).reshape(Hq, -1)[:, :n]
    if form == "digits, P sum":
        out = (Pq @ sc_code + P @ zero) / L
    elif form == "digits, own sum":
        out = Pq @ (sc_code + zero) / Pq.sum(1, keepdims=True)
    else:
        out = Pq @ (sc_code + zero) / L
    return ref, out


FORMS = ("fp16 hi+lo", "digits, P sum", "digits, own sum", "digits, zero own")


def errors(ref, out):
    l2 = np.sqrt(((out - ref) ** 2).sum() / max((ref ** 2).sum(), 1e-300))
    elem = (np.abs(out - ref) / (1 + np.abs(ref))).max()
    return l2, elem


def every_kind(rng):
    """EveryKindMatchesFloat64AndTheCpuCache's kinds that decode on attend_codes_half.cu: groups of
    2+ units, one query of <= 4 vectors a KV head; the test's lengths and decode checks."""
    worst = {f: [0.0, 0.0] for f in FORMS}
    for kb, vb, group in ((4, 2, 64), (2, 4, 128), (8, 2, 64), (2, 8, 256)):
        for D in (64, 128):
            for G in (1, 4, 3, 2):
                B, H = 2, 2
                rows = [step_rows(rng, 1, D) for _ in range(B * H)]  # (keys, values) a sequence
                checks = []
                for add in (30, 1, 1, 31, 1, 200, 1, 23, 23, 23):
                    for i in range(B * H):
                        k, v = step_rows(rng, add, D)
                        rows[i] = (np.concatenate([rows[i][0], k]), np.concatenate([rows[i][1], v]))
                    checks.append(len(rows[0][0]))
                for n in checks:
                    pairs = {f: ([], []) for f in FORMS}  # refs, outs of the check's sequences
                    for keys, values in rows:
                        k_code, k_zero = quantize(keys[:n], kb, group)
                        sc_code, zero = quantize(values[:n], vb, group)
                        s = normal(rng, (G, D)) @ (k_code + k_zero).T / np.sqrt(D)
                        P = np.exp(s - s.max(1, keepdims=True))
                        for f in FORMS:
                            ref, out = attend(P, sc_code, zero, f)
                            pairs[f][0].append(ref.reshape(-1))
                            pairs[f][1].append(out.reshape(-1))
                    for f, (refs, outs) in pairs.items():
                        l2, el = errors(np.concatenate(refs), np.concatenate(outs))
                        worst[f][0] = max(worst[f][0], l2)
                        worst[f][1] = max(worst[f][1], el)
    return worst


def long_context(rng, n):
    """LongContextAccumulatesWithoutDrift's K4V2 g128: one KV head, 4 query vectors of scale 0.3."""
    D = 128
    k, v = step_rows(rng, n, D)
    kq, kz = quantize(k, 4, 128)
    sc_code, zero = quantize(v, 2, 128)
    q = normal(rng, (4, D), 0.3)
    s = q @ (kq + kz).T / np.sqrt(D)
    P = np.exp(s - s.max(1, keepdims=True))
    return {f: errors(*attend(P, sc_code, zero, f))[0] for f in FORMS}


def main():
    rng = np.random.default_rng(65)
    worst = every_kind(rng)
    print("EveryKindMatchesFloat64AndTheCpuCache, codes-kernel kinds (bounds: L2 2e-5, element 2e-4 (1 + |ref|);")
    print("the CPU kernels' own bound on an element: 4e-3 (1 + |ref|)):")
    for f in FORMS:
        print(f"  {f:16s} worst relative L2 {worst[f][0]:.2e}   worst element {worst[f][1]:.2e}")
    print("LongContextAccumulatesWithoutDrift, K4V2 g128 (bound: at 128k <= max(2 x at 4k, 1e-5)):")
    a4, a128 = long_context(rng, 4096), long_context(rng, 131072)
    for f in FORMS:
        print(f"  {f:16s} relative L2 at 4k {a4[f]:.2e}, at 128k {a128[f]:.2e}")


if __name__ == "__main__":
    main()
