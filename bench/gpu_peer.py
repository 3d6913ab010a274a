"""PyTorch eager peer of `cargo bench --bench gpu` (the engram forward on the GPU).

    gpu_peer.py SPEC.json

SPEC.json names a folder with the benchmark's data (table.u8: fp8 rows of Hd
e4m3 codes + Hd/32 e8m0 scales; wkv.bf16 [D*(hc+1), C*Hd]; q.bf16, k.bf16
[hc, D]; ids.i64 [max tokens, C] row ids) and the token counts to time. For
each count it times, with CUDA events, the same forward engram computes:
gather the rows, dequantise e4m3 * 2^(scale-127) to bf16, F.linear with the
bf16 wkv (f32 accumulate, bf16 out), then the gate in f32 on an f32 highway,
in place. It also runs that forward once on check_in.f32 (n_check tokens) and
compares with engram's result in check_engram.f32.

Prints one JSON line: {"ms": {n: milliseconds per forward}, ...}.
"""
import json
import math
import os
import sys

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except Exception as e:  # noqa: BLE001
    print(f"torch is not available: {e}", file=sys.stderr)
    sys.exit(2)


def main():
    spec = json.load(open(sys.argv[1]))
    if not torch.cuda.is_available():
        print("torch sees no CUDA device", file=sys.stderr)
        sys.exit(2)
    dev = torch.device("cuda:0")
    d = spec["dir"]
    D, hc, Hd, C = spec["D"], spec["hc"], spec["Hd"], spec["C"]
    K = C * Hd
    eps = spec["eps"]
    rb = spec["row_bytes"]

    def load(name, dtype, shape):
        a = np.fromfile(os.path.join(d, name), dtype=dtype).reshape(shape)
        return torch.from_numpy(a).to(dev)

    table = load("table.u8", np.uint8, (spec["rows"], rb))
    wkv = load("wkv.bf16", np.int16, (D * (hc + 1), K)).view(torch.bfloat16)
    q = load("q.bf16", np.int16, (hc, D)).view(torch.bfloat16).float()
    k = load("k.bf16", np.int16, (hc, D)).view(torch.bfloat16).float()
    qk = q * k
    ids_all = load("ids.i64", np.int64, (-1, C))

    def forward(ids, x):
        """ids [n, C] int64, x [n, hc, D] f32 (updated in place)."""
        n = ids.shape[0]
        r = table.index_select(0, ids.reshape(-1))
        codes = r[:, :Hd].contiguous().view(torch.float8_e4m3fn).float()
        scale = torch.exp2(r[:, Hd:].float() - 127.0)
        rows = (codes.view(-1, Hd // 32, 32) * scale[:, :, None]).to(torch.bfloat16).view(n, K)
        kv = F.linear(rows, wkv).float().view(n, hc + 1, D)
        key, value = kv[:, :hc], kv[:, hc]
        rx = torch.rsqrt((x * x).mean(-1) + eps)
        rk = torch.rsqrt((key * key).mean(-1) + eps)
        dot = (x * qk[None] * key).sum(-1) * rx * rk / math.sqrt(D)
        g = torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6))
        x.add_(torch.sigmoid(g)[..., None] * value[:, None, :])

    # The forward check against engram's output.
    nc = spec["n_check"]
    x_in = load("check_in.f32", np.float32, (nc, hc, D))
    want = load("check_engram.f32", np.float32, (nc, hc, D))
    x = x_in.clone()
    forward(ids_all[:nc], x)
    torch.cuda.synchronize()
    diff = (x - want).abs().max().item()
    upd = (want - x_in).abs().max().item()

    ms = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in spec["tokens"]:
        ids = ids_all[:n].contiguous()
        x = torch.randn(n, hc, D, device=dev)
        reps = 20 if n >= 512 else 50
        with torch.no_grad():
            for _ in range(3):
                forward(ids, x)
            torch.cuda.synchronize()
            runs = []
            for _ in range(3):
                start.record()
                for _ in range(reps):
                    forward(ids, x)
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) / reps)
        runs.sort()
        ms[str(n)] = runs[1]
    print(json.dumps({
        "ms": ms,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
        "check_max_abs_diff": diff,
        "check_max_abs_update": upd,
    }))


if __name__ == "__main__":
    main()
