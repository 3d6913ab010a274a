/*
 * libengram inside a ggml graph (ggml's CPU backend), against calling
 * engram_apply directly: bit for bit.
 *
 * The model is tests/golden/data/tiny.gguf (D 64, hc 4, engram layers 1 and
 * 3, N 3). Two contexts are opened from it with the same options: `g` is
 * driven the way an engine drives it through integrations/ggml/engram_ggml.h
 * (row ids hashed into the graph's I64 input when the inputs are filled, a
 * graph of engram(1) -> ggml_scale(0.5) -> engram(3) on the highway tensor,
 * computed with ggml's threads), `d` through plain engram_hash + engram_apply
 * (+ the same exact scale by 0.5 in C). Every batch checks:
 *   - the row ids in the graph's input equal those of `d`, and those of a
 *     fresh context fed the test's model of the history in order (so a
 *     history operation that went wrong is caught, not just mirrored);
 *   - the highway ggml computed is bit-identical to `d`'s (memcmp), and the
 *     engram layers changed every live token.
 *
 * The steps run in order over three sequences; each step is one function in
 * the `steps` table below: an optional history operation (applied to both
 * contexts and to the model), then one batch; see the comment above it.
 *
 * Usage: test_ggml path/to/tiny.gguf N_THREADS
 */
#include "engram_ggml.h"

#include "ggml-cpu.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define D 64
#define HC 4
#define HW (D * HC)
#define MAX_POS 256
#define N_SEQ 3 /* the third: the slot a saved state is restored into */
#define MAX_BATCH 32
#define VOCAB 48
#define NEVER (-2) /* a position the model says was never hashed */

static const uint32_t LAYERS[2] = {1, 3};

static const char *g_path;
static uint32_t g_threads;

/* The two contexts, and the test's model of each sequence's history:
 * hist[s][p] is the token at position p, or NEVER. */
static engram_context *g_ctx, *d_ctx;
static int32_t hist[N_SEQ][MAX_POS];
static size_t per_token;

/* One batch: token i of sequence seq[i] at pos[i]. */
typedef struct {
    int32_t tok[MAX_BATCH], seq[MAX_BATCH], pos[MAX_BATCH];
    uint32_t n;
    int bf16; /* the highway in bf16 (the graph is then engram(1) -> engram(3)) */
} batch;

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static int32_t next_token(void) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int32_t)((rng >> 33) % VOCAB);
}

static void batch_add(batch *b, int32_t seq, int32_t pos, int32_t tok) {
    b->tok[b->n] = tok;
    b->seq[b->n] = seq;
    b->pos[b->n] = pos;
    b->n++;
}

static engram_context *open_model(void) {
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    o.n_threads = g_threads;
    o.max_seqs = N_SEQ + 2;
    o.max_positions = MAX_POS;
    o.max_tokens = MAX_BATCH;
    engram_context *c = NULL;
    engram_status st = engram_create_from_gguf(g_path, &o, &c);
    if (st != ENGRAM_STATUS_OK) {
        printf("FAIL engram_create_from_gguf(%s): %d %s\n", g_path, (int)st, engram_last_error());
        exit(1);
    }
    return c;
}

static uint16_t f32_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u); /* nearest even; the inputs are finite */
    return (uint16_t)(u >> 16);
}

/* The highway input of a batch: deterministic, and different per step. */
static void fill_highway(void *hw, uint32_t n, int bf16, int step) {
    for (uint32_t i = 0; i < n * HW; i++) {
        float v = (float)((int)((i * 7u + (uint32_t)step * 13u) % 23u) - 11) / 8.0f;
        if (bf16) {
            ((uint16_t *)hw)[i] = f32_to_bf16_bits(v);
        } else {
            ((float *)hw)[i] = v;
        }
    }
}

/* The ids a fresh context gives the batch after being fed the model's history
 * (every position of each sequence below the batch's first, in order). */
