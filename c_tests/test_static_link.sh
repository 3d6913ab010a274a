#!/usr/bin/env bash
# Static link of an installed engram: a C program linked against PREFIX's
# libengram.a with the system libraries the install documents, then run.
#
#   bash c_tests/test_static_link.sh PREFIX   an existing install (scripts/install.sh PREFIX)
#   bash c_tests/test_static_link.sh          installs into a temporary prefix first
#
# It links the program twice, the two documented ways:
#   1. pkg-config --cflags --libs engram-static   (libengram.a by path + system libs)
#   2. pkg-config --static --libs engram, with -lengram turned into
#      -l:libengram.a (engram.pc's Libs.private are the same system libs)
# and checks that neither binary needs libengram.so, that the system libraries
# are the ones rustc prints (engram.pc, engram-static.pc and the CMake package
# agree), and that the program runs: create, set two layers, hash a batch of two
# sequences with a dead token, apply on 2 threads, fork, drop, a bad call.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CC="${CC:-gcc}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/engram_static_link.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

if [ $# -ge 1 ]; then
    PREFIX="$(realpath "$1")"
else
    PREFIX="$WORK/prefix"
    bash "$ROOT/scripts/install.sh" "$PREFIX" >"$WORK/install.log" 2>&1 || { cat "$WORK/install.log"; exit 1; }
fi
export PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"

FAILED=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; FAILED=1; }

# --- The documented system libraries agree everywhere -------------------------
PRIVATE="$(pkg-config --static --libs engram | tr ' ' '\n' | grep -e '^-l' | grep -vx -- -lengram | paste -sd' ')"
STATIC_PC="$(pkg-config --libs engram-static | tr ' ' '\n' | grep -e '^-l' | paste -sd' ')"
CMAKE_LIBS="$(sed -n 's/^set(engram_STATIC_SYSTEM_LIBS "\(.*\)")$/\1/p' "$PREFIX/lib/cmake/engram/engramConfig.cmake" | tr ';' '\n' | sed 's/^/-l/' | paste -sd' ')"
if [ -n "$PRIVATE" ] && [ "$PRIVATE" = "$STATIC_PC" ] && [ "$PRIVATE" = "$CMAKE_LIBS" ]; then
    pass "system libraries for a static link: $PRIVATE (engram.pc Libs.private, engram-static.pc, CMake)"
else
    fail "system libraries differ: engram.pc '$PRIVATE', engram-static.pc '$STATIC_PC', CMake '$CMAKE_LIBS'"
fi

# --- The program ---------------------------------------------------------------
cat >"$WORK/main.c" <<'C'
/* Links only libengram.a: uses every exported function once. */
#include <engram.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define D 32
#define HC 2
#define HD 32
#define N 3 /* max n-gram */
#define H 2 /* heads */
#define C ((N - 1) * H)
#define NL 2
#define VOCAB 100

static int failures = 0;
#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "check failed line %d: %s (%s)\n", __LINE__,  \
                    #cond, engram_last_error());                           \
            failures++;                                                    \
        }                                                                  \
    } while (0)

static float noise(uint64_t seed, uint64_t i) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull ^ (i + 0x632be59bd9b4e019ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)(z >> 40) / (float)(1u << 24) * 2.0f - 1.0f;
}

static int is_prime(uint64_t n) {
    if (n < 2) return 0;
    for (uint64_t d = 2; d * d <= n; d++)
        if (n % d == 0) return 0;
    return 1;
}

