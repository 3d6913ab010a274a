// The n-gram hash on the device, over a device-resident history (see
// docs/device-hash.md): the same row ids as the host hash (src/hash/) for the
// same history, or an error recorded in the hash's latch.
//
// History: per sequence slot a ring of `ring_len` entries (u64: position in the
// low 32 bits, compressed id in the high 32; position -1 = empty); position p
// lives at p % ring_len. A batch must give each sequence one run of
// consecutive entries at consecutive positions.
//
// One call is three launches on the stream, one block per token each:
//   engram_hash_runs   range checks; the first token of each run tags its
//                      sequence's slot with (serial, token) and marks the slot
//                      when another run of the call tagged it first
//   engram_hash_ids    each token's window (from its run's previous tokens, or
//                      the ring), then its row ids of every layer; writes the
//                      token's status for the commit
//   engram_hash_commit records each valid token's compressed id in the ring
//                      (unless a later position of its run takes the same
//                      entry); block 0 moves the latch to the host mirror and
//                      advances the serial
// `serial` is a device word (u64) so that a replayed graph sees a new one.
//
// Errors (codes ENG_ERR_HASH_*, passed by src/cuda/latch.rs): recorded with
// eng_latch (latch.cuh) in the hash's own latch, ordered token errors before
// look-back errors (the `data_error` bit), then by token. Word 2 carries a
// limit or position, words 4-5 the offending value, word 6 a sequence id.
#include "engram_common.cuh"
#include "latch.cuh"

#define ENG_HASH_OK 0u
#define ENG_HASH_BAD 1u

// The compressed id of a raw token: >= -1, or -2 for a token outside the map.
__device__ __forceinline__ eng_i32 eng_hash_compress(const eng_i32 *__restrict__ token_map, eng_u32 map_len,
                                                     eng_i32 tok) {
    if (tok == -1) return -1;
    if (tok < 0 || (eng_u32)tok >= map_len) return -2;
    return token_map[tok];
}

// Whether token i begins a run (its predecessor in the batch is not the same
// sequence at the previous position).
__device__ __forceinline__ bool eng_hash_run_start(const eng_i32 *seq_ids, const eng_i32 *pos, eng_u32 i) {
    return i == 0u || seq_ids[i - 1u] != seq_ids[i] || (eng_i64)pos[i - 1u] + 1 != (eng_i64)pos[i];
}

// Token i's own errors (not the run check): 0 when none, else its code, with
// the limit and value for the latch.
__device__ __forceinline__ eng_u32 eng_hash_token_error(const eng_i32 *tokens, const eng_i32 *seq_ids,
                                                        const eng_i32 *pos, const eng_i32 *token_map,
                                                        eng_u32 map_len, eng_u32 max_seqs, eng_u32 max_positions,
                                                        eng_u32 i, eng_u32 *limit, eng_i64 *value) {
    const eng_i32 s = seq_ids[i], p = pos[i], tok = tokens[i];
    if (s < 0 || (eng_u32)s >= max_seqs) {
        *limit = max_seqs;
        *value = s;
        return ENG_ERR_HASH_SEQ;
    }
    if (p < 0 || (eng_u32)p >= max_positions) {
        *limit = max_positions;
        *value = p;
        return ENG_ERR_HASH_POS;
    }
    if (eng_hash_compress(token_map, map_len, tok) == -2) {
        *limit = map_len;
        *value = tok;
        return ENG_ERR_HASH_TOKEN;
    }
    return 0u;
}

extern "C" __global__ void engram_hash_runs(const eng_i32 *__restrict__ seq_ids, const eng_i32 *__restrict__ pos,
                                            eng_u32 max_seqs, eng_u64 *tags, eng_u64 *conflicts,
                                            const eng_u64 *serial_word) {
    const eng_u32 i = blockIdx.x;
    if (threadIdx.x != 0u) return;
    const eng_i32 s = seq_ids[i];
    if (s < 0 || (eng_u32)s >= max_seqs || !eng_hash_run_start(seq_ids, pos, i)) return;
    const eng_u64 serial = *serial_word;
    const eng_u64 old = atomicExch(tags + s, (serial << 24) | (eng_u64)i);
    if ((old >> 24) == serial) conflicts[s] = serial;
}