static int fresh_ids(const batch *b, int64_t *out) {
    engram_context *f = open_model();
    int ok = 1;
    for (int32_t s = 0; s < N_SEQ && ok; s++) {
        int32_t first = MAX_POS;
        for (uint32_t i = 0; i < b->n; i++)
            if (b->seq[i] == s && b->pos[i] < first) first = b->pos[i];
        if (first == MAX_POS) continue;
        for (int32_t p = 0; p < first && ok; p++) {
            if (hist[s][p] == NEVER) continue;
            int64_t scratch[64];
            ok = engram_hash(f, &hist[s][p], &s, &p, 1, scratch, 64) == ENGRAM_STATUS_OK;
        }
    }
    ok = ok && engram_hash(f, b->tok, b->seq, b->pos, b->n, out, b->n * per_token) == ENGRAM_STATUS_OK;
    engram_free(f);
    return ok;
}

/* Run one batch through both paths and compare. */
static void run_batch(const char *step, int step_no, const batch *b) {
    const size_t elt = b->bf16 ? 2 : 4;
    const size_t hw_bytes = (size_t)b->n * HW * elt;

    /* --- the ggml side: graph build, inputs, compute -------------------- */
    struct ggml_init_params ip = {16u << 20, NULL, false};
    struct ggml_context *gctx = ggml_init(ip);
    struct ggml_tensor *hw = ggml_new_tensor_3d(gctx, b->bf16 ? GGML_TYPE_BF16 : GGML_TYPE_F32, D, HC, b->n);
    ggml_set_input(hw);
    struct ggml_tensor *ids = engram_ggml_new_row_ids(gctx, g_ctx, b->n);
    engram_ggml_layer l1, l3;
    engram_ggml_layer_init(&l1, g_ctx, LAYERS[0], D, HC);
    engram_ggml_layer_init(&l3, g_ctx, LAYERS[1], D, HC);
    struct ggml_tensor *cur = engram_ggml_apply(gctx, hw, ids, &l1);
    if (!b->bf16 && cur) cur = ggml_scale(gctx, cur, 0.5f);
    if (cur) cur = engram_ggml_apply(gctx, cur, ids, &l3);
    if (!check(cur != NULL, "%s: the graph builds", step)) {
        ggml_free(gctx);
        return;
    }
    struct ggml_cgraph *gf = ggml_new_graph(gctx);
    ggml_build_forward_expand(gf, cur);
    /* Fill the inputs: the highway and (the engine's set_input) the row ids. */
    fill_highway(hw->data, b->n, b->bf16, step_no);
    engram_status st = engram_ggml_set_row_ids(g_ctx, ids, b->tok, b->seq, b->pos, b->n);
    check(st == ENGRAM_STATUS_OK, "%s: engram_ggml_set_row_ids (status %d)", step, (int)st);
    enum ggml_status gs = ggml_graph_compute_with_ctx(gctx, gf, (int)g_threads);
    check(gs == GGML_STATUS_SUCCESS && l1.status == ENGRAM_STATUS_OK && l3.status == ENGRAM_STATUS_OK,
          "%s: ggml_graph_compute (%d threads): ggml %d, engram layers %d %d %s%s", step, (int)g_threads, (int)gs,
          (int)l1.status, (int)l3.status, l1.message, l3.message);

    /* --- the direct side ------------------------------------------------ */
    int64_t *d_ids = (int64_t *)malloc(b->n * per_token * sizeof(int64_t));
    int64_t *f_ids = (int64_t *)malloc(b->n * per_token * sizeof(int64_t));
    void *d_hw = malloc(hw_bytes), *in_hw = malloc(hw_bytes);
    if (!d_ids || !f_ids || !d_hw || !in_hw) {
        printf("FAIL out of memory\n");
        exit(1);
    }
    fill_highway(d_hw, b->n, b->bf16, step_no);
    memcpy(in_hw, d_hw, hw_bytes);
    st = engram_hash(d_ctx, b->tok, b->seq, b->pos, b->n, d_ids, b->n * per_token);
    uint32_t ty = b->bf16 ? ENGRAM_TYPE_BF16 : ENGRAM_TYPE_F32;
    if (st == ENGRAM_STATUS_OK) st = engram_apply(d_ctx, LAYERS[0], d_ids, b->n, d_hw, ty, NULL);
    if (!b->bf16)
        for (uint32_t i = 0; i < b->n * HW; i++) ((float *)d_hw)[i] *= 0.5f;
    if (st == ENGRAM_STATUS_OK) st = engram_apply(d_ctx, LAYERS[1], d_ids, b->n, d_hw, ty, NULL);
    check(st == ENGRAM_STATUS_OK, "%s: direct engram_hash + engram_apply (status %d)", step, (int)st);

    /* --- compare -------------------------------------------------------- */
    check(memcmp(ids->data, d_ids, b->n * per_token * sizeof(int64_t)) == 0,
          "%s: the graph's row ids equal engram_hash's (%u tokens x %zu)", step, b->n, per_token);
    check(fresh_ids(b, f_ids) && memcmp(d_ids, f_ids, b->n * per_token * sizeof(int64_t)) == 0,
          "%s: ... and a fresh context's fed the history in order", step);
    int same = memcmp(cur->data, d_hw, hw_bytes) == 0;
    size_t first_diff = 0;
    if (!same)
        while (first_diff < hw_bytes && ((unsigned char *)cur->data)[first_diff] == ((unsigned char *)d_hw)[first_diff])
            first_diff++;
    check(same, "%s: ggml's highway is bit-identical to engram_apply's (%zu bytes, %s)%s", step, hw_bytes,
          b->bf16 ? "bf16" : "f32", same ? "" : " <- differs");
    if (!same) note("first differing byte %zu (token %zu)", first_diff, first_diff / (HW * elt));
    /* Every live token changed (the engram term is not zero in this model)
     * and every dead one (row ids ENGRAM_ROW_ID_DEAD: the token map's -1
     * entries) did not; the f32 graph also halves the highway, so compare
     * against that. */
    uint32_t live_changed = 0, live = 0, dead_kept = 0, dead = 0;
    for (uint32_t t = 0; t < b->n; t++) {
        int is_dead = d_ids[t * per_token] == ENGRAM_ROW_ID_DEAD;
        int c = 0;
        if (b->bf16) {
            c = memcmp((char *)cur->data + t * HW * elt, (char *)in_hw + t * HW * elt, HW * elt) != 0;
        } else {
            const float *o = (const float *)cur->data + t * HW, *x = (const float *)in_hw + t * HW;
            for (int i = 0; i < HW; i++) c |= o[i] != x[i] * 0.5f;
        }
        live += !is_dead;
        dead += is_dead;
        live_changed += !is_dead && c;
        dead_kept += is_dead && !c;
    }
    check(live_changed == live && dead_kept == dead && live > 0,
          "%s: the engram layers changed every live token (%u of %u) and no dead one (%u kept of %u)", step,
          live_changed, live, dead_kept, dead);

    /* The model of the history follows the batch. */
    for (uint32_t i = 0; i < b->n; i++) hist[b->seq[i]][b->pos[i]] = b->tok[i];
    free(d_ids);
    free(f_ids);
    free(d_hw);
    free(in_hw);
    ggml_free(gctx);
}

