"""Python peers for `cargo bench --bench cpu`, run in bench/.venv.

  peers.py hash SPEC.json   DeepSeek's numpy hashing approach (vectorised over
                            a [batch, T] array: pad-shifted windows, multiply,
                            XOR, % prime per head) on the tokens in SPEC.json.
  peers.py apply SPEC.json  the engram forward in PyTorch on the CPU: gather
                            fp8 rows + e8m0 scales, dequantise to bf16, F.linear
                            with bf16 wkv, the gate in f32 on an f32 highway;
                            and the same with wkv pre-widened to f32 (F.linear
                            in f32: what a user picks where torch's bf16 GEMM
                            is slow, e.g. CPUs without AVX-512 BF16).

Each prints one JSON line of timings (seconds, medians) and checksums.
"""
import json
import sys
import time

import numpy as np


def median_time(fn, reps, min_time=0.2, clock=time.perf_counter):
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < reps or time.perf_counter() < t_end:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) >= 10 * reps:
            break
    times.sort()
    return times[len(times) // 2]


def cpu_time(fn, reps, min_time=0.2):
    """Median process CPU seconds of fn (on a shared machine, wall time also
    counts the time other processes took the core)."""
    return median_time(fn, reps, min_time, time.process_time)


def ngram_hash(tokens, comp_map, pad_id, mult, primes, offsets, n_layers, N, H):
    """tokens: [B, T] raw ids -> [B, T, layers, (N-1)*H] row ids (DeepSeek's approach)."""
    x = comp_map[tokens]  # compress
    B, T = x.shape
    shifted = [x]
    for k in range(1, N):
        s = np.pad(x, ((0, 0), (k, 0)), constant_values=pad_id)[:, :T]
        shifted.append(s)
    out = np.empty((B, T, n_layers, (N - 1) * H), dtype=np.int64)
    for li in range(n_layers):
        m = mult[li]
        mix = shifted[0] * m[0]
        for k in range(1, N):
            mix = np.bitwise_xor(mix, shifted[k] * m[k])
            for h in range(H):
                col = (k - 1) * H + h
                out[:, :, li, col] = mix % primes[li, k - 1, h] + offsets[li, col]
    return out


def run_hash(spec):
    tm = np.fromfile(spec["token_map"], dtype="<i4").astype(np.int64)
    L, N, H = spec["n_layers"], spec["max_ngram"], spec["heads"]
    C = (N - 1) * H
    mult = np.array(spec["multipliers"], dtype=np.int64).reshape(L, N)
    primes = np.array(spec["primes"], dtype=np.int64).reshape(L, N - 1, H)
    offsets = np.array(spec["offsets"], dtype=np.int64).reshape(L, C)
    pad = spec["pad_id"]
    args = (tm, pad, mult, primes, offsets, L, N, H)
    with np.errstate(over="ignore"):
        prefill = np.array(spec["prefill"], dtype=np.int64)[None, :]
        out = ngram_hash(prefill, *args)
        checksum = int(out.sum())
        t_prefill = median_time(lambda: ngram_hash(prefill, *args), 20)
        c_prefill = cpu_time(lambda: ngram_hash(prefill, *args), 20)
        # Decode: each step, every sequence's last N tokens (its look-back
        # window) as one [64, N] batch; the last column holds the step's ids.
        steps = np.array(spec["decode"], dtype=np.int64)  # [steps + N - 1, seqs]
        n_steps = steps.shape[0] - (N - 1)
        dsum = 0
        for s in range(n_steps):
            win = steps[s : s + N].T  # [seqs, N]
            dsum += int(ngram_hash(win, *args)[:, -1].sum())

        def decode_all():
            for s in range(n_steps):
                ngram_hash(steps[s : s + N].T, *args)[:, -1]

        t_decode = median_time(decode_all, 3) / n_steps
        c_decode = cpu_time(decode_all, 3) / n_steps
    print(json.dumps({"prefill_s": t_prefill, "prefill_sum": checksum, "decode_step_s": t_decode, "decode_sum": dsum,
                      "prefill_cpu_s": c_prefill, "decode_step_cpu_s": c_decode}))


def run_apply(spec):
    import torch

    torch.set_num_threads(spec["threads"])
    g = torch.Generator().manual_seed(0)
    D, hc, Hd, C = spec["D"], spec["hc"], spec["Hd"], spec["C"]
    rows_n = spec["table_rows"]
    K, O = C * Hd, D * (hc + 1)
    eps = 1e-6
    layers = []
    n_layers = 4  # as the Rust side: 1.26 GB of wkv visited in turn, not cache-hot
    for _ in range(n_layers):
        codes = torch.randint(0, 256, (rows_n, Hd), dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] = 0
        table = codes  # fp8 e4m3 codes; torch's CPU index has no float8 kernel, so gather bytes
        scales = torch.randint(120, 130, (rows_n, Hd // 32), dtype=torch.uint8, generator=g)
        wkv = (torch.randn(O, K, generator=g) / 64).to(torch.bfloat16)
        q = 1 + torch.randn(hc, D, generator=g) / 8
        k = 1 + torch.randn(hc, D, generator=g) / 8
        layers.append((table, scales, wkv, q * k, wkv.float()))

    def forward(layer, ids, x, f32):
        table, scales, wkv, qk, wkv32 = layer
        n = ids.shape[0] // C
        r = table[ids].view(torch.float8_e4m3fn).to(torch.float32)  # [n*C, Hd]
        s = torch.exp2(scales[ids].to(torch.float32) - 127.0)  # [n*C, Hd/32]
        r = (r.view(-1, Hd // 32, 32) * s[:, :, None]).to(torch.bfloat16).view(n, K)
        if f32:
            # f32 GEMM on the pre-widened weights, result rounded to bf16 as the reference does.
            kv = torch.nn.functional.linear(r.float(), wkv32).bfloat16().float()
        else:
            kv = torch.nn.functional.linear(r, wkv).float()  # bf16 GEMM, f32 acc, bf16 out
        key = kv[:, : hc * D].view(n, hc, D)
        value = kv[:, hc * D :].view(n, 1, D)
        rx = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        rk = torch.rsqrt(key.pow(2).mean(-1, keepdim=True) + eps)
        dot = (x * qk * key).sum(-1, keepdim=True) * rx * rk / D**0.5
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
        x.add_(gate * value)

    res = {}
    with torch.inference_mode():
        for f32 in (False, True):
            for n in spec["ns"]:
                ids = torch.randint(0, rows_n, (n * C,), generator=g)
                x = torch.randn(n, hc, D, generator=g)
                forward(layers[0], ids, x, f32)
                i = [0]

                def step():
                    i[0] = (i[0] + 1) % n_layers
                    forward(layers[i[0]], ids, x, f32)

                res[("f32_" if f32 else "bf16_") + str(n)] = median_time(step, 5 if n <= 64 else 3)
        # The best GEMM rates torch reaches here (a large square-ish GEMM).
        for name, dt in (("bf16", torch.bfloat16), ("f32", torch.float32)):
            a = torch.randn(1024, K, generator=g).to(dt)
            b = torch.randn(4096, K, generator=g).to(dt)
            t = median_time(lambda: torch.nn.functional.linear(a, b), 3)
            res["gemm_%s_flops" % name] = 2 * 1024 * 4096 * K / t
    print(json.dumps(res))


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        spec = json.load(f)
    {"hash": run_hash, "apply": run_apply}[mode](spec)