extern "C" __global__ void engram_hash_ids(const eng_i32 *__restrict__ tokens, const eng_i32 *__restrict__ seq_ids,
                                           const eng_i32 *__restrict__ pos, const eng_i32 *__restrict__ token_map,
                                           eng_u32 map_len, eng_i64 pad_id, const eng_i64 *__restrict__ multipliers,
                                           const eng_i64 *__restrict__ primes, const eng_i64 *__restrict__ offsets,
                                           eng_u32 n_layers, eng_u32 max_ngram, eng_u32 n_heads, eng_u32 max_seqs,
                                           eng_u32 max_positions, const eng_u64 *__restrict__ ring, eng_u32 ring_len,
                                           const eng_u64 *__restrict__ conflicts,
                                           const eng_u64 *__restrict__ serial_word, eng_i64 *row_ids,
                                           eng_u32 *status, eng_u32 *latch) {
    __shared__ eng_i64 w[64];
    __shared__ eng_u32 s_ok;
    const eng_u32 i = blockIdx.x;
    const eng_u32 cols = (max_ngram - 1u) * n_heads, per = n_layers * cols;
    const eng_u64 serial = *serial_word;
    if (threadIdx.x == 0u) {
        eng_u32 limit = 0u;
        eng_i64 value = 0;
        eng_u32 code = eng_hash_token_error(tokens, seq_ids, pos, token_map, map_len, max_seqs, max_positions, i,
                                            &limit, &value);
        const eng_i32 s = seq_ids[i], p = pos[i];
        if (code == 0u && conflicts[s] == serial) {
            code = ENG_ERR_HASH_RUNS;
            value = s;
        }
        eng_u32 phase = 0u;
        eng_i32 seq_for_latch = 0;
        if (code == 0u) {
            const eng_i32 c = eng_hash_compress(token_map, map_len, tokens[i]);
            w[0] = c;
            if (c != -1) {
                // Look-back k: the run's token i-k when it is there, else the
                // ring. Blocked (pad) from the first position before 0 or the
                // first dead entry on, as on the host.
                bool blocked = false;
                for (eng_u32 k = 1u; k < max_ngram; k++) {
                    if (!blocked) {
                        if ((eng_i64)k > (eng_i64)p) {
                            blocked = true;
                        } else {
                            const eng_i32 q = p - (eng_i32)k;
                            eng_i32 src;
                            bool found = false, bad = false;
                            if (k <= i && seq_ids[i - k] == s && pos[i - k] == q) {
                                // Same run (runs are consecutive entries, so
                                // no entry between breaks it).
                                src = eng_hash_compress(token_map, map_len, tokens[i - k]);
                                found = src != -2;
                                bad = !found;
                            } else {
                                const eng_u64 e = ring[(eng_u64)s * ring_len + (eng_u32)q % ring_len];
                                src = (eng_i32)(eng_u32)(e >> 32);
                                found = (eng_i32)(eng_u32)(e & 0xFFFFFFFFu) == q;
                            }
                            if (!found || bad) {
                                code = ENG_ERR_HASH_MISSING;
                                phase = 1u;
                                limit = (eng_u32)p;
                                value = q;
                                seq_for_latch = s;
                                break;
                            }
                            blocked = src == -1;
                            w[k] = src;
                        }
                    }
                    if (blocked) w[k] = pad_id;
                }
            }
        }
        if (code != 0u) {
            eng_latch(latch, code, phase, i, limit, 0u, value, (eng_u32)seq_for_latch, 0u);
            status[i] = ENG_HASH_BAD;
            s_ok = 0u;
        } else {
            status[i] = ENG_HASH_OK;
            s_ok = w[0] == -1 ? 2u : 1u;
        }
    }
    __syncthreads();
    const eng_u32 ok = s_ok;
    eng_i64 *out = row_ids + (eng_u64)i * per;
    for (eng_u32 j = threadIdx.x; j < per; j += blockDim.x) {
        if (ok != 1u) {
            out[j] = -1;
            continue;
        }
        const eng_u32 l = j / cols, c = j % cols, k = c / n_heads + 1u;
        const eng_i64 *m = multipliers + (eng_u64)l * max_ngram;
        // The multiply-xor mix of look-backs 0..k, in wrapping 64-bit
        // arithmetic, then rem_euclid and the column's offset.
        eng_u64 rolling = (eng_u64)w[0] * (eng_u64)m[0];
        for (eng_u32 kk = 1u; kk <= k; kk++) rolling ^= (eng_u64)w[kk] * (eng_u64)m[kk];
        const eng_i64 x = (eng_i64)rolling, pr = primes[(eng_u64)l * cols + c];
        eng_i64 r = x % pr;
        if (r < 0) r += pr;
        out[j] = r + offsets[(eng_u64)l * cols + c];
    }
}