/* Next free position of sequence s in the model. */
static int32_t seq_len(int32_t s) {
    int32_t p = MAX_POS;
    while (p > 0 && hist[s][p - 1] == NEVER) p--;
    return p;
}

/* ------------------------------------------------------------------------ */
/* The steps. Each: an optional history operation on g_ctx, d_ctx and the
 * model (hist), then one batch through run_batch.                           */

/* Prefill both sequences in one batch: 17 tokens of seq 0, 9 of seq 1,
 * interleaved as an engine's batch may be. */
static void step_prefill(const char *name, int no) {
    batch b = {{0}, {0}, {0}, 0, 0};
    for (int32_t p = 0; p < 17; p++) {
        batch_add(&b, 0, p, next_token());
        if (p < 9) batch_add(&b, 1, p, next_token());
    }
    run_batch(name, no, &b);
}

/* Decode: one token per sequence, three steps (one of them on a bf16 highway). */
static void step_decode(const char *name, int no) {
    for (int k = 0; k < 3; k++) {
        batch b = {{0}, {0}, {0}, 0, k == 1};
        batch_add(&b, 0, seq_len(0), next_token());
        batch_add(&b, 1, seq_len(1), next_token());
        char full[96];
        snprintf(full, sizeof full, "%s %d%s", name, k, k == 1 ? " (bf16 highway)" : "");
        run_batch(full, no * 10 + k, &b);
    }
}

