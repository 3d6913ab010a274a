/*
 * engram_config.exact_quant_wkv and engram_gguf_options.exact_quant_wkv
 * (docs/numerics.md, "Integer dot products"):
 *   - init sets both to 0 (the default: integer dot products where they
 *     apply);
 *   - 1 is accepted, and a context created with it applies an f32 wkv with
 *     the bits of one created with 0 (the option touches GGUF-block wkv
 *     only); tiny.gguf opens with it;
 *   - any other value is ENGRAM_STATUS_ERR_INVALID_CONFIG at create, *out
 *     untouched;
 *   - the layouts that end before the field are still read (it reads as 0),
 *     and their init writes nothing past them.
 * The bits themselves (the twin's with 1, within the bound with 0) are
 * checked by tests/int_dot.rs.
 */
#include "engram.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "mini_model.h"

static uint16_t g_table[MM_ROWS * MM_HD];
static float g_wkv[MM_K_OUT * MM_K_IN], g_q[MM_HW], g_k[MM_HW];

/* Create a CPU context from `c`, set the layer, hash and apply 8 tokens;
 * the highway out. Returns the first failing status. */
static engram_status run(engram_config *c, float *hw) {
    engram_context *ctx = NULL;
    engram_status st = engram_create(c, &ctx);
    if (st != ENGRAM_STATUS_OK) return st;
    engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
    int32_t tok[8], seq[8] = {0}, pos[8];
    static int64_t ids[8 * MM_C];
    for (int i = 0; i < 8; i++) {
        tok[i] = (int32_t)((i * 5 + 3) % MM_VOCAB);
        pos[i] = i;
    }
    mm_fill_highway(hw, 8);
    st = engram_set_layer(ctx, &w);
    if (st == ENGRAM_STATUS_OK) st = engram_hash(ctx, tok, seq, pos, 8, ids, 8 * MM_C);
    if (st == ENGRAM_STATUS_OK) st = engram_apply(ctx, MM_LAYER, ids, 8, hw, ENGRAM_TYPE_F32, NULL);
    engram_free(ctx);
    return st;
}

static engram_status open_gguf(engram_gguf_options *o) {
    engram_context *ctx = NULL;
    engram_status st = engram_create_from_gguf("tests/golden/data/tiny.gguf", o, &ctx);
    if (st == ENGRAM_STATUS_OK) {
        check(ctx != NULL, "a context out");
        engram_free(ctx);
    } else {
        check(ctx == NULL, "*out untouched on failure");
    }
    return st;
}

int main(void) {
    mm_fill_table(g_table, 0);
    mm_fill_wkv(g_wkv, 0);
    mm_fill_qk(g_q, g_k);
    static float hw0[8 * MM_HW], hw[8 * MM_HW];
    {
        engram_config c;
        memset(&c, 0xAB, sizeof c);
        engram_config_init(&c);
        check(c.exact_quant_wkv == 0, "engram_config_init: exact_quant_wkv 0");
        engram_gguf_options o;
        memset(&o, 0xAB, sizeof o);
        engram_gguf_options_init(&o);
        check(o.exact_quant_wkv == 0, "engram_gguf_options_init: exact_quant_wkv 0");
    }
    engram_config c0 = mm_config(2, 8, 2);
    check(run(&c0, hw0) == ENGRAM_STATUS_OK, "exact_quant_wkv 0 (%s)", engram_last_error());
    {
        engram_config c = mm_config(2, 8, 2);
        c.exact_quant_wkv = 1;
        engram_status st = run(&c, hw);
        check(st == ENGRAM_STATUS_OK, "exact_quant_wkv 1: OK (got %d: %s)", (int)st, engram_last_error());
        check(memcmp(hw, hw0, sizeof hw) == 0, "an f32 wkv: the same bits with exact_quant_wkv 1");
    }
    const uint32_t bad[3] = {2, 7, UINT32_MAX};
    for (int b = 0; b < 3; b++) {
        engram_config c = mm_config(2, 8, 2);
        c.exact_quant_wkv = bad[b];
        engram_context *ctx = (engram_context *)&c;
        engram_status st = engram_create(&c, &ctx);
        check(st == ENGRAM_STATUS_ERR_INVALID_CONFIG, "exact_quant_wkv %u: ERR_INVALID_CONFIG (got %d)", bad[b],
              (int)st);
        check(ctx == (engram_context *)&c, "exact_quant_wkv %u: *out untouched", bad[b]);
        check(strstr(engram_last_error(), "exact_quant_wkv") != NULL, "the message names the field (%s)",
              engram_last_error());
        engram_gguf_options o;
        engram_gguf_options_init(&o);
        o.exact_quant_wkv = bad[b];
        st = open_gguf(&o);
        check(st == ENGRAM_STATUS_ERR_INVALID_CONFIG, "GGUF, exact_quant_wkv %u: ERR_INVALID_CONFIG (got %d)", bad[b],
              (int)st);
    }
    /* The layout before the field. */
    {
        engram_config c;
        memset(&c, 0xCD, sizeof c);
        engram_config_init_sized(&c, offsetof(engram_config, exact_quant_wkv));
        check(c.exact_quant_wkv == 0xCDCDCDCDu, "init of the older layout writes nothing past it");
        engram_config full = mm_config(2, 8, 2);
        memcpy(&c, &full, offsetof(engram_config, exact_quant_wkv));
        c.struct_size = offsetof(engram_config, exact_quant_wkv);
        engram_status st = run(&c, hw);
        check(st == ENGRAM_STATUS_OK, "create from the older layout (past it: 0xCD bytes): OK (got %d: %s)", (int)st,
              engram_last_error());
        check(memcmp(hw, hw0, sizeof hw) == 0, "the older layout's context: the same bits");
    }
    {
        engram_gguf_options o;
        engram_gguf_options_init(&o);
        o.exact_quant_wkv = 1;
        engram_status st = open_gguf(&o);
        check(st == ENGRAM_STATUS_OK, "GGUF with exact_quant_wkv 1: OK (got %d: %s)", (int)st, engram_last_error());
        memset(&o, 0xEE, sizeof o);
        /* The older layout ends where the shard fields begin: this header's
         * last fields (the shard spec, exact_quant_wkv) came in one layout. */
        engram_gguf_options_init_sized(&o, offsetof(engram_gguf_options, shard_table_rank));
        check(o.shard_table_world == 0xEEEEEEEEu && o.exact_quant_wkv == 0xEEEEEEEEu,
              "init of the older GGUF layout writes nothing past it");
        st = open_gguf(&o);
        check(st == ENGRAM_STATUS_OK, "GGUF options of the older layout: OK (got %d: %s)", (int)st,
              engram_last_error());
    }
    return check_summary("test_exact_quant");
}