extern "C" __global__ void engram_hash_commit(const eng_i32 *__restrict__ tokens,
                                              const eng_i32 *__restrict__ seq_ids, const eng_i32 *__restrict__ pos,
                                              const eng_i32 *__restrict__ token_map, eng_u32 n, eng_u64 *ring,
                                              eng_u32 ring_len, const eng_u32 *__restrict__ status,
                                              eng_u64 *serial_word, eng_u32 *latch, eng_u32 *mirror) {
    const eng_u32 i = blockIdx.x;
    if (threadIdx.x != 0u) return;
    if (i == 0u) {
        // Every block of engram_hash_ids has finished: the latch is final.
        eng_move_latch(latch, mirror);
        // engram_hash_runs and engram_hash_ids of this call have read it.
        *serial_word = *serial_word + 1u;
    }
    if (status[i] != ENG_HASH_OK) return;
    const eng_i32 s = seq_ids[i], p = pos[i];
    // A later valid token of the same run a multiple of R positions ahead
    // takes the same entry: the last one writes it (an invalid one is not
    // recorded, so an earlier one must be).
    for (eng_u64 j = (eng_u64)i + ring_len; j < n; j += ring_len) {
        if (seq_ids[j] != s || (eng_i64)pos[j] != (eng_i64)p + (eng_i64)(j - i)) break;
        if (status[j] == ENG_HASH_OK) return;
    }
    const eng_i32 tok = tokens[i];
    const eng_i32 c = tok == -1 ? -1 : token_map[tok];
    ring[(eng_u64)s * ring_len + (eng_u32)p % ring_len] = ((eng_u64)(eng_u32)c << 32) | (eng_u64)(eng_u32)p;
}

// The range operations of the device history (engram_seq_rm_device,
// engram_seq_cp_device, engram_seq_keep_device, the whole-sequence copy and
// drop): over every entry of the target slots, one thread per entry. The
// targets are slot `dst`, or (dst < 0) every slot but `keep` (keep < 0: every
// slot). An entry of position p lives at p % ring_len in every slot, so the
// entry of `src` at index j is the only one that can land at index j of dst.
//   src >= 0: dst's entries in [p0, p1) become src's there (an entry src
//             does not hold in the range is emptied); dst's others stay
//   src <  0: dst's entries in [p0, p1) are emptied
extern "C" __global__ void engram_hash_seq_edit(eng_u64 *ring, eng_u32 ring_len, eng_u32 n_slots, eng_i32 src,
                                                eng_i32 dst, eng_i32 keep, eng_i32 p0, eng_i32 p1) {
    const eng_u64 n_targets = dst >= 0 ? 1u : (eng_u64)n_slots;
    const eng_u64 total = n_targets * ring_len;
    for (eng_u64 g = (eng_u64)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (eng_u64)gridDim.x * blockDim.x) {
        const eng_u32 j = (eng_u32)(g % ring_len);
        const eng_u32 slot = dst >= 0 ? (eng_u32)dst : (eng_u32)(g / ring_len);
        if (dst < 0 && keep >= 0 && slot == (eng_u32)keep) continue;
        eng_u64 *e = ring + (eng_u64)slot * ring_len + j;
        const eng_i32 ep = (eng_i32)(eng_u32)(*e & 0xFFFFFFFFu);
        const bool e_in = ep >= p0 && ep < p1;
        if (src >= 0) {
            const eng_u64 se = ring[(eng_u64)src * ring_len + j];
            const eng_i32 sp = (eng_i32)(eng_u32)(se & 0xFFFFFFFFu);
            if (sp >= p0 && sp < p1) {
                *e = se;
                continue;
            }
        }
        if (e_in) *e = ~0ull;
    }
}