/* A draft rolled back, with today's API: seq 1 hashes a 4-token draft at
 * p..p+3 (the verify batch), the engine accepts 2 of them and samples a
 * different token at p+2. Today's rollback is re-hashing: the next batch
 * hashes the accepted tokens again at their positions with the correction
 * after them, which overwrites the rejected draft's positions. The fresh
 * context of run_batch is fed only the accepted history, so a rejected
 * draft token still visible to a look-back fails the check. */
static void step_draft_rollback(const char *name, int no) {
    int32_t p = seq_len(1);
    batch draft = {{0}, {0}, {0}, 0, 0};
    for (int32_t i = 0; i < 4; i++) batch_add(&draft, 1, p + i, next_token());
    run_batch("draft (verify batch)", no * 10, &draft);
    /* The model forgets what was rejected: positions p+2, p+3. */
    int32_t rejected = draft.tok[2];
    hist[1][p + 2] = NEVER;
    hist[1][p + 3] = NEVER;
    int32_t fix = (rejected + 1) % VOCAB;
    batch redo = {{0}, {0}, {0}, 0, 0};
    batch_add(&redo, 1, p, draft.tok[0]);
    batch_add(&redo, 1, p + 1, draft.tok[1]);
    batch_add(&redo, 1, p + 2, fix);
    batch_add(&redo, 0, seq_len(0), next_token()); /* seq 0 decodes meanwhile */
    run_batch(name, no * 10 + 1, &redo);
    /* And decoding goes on after the correction (p+3 overwrites the draft). */
    batch next = {{0}, {0}, {0}, 0, 0};
    batch_add(&next, 1, p + 3, next_token());
    run_batch("decode after the rollback", no * 10 + 2, &next);
}

/* The model's side of engram_seq_rm: positions [p0, p1) of s forgotten
 * (p0 < 0 is 0, p1 < 0 the end). */
static void model_seq_rm(int32_t s, int32_t p0, int32_t p1) {
    if (p0 < 0) p0 = 0;
    if (p1 < 0) p1 = MAX_POS;
    for (int32_t p = p0; p < p1; p++) hist[s][p] = NEVER;
}

/* The model's side of engram_seq_add, as its doc in include/engram.h says:
 * the range [p0, p1) moves as a block by delta; an entry landing below 0 is
 * forgotten; a hashed position landing outside the range replaces what it
 * held there; positions of the range nothing lands on are forgotten; those
 * outside nothing lands on keep theirs. (Landing at MAX_POS or beyond is an
 * error the test never provokes.) */
static void model_seq_add(int32_t s, int32_t p0, int32_t p1, int32_t delta) {
    if (p0 < 0) p0 = 0;
    if (p1 < 0) p1 = MAX_POS;
    if (delta == 0 || p0 >= p1) return;
    int32_t moved[MAX_POS];
    memcpy(moved, hist[s], sizeof moved);
    for (int32_t p = p0; p < p1; p++) moved[p] = NEVER;
    for (int32_t p = p0; p < p1; p++) {
        int32_t to = p + delta;
        if (hist[s][p] != NEVER && to >= 0 && to < MAX_POS) moved[to] = hist[s][p];
    }
    memcpy(hist[s], moved, sizeof moved);
}

/* Both contexts: engram_seq_rm, checked. */
static void both_seq_rm(const char *step, int32_t s, int32_t p0, int32_t p1) {
    engram_status a = engram_seq_rm(g_ctx, s, p0, p1), b = engram_seq_rm(d_ctx, s, p0, p1);
    check(a == ENGRAM_STATUS_OK && b == ENGRAM_STATUS_OK, "%s: engram_seq_rm(%d, %d, %d) on both contexts (%d %d) %s",
          step, (int)s, (int)p0, (int)p1, (int)a, (int)b, engram_last_error());
    model_seq_rm(s, p0, p1);
}

