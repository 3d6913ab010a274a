/*
 * The history operations (engram_seq_rm / cp / keep / add / div) and the
 * sequence states (engram_seq_state_size / write / read) through the C ABI:
 * each bad input (NULL, a bad sequence, a bad range, a short buffer, a
 * truncated, mutated or foreign state) is its status with a message and
 * changes nothing; the good calls leave a history whose next row ids equal
 * a fresh context's fed the same tokens.
 */
#include "engram.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "mini_model.h"

#define MAXPOS 64

static engram_context *make(uint64_t mult0) {
    engram_config c = mm_config(1, 16, 3);
    static uint64_t mult[MM_N];
    memcpy(mult, mm_multipliers, sizeof mult);
    mult[0] = mult0;
    c.multipliers = mult;
    c.max_positions = MAXPOS;
    engram_context *ctx = NULL;
    if (engram_create(&c, &ctx) != ENGRAM_STATUS_OK) {
        note("engram_create: %s", engram_last_error());
        return NULL;
    }
    return ctx;
}

/* Hash tokens[0..n) at positions p0.. of `seq`; row ids into `out`. */
static engram_status hash_run(engram_context *ctx, int32_t seq, int32_t p0, const int32_t *tokens, int n,
                              int64_t *out) {
    int32_t seqs[16], pos[16];
    for (int i = 0; i < n; i++) {
        seqs[i] = seq;
        pos[i] = p0 + i;
    }
    return engram_hash(ctx, tokens, seqs, pos, (uint32_t)n, out, (size_t)n * MM_C);
}

/* The row ids of `tok` at `pos` of `seq`, or a status. */
static engram_status probe(engram_context *ctx, int32_t seq, int32_t pos, int32_t tok, int64_t out[MM_C]) {
    return engram_hash(ctx, &tok, &seq, &pos, 1, out, MM_C);
}

/* What a fresh context gives for `tok` after `prev` (N = 2: one look-back). */
static void fresh(int32_t prev, int32_t tok, int64_t out[MM_C]) {
    engram_context *f = make(mm_multipliers[0]);
    int32_t t[2] = {prev, tok};
    int64_t ids[2 * MM_C];
    hash_run(f, 0, 0, t, 2, ids);
    memcpy(out, ids + MM_C, sizeof(int64_t) * MM_C);
    engram_free(f);
}

static int same_ids(const int64_t *a, const int64_t *b) { return memcmp(a, b, sizeof(int64_t) * MM_C) == 0; }

static int has_message(void) {
    const char *m = engram_last_error();
    return m != NULL && m[0] != '\0';
}

/* A sequence's state, for comparing "nothing changed". */
static size_t snapshot(engram_context *ctx, int32_t seq, uint8_t *buf, size_t cap) {
    size_t w = 0;
    if (engram_seq_state_write(ctx, seq, buf, cap, &w) != ENGRAM_STATUS_OK) return 0;
    return w;
}