// engram_seq_add_device, in three launches over slot `seq`, with a scratch of
// ring_len entries and a flag word (0 between calls):
//   engram_hash_shift_scan   copies the slot to the scratch; raises the flag
//                            when an entry in [p0, p1) would land at
//                            max_positions or beyond (then nothing moves)
//   engram_hash_shift_write  unless the flag is up, writes the moved slot:
//                            index j takes the scratch entry at (j - delta)
//                            mod ring_len when that entry is in the range and
//                            lands at 0 or above (the moved token wins), else
//                            its own entry, emptied when that one is in the
//                            range (it moved away or fell below 0)
//   engram_hash_shift_done   one thread: records the flag's error in the
//                            hash's latch (word 6 the sequence, 4-5 the
//                            delta, 2 the limit), moves the latch to the
//                            mirror, lowers the flag
extern "C" __global__ void engram_hash_shift_scan(const eng_u64 *__restrict__ ring, eng_u32 ring_len, eng_i32 seq,
                                                  eng_i32 p0, eng_i32 p1, eng_i32 delta, eng_u32 max_positions,
                                                  eng_u64 *scratch, eng_u32 *flag) {
    for (eng_u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < ring_len; j += gridDim.x * blockDim.x) {
        const eng_u64 e = ring[(eng_u64)seq * ring_len + j];
        scratch[j] = e;
        const eng_i32 ep = (eng_i32)(eng_u32)(e & 0xFFFFFFFFu);
        if (ep >= p0 && ep < p1 && (eng_i64)ep + delta >= (eng_i64)max_positions) {
            // The highest such position, for the message.
            atomicMax(flag, (eng_u32)ep + 1u);
        }
    }
}

extern "C" __global__ void engram_hash_shift_write(eng_u64 *ring, eng_u32 ring_len, eng_i32 seq, eng_i32 p0,
                                                   eng_i32 p1, eng_i32 delta,
                                                   const eng_u64 *__restrict__ scratch,
                                                   const eng_u32 *__restrict__ flag) {
    if (*flag != 0u) return;
    // (j - delta) mod ring_len, with delta of either sign.
    const eng_i64 r = (eng_i64)ring_len;
    const eng_u32 back = (eng_u32)((((eng_i64)(-(eng_i64)delta)) % r + r) % r);
    for (eng_u32 j = blockIdx.x * blockDim.x + threadIdx.x; j < ring_len; j += gridDim.x * blockDim.x) {
        eng_u32 from = j + back;
        if (from >= ring_len) from -= ring_len;
        const eng_u64 se = scratch[from];
        const eng_i32 sp = (eng_i32)(eng_u32)(se & 0xFFFFFFFFu);
        eng_u64 out;
        if (sp >= p0 && sp < p1 && (eng_i64)sp + delta >= 0) {
            const eng_u32 to = (eng_u32)((eng_i64)sp + delta);
            out = (se & 0xFFFFFFFF00000000ull) | (eng_u64)to;
        } else {
            const eng_u64 e = scratch[j];
            const eng_i32 ep = (eng_i32)(eng_u32)(e & 0xFFFFFFFFu);
            out = ep >= p0 && ep < p1 ? ~0ull : e;
        }
        ring[(eng_u64)seq * ring_len + j] = out;
    }
}

extern "C" __global__ void engram_hash_shift_done(eng_i32 seq, eng_i32 delta, eng_u32 max_positions,
                                                  eng_u32 *flag, eng_u32 *latch, eng_u32 *mirror) {
    if (blockIdx.x != 0u || threadIdx.x != 0u) return;
    const eng_u32 f = *flag;
    if (f != 0u) {
        // Position f - 1 is the highest that would land outside.
        eng_latch(latch, ENG_ERR_HASH_SHIFT, 0u, 0u, max_positions, f - 1u, (eng_i64)delta, (eng_u32)seq, 0u);
        *flag = 0u;
    }
    eng_move_latch(latch, mirror);
}