/* A draft rolled back with engram_seq_rm: seq 1 hashes a 4-token draft at
 * p..p+3, the engine accepts 2 and removes the rest (p+2 to the end), then
 * decodes its next token at p+2 while seq 0 decodes too. The fresh context
 * is fed only the accepted history, so a rejected token still seen by a
 * look-back fails the check. */
static void step_draft_seq_rm(const char *name, int no) {
    int32_t p = seq_len(1);
    batch draft = {{0}, {0}, {0}, 0, 0};
    for (int32_t i = 0; i < 4; i++) batch_add(&draft, 1, p + i, next_token());
    run_batch("draft (verify batch, to be cut by engram_seq_rm)", no * 10, &draft);
    both_seq_rm(name, 1, p + 2, -1);
    check(seq_len(1) == p + 2, "%s: the model keeps the 2 accepted tokens", name);
    batch next = {{0}, {0}, {0}, 0, 0};
    batch_add(&next, 1, p + 2, (draft.tok[2] + 1) % VOCAB); /* not the rejected token */
    batch_add(&next, 0, seq_len(0), next_token());
    run_batch(name, no * 10 + 1, &next);
}

/* A context shift on seq 0, as llama-server does it with n_keep = 0:
 * engram_seq_rm(0, 0, k) then engram_seq_add(0, k, -1, -k); positions below
 * k are gone and the rest move down by k. Decoding then goes on at the
 * shifted positions (two batches, the second also decoding seq 1). */
static void step_context_shift(const char *name, int no) {
    const int32_t k = 5;
    int32_t before = seq_len(0);
    both_seq_rm(name, 0, 0, k);
    engram_status a = engram_seq_add(g_ctx, 0, k, -1, -k);
    engram_status b = engram_seq_add(d_ctx, 0, k, -1, -k);
    check(a == ENGRAM_STATUS_OK && b == ENGRAM_STATUS_OK,
          "%s: engram_seq_add(0, %d, -1, %d) on both contexts (%d %d) %s", name, (int)k, (int)-k, (int)a, (int)b,
          engram_last_error());
    model_seq_add(0, k, -1, -k);
    check(seq_len(0) == before - k && hist[0][0] != NEVER, "%s: the model's seq 0 is %d positions shorter, from 0",
          name, (int)k);
    for (int i = 0; i < 2; i++) {
        batch nb = {{0}, {0}, {0}, 0, 0};
        batch_add(&nb, 0, seq_len(0), next_token());
        if (i == 1) batch_add(&nb, 1, seq_len(1), next_token());
        char full[96];
        snprintf(full, sizeof full, "%s, decode %d at the shifted position %d", name, i, (int)seq_len(0));
        run_batch(full, no * 10 + i, &nb);
    }
}