static void test_ops(void) {
    engram_context *ctx = make(mm_multipliers[0]);
    if (!check(ctx != NULL, "create a context")) return;
    const int32_t toks[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    int64_t ids[10 * MM_C], got[MM_C], want[MM_C];
    check(hash_run(ctx, 0, 0, toks, 10, ids) == ENGRAM_STATUS_OK, "hash 10 tokens into sequence 0");

    /* NULL context, bad sequences, bad ranges: statuses, nothing changed. */
    static uint8_t before[4096], after[4096];
    size_t nb = snapshot(ctx, 0, before, sizeof before);
    check(engram_seq_rm(NULL, 0, 0, 1) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "seq_rm(NULL) is ERR_NULL_ARGUMENT");
    check(engram_seq_rm(ctx, 3, 0, 1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE && has_message(),
          "seq_rm of sequence max_seqs is ERR_INVALID_SEQUENCE with a message");
    check(engram_seq_rm(ctx, -2, 0, 1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_rm of sequence -2 is refused");
    check(engram_seq_rm(ctx, 0, 5, 4) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_rm of [5, 4) is refused");
    check(engram_seq_rm(ctx, 0, 0, MAXPOS + 1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE,
          "seq_rm past max_positions is refused");
    check(engram_seq_cp(NULL, 0, 1, 0, -1) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "seq_cp(NULL) is refused");
    check(engram_seq_cp(ctx, 0, 3, 0, -1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_cp to a bad sequence");
    check(engram_seq_cp(ctx, -1, 1, 0, -1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_cp from -1 is refused");
    check(engram_seq_cp(ctx, 0, 1, 9, 3) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_cp of a reversed range");
    check(engram_seq_keep(NULL, 0) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "seq_keep(NULL) is refused");
    check(engram_seq_keep(ctx, 7) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_keep of a bad sequence");
    check(engram_seq_add(NULL, 0, 0, -1, 1) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "seq_add(NULL) is refused");
    check(engram_seq_add(ctx, 3, 0, -1, 1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_add of a bad sequence");
    check(engram_seq_add(ctx, 0, 0, -1, MAXPOS - 9) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE && has_message(),
          "seq_add moving position 9 to max_positions is refused");
    check(engram_seq_add(ctx, 0, 4, 2, -1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_add of a reversed range");
    check(engram_seq_div(NULL, 0, 0, -1, 2) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "seq_div(NULL) is refused");
    check(engram_seq_div(ctx, 0, 0, -1, 2) == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
          "seq_div by 2 is ERR_UNSUPPORTED with the reason");
    check(engram_seq_div(ctx, 0, 0, -1, 0) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "seq_div by 0 is refused");
    check(engram_seq_div(ctx, 5, 0, -1, 1) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "seq_div of a bad sequence");
    check(engram_seq_div(ctx, 0, 0, -1, 1) == ENGRAM_STATUS_OK, "seq_div by 1 changes nothing");
    size_t na = snapshot(ctx, 0, after, sizeof after);
    check(nb > 0 && na == nb && memcmp(before, after, nb) == 0, "the refused calls changed nothing");

    /* seq_cp then a fork continues sequence 0's history. */
    check(engram_seq_cp(ctx, 0, 1, -1, -1) == ENGRAM_STATUS_OK, "seq_cp(0, 1, -1, -1)");
    check(probe(ctx, 1, 10, 11, got) == ENGRAM_STATUS_OK, "hash the next token of the copy");
    fresh(10, 11, want);
    check(same_ids(got, want), "the copy's next row ids equal a fresh context's");

    /* seq_rm of a draft: a look-back into it is ERR_MISSING_HISTORY. */
    check(engram_seq_rm(ctx, 0, 6, -1) == ENGRAM_STATUS_OK, "seq_rm(0, 6, -1) (a rejected draft)");
    check(probe(ctx, 0, 8, 3, got) == ENGRAM_STATUS_ERR_MISSING_HISTORY,
          "a look-back into removed positions is ERR_MISSING_HISTORY");
    check(probe(ctx, 0, 6, 12, got) == ENGRAM_STATUS_OK, "re-hash position 6");
    fresh(6, 12, want);
    check(same_ids(got, want), "after the rollback the row ids follow position 5");

    /* Context shift: drop [2, 4), move [4, 7) down by 2. */
    check(engram_seq_rm(ctx, 0, 2, 4) == ENGRAM_STATUS_OK, "seq_rm(0, 2, 4)");
    check(engram_seq_add(ctx, 0, 4, -1, -2) == ENGRAM_STATUS_OK, "seq_add(0, 4, -1, -2)");
    check(probe(ctx, 0, 5, 9, got) == ENGRAM_STATUS_OK, "hash after the shift at position 5");
    fresh(12, 9, want); /* position 4 now holds what position 6 held */
    check(same_ids(got, want), "after the shift the look-back sees the moved token");
    /* Landing on a kept position: the moved token wins. */
    check(engram_seq_add(ctx, 1, 0, 2, 5) == ENGRAM_STATUS_OK, "seq_add(1, 0, 2, 5) lands on kept positions");
    check(probe(ctx, 1, 7, 4, got) == ENGRAM_STATUS_OK, "hash after the landing");
    fresh(2, 4, want); /* position 6 now holds token 2 (was position 1) */
    check(same_ids(got, want), "the moved token replaced the one it landed on");
    check(probe(ctx, 1, 1, 4, got) == ENGRAM_STATUS_ERR_MISSING_HISTORY, "the moved-away position 0 is forgotten");

    /* seq_keep and seq_rm(-1). */
    check(engram_seq_keep(ctx, 1) == ENGRAM_STATUS_OK, "seq_keep(1)");
    check(probe(ctx, 0, 1, 4, got) == ENGRAM_STATUS_ERR_MISSING_HISTORY, "seq_keep forgot sequence 0");
    check(engram_seq_rm(ctx, -1, -1, -1) == ENGRAM_STATUS_OK, "seq_rm(-1, -1, -1) clears every sequence");
    check(probe(ctx, 1, 8, 4, got) == ENGRAM_STATUS_ERR_MISSING_HISTORY, "and sequence 1 is empty");
    engram_free(ctx);
}

static void test_state(void) {
    engram_context *ctx = make(mm_multipliers[0]);
    engram_context *other = make(mm_multipliers[0] ^ 2); /* another model: other tables */
    if (!check(ctx != NULL && other != NULL, "create two contexts")) return;
    const int32_t toks[8] = {3, 1, 4, 1, 5, 9, 2, 6};
    int64_t ids[8 * MM_C], got[MM_C], want[MM_C];
    const int32_t run2[3] = {ENGRAM_TOKEN_DEAD, 4, 1}; /* a dead token needs no look-back */
    check(hash_run(ctx, 0, 0, toks, 8, ids) == ENGRAM_STATUS_OK && hash_run(ctx, 0, 20, run2, 3, ids) == ENGRAM_STATUS_OK,
          "hash two runs into sequence 0");

    size_t size = 0;
    check(engram_seq_state_size(NULL, 0, &size) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "state_size(NULL ctx)");
    check(engram_seq_state_size(ctx, 0, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "state_size(NULL size)");
    check(engram_seq_state_size(ctx, 3, &size) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "state_size(bad seq)");
    check(engram_seq_state_size(ctx, 0, &size) == ENGRAM_STATUS_OK && size == 32 + 2 * 8 + 11 * 4 + 8,
          "state_size of two runs of 8 and 3 positions is %zu bytes", size);
    static uint8_t buf[4096], bad[4096];
    size_t written = 0;
    check(engram_seq_state_write(ctx, 0, buf, size - 1, &written) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT &&
              written == 0 && has_message(),
          "state_write into a short buffer is ERR_INVALID_ARGUMENT, nothing written");
    check(engram_seq_state_write(ctx, 0, NULL, size, &written) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
          "state_write(NULL buf)");
    check(engram_seq_state_write(ctx, 0, buf, size, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
          "state_write(NULL written)");
    check(engram_seq_state_write(ctx, 9, buf, size, &written) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE,
          "state_write(bad seq)");
    check(engram_seq_state_write(ctx, 0, buf, sizeof buf, &written) == ENGRAM_STATUS_OK && written == size,
          "state_write writes state_size bytes");

    /* Sequence 2 holds something; no bad buffer may change it. */
    hash_run(ctx, 2, 0, toks + 4, 2, ids);
    static uint8_t keep[4096], now[4096];
    size_t nk = snapshot(ctx, 2, keep, sizeof keep);
    int all_format = 1;
    for (size_t cut = 0; cut < size; cut++)
        if (engram_seq_state_read(ctx, 2, buf, cut) != ENGRAM_STATUS_ERR_FORMAT) all_format = 0;
    check(all_format, "every truncation (0 .. %zu bytes) is ERR_FORMAT", size - 1);
    all_format = 1;
    for (size_t i = 0; i < size; i++)
        for (int bit = 0; bit < 8; bit++) {
            memcpy(bad, buf, size);
            bad[i] ^= (uint8_t)(1u << bit);
            if (engram_seq_state_read(ctx, 2, bad, size) != ENGRAM_STATUS_ERR_FORMAT) all_format = 0;
        }
    check(all_format, "every single-bit mutation of the %zu bytes is ERR_FORMAT", size);
    memcpy(bad, buf, size);
    bad[size] = 0;
    check(engram_seq_state_read(ctx, 2, bad, size + 1) == ENGRAM_STATUS_ERR_FORMAT, "a trailing byte is ERR_FORMAT");
    check(engram_seq_state_read(other, 0, buf, size) == ENGRAM_STATUS_ERR_FORMAT &&
              strstr(engram_last_error(), "another model") != NULL,
          "a state from another model is ERR_FORMAT (\"another model\")");
    check(engram_seq_state_read(NULL, 0, buf, size) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "state_read(NULL ctx)");
    check(engram_seq_state_read(ctx, 0, NULL, size) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "state_read(NULL buf)");
    check(engram_seq_state_read(ctx, -1, buf, size) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "state_read(bad seq)");
    size_t nn = snapshot(ctx, 2, now, sizeof now);
    check(nk > 0 && nn == nk && memcmp(keep, now, nk) == 0, "the refused buffers changed nothing");

    /* Restore into another slot: it continues as the saved sequence. */
    check(engram_seq_state_read(ctx, 2, buf, size) == ENGRAM_STATUS_OK, "restore sequence 0's state into slot 2");
    check(probe(ctx, 2, 8, 7, got) == ENGRAM_STATUS_OK, "hash the next token in slot 2");
    fresh(6, 7, want);
    check(same_ids(got, want), "slot 2 continues sequence 0's history");
    check(probe(ctx, 2, 23, 7, got) == ENGRAM_STATUS_OK, "and its second run too");
    fresh(1, 7, want);
    check(same_ids(got, want), "the second run's row ids follow position 22");
    engram_free(ctx);
    engram_free(other);
}

int main(void) {
    test_ops();
    test_state();
    return check_summary("test_history");
}