int main(void) {
    const uint32_t layer_ids[NL] = {1, 3};
    int32_t token_map[VOCAB];
    for (int t = 0; t < VOCAB; t++) token_map[t] = t >= 95 ? -1 : t % 80;
    uint64_t mult[NL * N], primes[NL * C], offsets[NL * C], rows[NL] = {0, 0};
    for (int i = 0; i < NL * N; i++) mult[i] = (uint64_t)(i + 1) * 0x5851f42d4c957f2dull | 1u;
    uint64_t p = VOCAB; /* distinct primes above the vocabulary, as SPEC does */
    for (int l = 0; l < NL; l++)
        for (int c = 0; c < C; c++) {
            while (!is_prime(p)) p++;
            primes[l * C + c] = p;
            offsets[l * C + c] = rows[l];
            rows[l] += p++;
        }

    engram_config cfg;
    engram_config_init(&cfg);
    cfg.hidden_size = D; cfg.hc = HC; cfg.head_dim = HD; cfg.n_heads = H; cfg.max_ngram = N;
    cfg.layer_ids = layer_ids; cfg.n_layers = NL;
    cfg.token_map = token_map; cfg.token_map_len = VOCAB; cfg.pad_id = token_map[2];
    cfg.multipliers = mult; cfg.n_multipliers = NL * N;
    cfg.primes = primes; cfg.n_primes = NL * C;
    cfg.offsets = offsets; cfg.n_offsets = NL * C;
    cfg.max_tokens = 16; cfg.max_seqs = 4; cfg.max_positions = 64;
    cfg.n_threads = 2; /* the context's worker threads (pthread) */

    engram_context *ctx = NULL;
    if (engram_create(&cfg, &ctx) != ENGRAM_STATUS_OK) {
        fprintf(stderr, "engram_create: %s\n", engram_last_error());
        return 1;
    }
    CHECK(strcmp(engram_version(), ENGRAM_VERSION_STRING) == 0);

    float *tables[NL], *wkv[NL], *q[NL], *k[NL];
    for (int l = 0; l < NL; l++) {
        size_t nt = rows[l] * HD, nw = (size_t)D * (HC + 1) * C * HD;
        tables[l] = malloc(nt * sizeof(float));
        wkv[l] = malloc(nw * sizeof(float));
        q[l] = malloc(HC * D * sizeof(float));
        k[l] = malloc(HC * D * sizeof(float));
        for (size_t i = 0; i < nt; i++) tables[l][i] = noise(10 + l, i);
        for (size_t i = 0; i < nw; i++) wkv[l][i] = noise(20 + l, i) / 8.0f;
        for (size_t i = 0; i < HC * D; i++) {
            q[l][i] = 1.0f + noise(30 + l, i) / 8.0f;
            k[l][i] = 1.0f + noise(40 + l, i) / 8.0f;
        }
        engram_layer_weights w;
        engram_layer_weights_init(&w);
        w.layer_id = layer_ids[l];
        w.table = tables[l]; w.table_rows = rows[l]; w.table_type = ENGRAM_TYPE_F32;
        w.wkv = wkv[l]; w.wkv_type = ENGRAM_TYPE_F32;
        w.q = q[l]; w.k = k[l]; w.qk_type = ENGRAM_TYPE_F32;
        CHECK(engram_set_layer(ctx, &w) == ENGRAM_STATUS_OK);
    }

    /* Sequence 0 prefills 4 tokens (one dead) while sequence 1 starts. */
    const int32_t tokens[6] = {11, 25, 97, 40, 7, 8};
    const int32_t seqs[6] = {0, 0, 0, 0, 1, 1};
    const int32_t pos[6] = {0, 1, 2, 3, 0, 1};
    size_t per = engram_row_ids_per_token(ctx);
    CHECK(per == NL * C);
    int64_t ids[6 * NL * C];
    CHECK(engram_hash(ctx, tokens, seqs, pos, 6, ids, 6 * per) == ENGRAM_STATUS_OK);
    for (size_t c = 0; c < per; c++) CHECK(ids[2 * per + c] == ENGRAM_ROW_ID_DEAD);

    float hw[6 * HC * D], before[6 * HC * D];
    for (int i = 0; i < 6 * HC * D; i++) hw[i] = before[i] = noise(99, i);
    for (int l = 0; l < NL; l++)
        CHECK(engram_apply(ctx, layer_ids[l], ids, 6, hw, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK);
    for (int t = 0; t < 6; t++) {
        int changed = 0;
        for (int i = 0; i < HC * D; i++) changed |= hw[t * HC * D + i] != before[t * HC * D + i];
        CHECK(changed == (t != 2)); /* the dead token is untouched, the others are not */
    }

    /* Fork sequence 0 into 2, drop 0: 2 continues at position 4. */
    CHECK(engram_seq_cp(ctx, 0, 2, -1, -1) == ENGRAM_STATUS_OK);
    CHECK(engram_seq_rm(ctx, 0, -1, -1) == ENGRAM_STATUS_OK);
    const int32_t t4 = 12, s2 = 2, p4 = 4, s0 = 0;
    int64_t one[NL * C];
    CHECK(engram_hash(ctx, &t4, &s2, &p4, 1, one, per) == ENGRAM_STATUS_OK);
    /* Sequence 0 forgot its history: a bad call, a status, a message. */
    engram_status st = engram_hash(ctx, &t4, &s0, &p4, 1, one, per);
    CHECK(st == ENGRAM_STATUS_ERR_MISSING_HISTORY);
    CHECK(strlen(engram_last_error()) > 0);
    CHECK(strlen(engram_status_str(st)) > 0);

    engram_free(ctx);
    for (int l = 0; l < NL; l++) {
        free(tables[l]); free(wkv[l]); free(q[l]); free(k[l]);
    }
    if (failures) {
        printf("static link program: %d checks failed\n", failures);
        return 1;
    }
    printf("static link program: engram %s, %zu row ids per token, all checks passed\n",
           engram_version(), per);
    return 0;
}
C

link_and_run() { # name, then the link flags
    local name="$1"; shift
    local exe="$WORK/$name"
    if ! "$CC" -std=c11 -Wall -Wextra -Werror -o "$exe" "$WORK/main.c" "$@" >"$WORK/$name.log" 2>&1; then
        cat "$WORK/$name.log"
        fail "$name: link ($CC main.c $*)"
        return
    fi
    if readelf -d "$exe" | grep -q 'NEEDED.*libengram'; then
        fail "$name: the binary needs libengram.so (not a static link)"
        return
    fi
    if out="$("$exe" 2>&1)"; then
        pass "$name: $CC main.c $* -> $out"
    else
        echo "$out"
        fail "$name: run"
    fi
}

# shellcheck disable=SC2046 # word splitting of pkg-config output is intended
link_and_run static-pc $(pkg-config --cflags --libs engram-static)
# shellcheck disable=SC2046
link_and_run static-private $(pkg-config --cflags engram) \
    $(pkg-config --static --libs engram | sed 's/-lengram\b/-l:libengram.a/')

[ "$FAILED" = 0 ] || { echo "static link test FAILED"; exit 1; }
echo "static link test passed"