/* Save one context's seq `s` into a fresh buffer (checked); NULL on error. */
static unsigned char *save_state(const char *step, engram_context *c, int32_t s, size_t *len) {
    size_t n = 0, written = 0;
    engram_status st = engram_seq_state_size(c, s, &n);
    if (!check(st == ENGRAM_STATUS_OK && n > 0, "%s: engram_seq_state_size(%d) (status %d, %zu bytes)", step, (int)s,
               (int)st, n))
        return NULL;
    unsigned char *buf = (unsigned char *)malloc(n);
    if (!buf) {
        printf("FAIL out of memory\n");
        exit(1);
    }
    st = engram_seq_state_write(c, s, buf, n, &written);
    if (!check(st == ENGRAM_STATUS_OK && written == n, "%s: engram_seq_state_write(%d) (status %d, %zu of %zu bytes)",
               step, (int)s, (int)st, written, n)) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* A state saved from seq 0 (a prompt cache) and restored into slot 2 on
 * each context; then seq 2 decodes from there (and seq 0 goes on with a
 * different token, so the two slots must be independent). The model's
 * hist[2] becomes hist[0]. */
static void step_state_restore(const char *name, int no) {
    size_t gl = 0, dl = 0;
    unsigned char *gs = save_state(name, g_ctx, 0, &gl), *ds = save_state(name, d_ctx, 0, &dl);
    if (gs && ds) {
        check(gl == dl && memcmp(gs, ds, gl) == 0, "%s: both contexts save the same %zu bytes", name, gl);
        engram_status a = engram_seq_state_read(g_ctx, 2, gs, gl), b = engram_seq_state_read(d_ctx, 2, ds, dl);
        check(a == ENGRAM_STATUS_OK && b == ENGRAM_STATUS_OK, "%s: engram_seq_state_read into seq 2 (%d %d) %s", name,
              (int)a, (int)b, engram_last_error());
    }
    free(gs);
    free(ds);
    memcpy(hist[2], hist[0], sizeof hist[2]);
    for (int i = 0; i < 2; i++) {
        batch nb = {{0}, {0}, {0}, 0, i == 1};
        int32_t t = next_token();
        batch_add(&nb, 2, seq_len(2), t);
        batch_add(&nb, 0, seq_len(0), (t + 1 + i) % VOCAB);
        char full[96];
        snprintf(full, sizeof full, "%s, decode %d on seq 2%s", name, i, i == 1 ? " (bf16 highway)" : "");
        run_batch(full, no * 10 + i, &nb);
    }
}

typedef struct {
    const char *name;
    void (*run)(const char *name, int no);
} step;

/*
 * The steps, in order. Each history operation is applied to both contexts
 * and to the model (hist), and run_batch checks the next batch against a
 * fresh context fed `hist`:
 *   - a draft rolled back by re-hashing the accepted tokens;
 *   - a draft rolled back with engram_seq_rm(ctx, 1, p + 2, -1)
 *     (hist[1][q >= p + 2] = NEVER), then the next token at p + 2;
 *   - a context shift: engram_seq_rm(ctx, 0, 0, k) then
 *     engram_seq_add(ctx, 0, k, -1, -k) (model_seq_add moves hist[0] as the
 *     header says seq_add does), decoding on at the shifted positions;
 *   - a state saved and restored into another slot: engram_seq_state_size /
 *     engram_seq_state_write(ctx, 0, ...) on each context,
 *     engram_seq_state_read(ctx, 2, ...) (hist[2] = hist[0]), then batches
 *     that decode seq 2 beside seq 0.
 */
static const step steps[] = {
    {"prefill (2 sequences, 26 tokens)", step_prefill},
    {"decode", step_decode},
    {"draft rolled back (re-hash)", step_draft_rollback},
    {"draft rolled back (engram_seq_rm)", step_draft_seq_rm},
    {"context shift (engram_seq_rm + engram_seq_add)", step_context_shift},
    {"state of seq 0 restored into seq 2", step_state_restore},
    {NULL, NULL},
};

/* The op's errors reach the engine through layer->status, and leave the
 * highway unchanged; bad shapes build nothing. */
static void check_errors(void) {
    struct ggml_init_params ip = {4u << 20, NULL, false};
    struct ggml_context *gctx = ggml_init(ip);
    struct ggml_tensor *hw = ggml_new_tensor_3d(gctx, GGML_TYPE_F32, D, HC, 2);
    struct ggml_tensor *ids = engram_ggml_new_row_ids(gctx, g_ctx, 2);
    engram_ggml_layer bad;
    engram_ggml_layer_init(&bad, g_ctx, 2 /* not an engram layer */, D, HC);
    struct ggml_tensor *out = engram_ggml_apply(gctx, hw, ids, &bad);
    struct ggml_cgraph *gf = ggml_new_graph(gctx);
    ggml_build_forward_expand(gf, out);
    fill_highway(hw->data, 2, 0, 99);
    float before[2 * HW];
    memcpy(before, hw->data, sizeof before);
    const int32_t tok[2] = {5, 6}, seq[2] = {N_SEQ, N_SEQ}, pos[2] = {0, 1};
    engram_status st = engram_ggml_set_row_ids(g_ctx, ids, tok, seq, pos, 2);
    enum ggml_status gs = ggml_graph_compute_with_ctx(gctx, gf, (int)g_threads);
    check(st == ENGRAM_STATUS_OK && gs == GGML_STATUS_SUCCESS && bad.status == ENGRAM_STATUS_ERR_UNKNOWN_LAYER &&
              strstr(bad.message, "2") != NULL,
          "an unknown layer in the graph: layer->status ERR_UNKNOWN_LAYER (%d), message \"%s\"", (int)bad.status,
          bad.message);
    check(memcmp(before, hw->data, sizeof before) == 0, "... and the highway is unchanged");

    engram_ggml_layer l1;
    engram_ggml_layer_init(&l1, g_ctx, LAYERS[0], D, HC);
    struct ggml_tensor *wrong_d = ggml_new_tensor_3d(gctx, GGML_TYPE_F32, D / 2, HC, 2);
    struct ggml_tensor *wrong_t = ggml_new_tensor_3d(gctx, GGML_TYPE_F16, D, HC, 2);
    struct ggml_tensor *wrong_n = ggml_new_tensor_3d(gctx, GGML_TYPE_F32, D, HC, 3);
    struct ggml_tensor *view = ggml_view_3d(gctx, wrong_n, D / 2, HC, 2, wrong_n->nb[1], wrong_n->nb[2], 0);
    check(!engram_ggml_apply(gctx, wrong_d, ids, &l1) && !engram_ggml_apply(gctx, wrong_t, ids, &l1) &&
              !engram_ggml_apply(gctx, wrong_n, ids, &l1) && !engram_ggml_apply(gctx, view, ids, &l1),
          "engram_ggml_apply refuses a wrong D, an f16 highway, a token count unlike the ids', a strided view");
    check(engram_ggml_set_row_ids(g_ctx, wrong_n, tok, seq, pos, 2) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
          "engram_ggml_set_row_ids refuses a tensor that is not the I64 [ids per token, n] input");
    ggml_free(gctx);
}

/* Fill `t` (f32) with a pattern no engram layer writes. */
static void fill_sentinel(struct ggml_tensor *t) {
    for (int64_t i = 0; i < ggml_nelements(t); i++) ((float *)t->data)[i] = -1234.5f - (float)(i % 97);
}

/* Elements of `t` (f32) that no longer hold fill_sentinel's pattern. */
static int64_t sentinel_changed(const struct ggml_tensor *t) {
    int64_t n = 0;
    for (int64_t i = 0; i < ggml_nelements(t); i++) n += ((const float *)t->data)[i] != -1234.5f - (float)(i % 97);
    return n;
}

/* The highway's shape is checked against the context's D and hc, not only
 * against the d/hc the engine passed to engram_ggml_layer_init: a layer set
 * up with d = D/2 (or 2*D) for this D = 64 context once built an op that
 * returned OK and wrote [n, hc, 64] floats over a [D/2, hc, n] highway and
 * the tensor after it. Each case: the highway is a contiguous view at the
 * start of a larger `arena` tensor full of sentinels; nothing may change. */
static void check_shape_from_context(void) {
    struct ggml_init_params ip = {8u << 20, NULL, false};
    struct ggml_context *gctx = ggml_init(ip);
    const int64_t n = 2;
    const int32_t tok[2] = {5, 6}, seq[2] = {N_SEQ + 1, N_SEQ + 1}, pos[2] = {0, 1};
    struct ggml_tensor *ids = engram_ggml_new_row_ids(gctx, g_ctx, n);
    engram_status st = engram_ggml_set_row_ids(g_ctx, ids, tok, seq, pos, (uint32_t)n);
    check(st == ENGRAM_STATUS_OK, "shape check: engram_ggml_set_row_ids (status %d)", (int)st);

    engram_ggml_layer ok_layer;
    st = engram_ggml_layer_init(&ok_layer, g_ctx, LAYERS[0], D, HC);
    check(st == ENGRAM_STATUS_OK && ok_layer.status == ENGRAM_STATUS_OK,
          "engram_ggml_layer_init accepts the context's D %d and hc %d (status %d)", D, HC, (int)st);

    const uint32_t ds[2] = {D / 2, D * 2};
    for (int k = 0; k < 2; k++) {
        const uint32_t d = ds[k];
        engram_ggml_layer l;
        st = engram_ggml_layer_init(&l, g_ctx, LAYERS[0], d, HC);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && l.status == st && strstr(l.message, "64") != NULL,
              "engram_ggml_layer_init(d = %u) for a D = %d context: ERR_INVALID_ARGUMENT (status %d, \"%s\")",
              (unsigned)d, D, (int)st, l.message);
        /* The highway as such a layer describes it, then the next tensor. */
        struct ggml_tensor *arena = ggml_new_tensor_1d(gctx, GGML_TYPE_F32, (int64_t)4 * HW * n);
        fill_sentinel(arena);
        struct ggml_tensor *hw = ggml_view_3d(gctx, arena, d, HC, n, (size_t)d * 4, (size_t)d * HC * 4, 0);
        struct ggml_tensor *out = engram_ggml_apply(gctx, hw, ids, &l);
        check(out == NULL && l.status == ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
              "engram_ggml_apply of a [%u, %d, 2] highway with that layer builds nothing (status %d, \"%s\")",
              (unsigned)d, HC, (int)l.status, l.message);
        out = engram_ggml_apply(gctx, hw, ids, &ok_layer);
        check(out == NULL && ok_layer.status == ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
              "... nor with a layer of the right d: the highway is checked against the context (status %d)",
              (int)ok_layer.status);
        /* An op added by hand around engram_ggml_op (what a graph built
         * before a layer changed amounts to): the op checks before writing. */
        engram_ggml_layer direct;
        engram_ggml_layer_init(&direct, g_ctx, LAYERS[0], D, HC);
        direct.d = d; /* what the graph was built for */
        struct ggml_tensor *args[1] = {ids};
        struct ggml_tensor *op = ggml_custom_inplace(gctx, hw, args, 1, engram_ggml_op, 1, &direct);
        struct ggml_cgraph *gf = ggml_new_graph(gctx);
        ggml_build_forward_expand(gf, op);
        enum ggml_status gs = ggml_graph_compute_with_ctx(gctx, gf, (int)g_threads);
        int64_t changed = sentinel_changed(arena);
        check(gs == GGML_STATUS_SUCCESS && direct.status == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && changed == 0,
              "an op over a [%u, %d, 2] highway: layer->status ERR_INVALID_ARGUMENT (%d, \"%s\"), %lld of %lld floats "
              "of the highway and the tensor after it written (0 expected)",
              (unsigned)d, HC, (int)direct.status, direct.message, (long long)changed,
              (long long)ggml_nelements(arena));
    }
    engram_ggml_layer none;
    check(engram_ggml_layer_init(&none, NULL, LAYERS[0], D, HC) == ENGRAM_STATUS_ERR_NULL_ARGUMENT &&
              engram_ggml_apply(gctx, ggml_new_tensor_3d(gctx, GGML_TYPE_F32, D, HC, n), ids, &none) == NULL,
          "a layer without a context: ERR_NULL_ARGUMENT at init, and engram_ggml_apply builds nothing");
    ggml_free(gctx);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s tiny.gguf n_threads\n", argv[0]);
        return 2;
    }
    g_path = argv[1];
    g_threads = (uint32_t)atoi(argv[2]);
    if (g_threads == 0) g_threads = 1;
    printf("# ggml %s (commit %s), libengram %s, %u threads (ggml and engram)\n", ggml_version(), ggml_commit(),
           ENGRAM_VERSION_STRING, g_threads);
    g_ctx = open_model();
    d_ctx = open_model();
    per_token = engram_row_ids_per_token(g_ctx);
    for (int s = 0; s < N_SEQ; s++)
        for (int p = 0; p < MAX_POS; p++) hist[s][p] = NEVER;
    for (int i = 0; steps[i].name; i++) steps[i].run(steps[i].name, i + 1);
    check_errors();
    check_shape_from_context();
    engram_free(g_ctx);
    engram_free(d_ctx);
    return check_summary("integrations/ggml/test_ggml");
}
