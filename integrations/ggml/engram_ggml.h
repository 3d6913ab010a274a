/*
 * engram_ggml.h: libengram's engram layer as an in-place ggml custom op.
 *
 * Header only, C11 or C++. Include it after nothing in particular; it
 * includes engram.h and ggml.h itself. Tested against the ggml that
 * llama-cpp-python 0.3.36 vendors (ggml 0.25.3, llama.cpp 0c1e57098) on
 * ggml's CPU backend: integrations/ggml/test.sh.
 *
 * The layout. ggml's highway tensor `[n_embd, hc, n_tokens]` (ne0 = n_embd
 * = D, ne1 = hc, ne2 = n_tokens; contiguous f32 or bf16) holds the same
 * bytes as libengram's `[n_tokens, hc, D]` highway, so the op hands
 * `highway->data` to `engram_apply` as it is: no copy, no permute.
 *
 * The row ids. `engram_hash` is a host call that also records each
 * sequence's history, so it runs once per batch (ubatch), in order, where
 * the engine fills the graph's inputs (tokens, positions): call
 * `engram_ggml_set_row_ids` there. Its output `[n_tokens, n_layers, C]`
 * int64 lands in one I64 input tensor `[n_layers * C, n_tokens]` that every
 * engram layer's op of the graph reads.
 *
 * Threads. The op runs as one task (ggml's thread 0; the others wait at
 * ggml's barrier) and `engram_apply` spreads the work over the libengram
 * context's own workers (`engram_config.n_threads`): give it the thread
 * count the engine gives ggml.
 *
 * Shapes. The highway's D and hc are checked against the context's own
 * (`engram_context_info`), never only against what the engine passed to
 * `engram_ggml_layer_init`: a layer whose `d`/`hc` differ from the
 * context's is refused at init (a status), `engram_ggml_apply` builds
 * nothing for a highway or row ids of another shape (NULL), and the op
 * checks again before it writes. A mismatch never writes a byte.
 *
 * Errors. A ggml op cannot return a status: the op stores `engram_apply`'s
 * (or its own check's) in `layer->status` (`ENGRAM_STATUS_OK` on success;
 * on error the highway is unchanged, as `engram_apply` promises). Check it
 * after `ggml_graph_compute*`; `layer->message` says why (for
 * `engram_apply`'s errors, a copy of `engram_last_error()` on the computing
 * thread).
 *
 * Backends. CPU only: the op reads and writes `tensor->data` on the host.
 * ggml-cuda does not run custom ops (see docs/ggml.md and
 * integrations/ggml/ggml-cuda-custom-op.patch for what it would take).
 */
#ifndef ENGRAM_GGML_H
#define ENGRAM_GGML_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "engram.h"
#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One engram layer of a graph: what its op needs at compute time. The
 * engine owns it; it must outlive every compute of graphs built with it. */
typedef struct engram_ggml_layer {
    struct engram_context *ctx; /* the libengram context (CPU backend) */
    uint32_t layer_id;          /* the engram layer this op applies */
    uint32_t d, hc;             /* the highway's ne0, ne1: must be the context's D and hc */
    enum engram_status status;  /* the last check's or engram_apply's status (see above) */
    char message[256];          /* on error: why (the check's text, or engram_last_error()) */
} engram_ggml_layer;

/* Internal: record `st` and `msg` in the layer (when there is one). */
static inline enum engram_status engram_ggml_set_status_(engram_ggml_layer *l, enum engram_status st, const char *msg) {
    if (!l) return st;
    l->status = st;
    size_t n = msg ? strlen(msg) : 0;
    if (n >= sizeof l->message) n = sizeof l->message - 1;
    if (n) memcpy(l->message, msg, n);
    l->message[n] = '\0';
    return st;
}

/* Internal: the context's hidden size D and hc, read from the context
 * itself (`engram_context_info`), never from what a caller says they are. */
static inline enum engram_status engram_ggml_context_shape_(struct engram_context *ctx, uint32_t *d, uint32_t *hc) {
    engram_info info;
    *d = 0;
    *hc = 0;
    if (!ctx) return ENGRAM_STATUS_ERR_NULL_ARGUMENT;
    engram_info_init(&info);
    enum engram_status st = engram_context_info(ctx, &info);
    if (st != ENGRAM_STATUS_OK) return st;
    *d = info.hidden_size;
    *hc = info.hc;
    return ENGRAM_STATUS_OK;
}

/* Set up `l` for the context's layer `layer_id`. `d` and `hc` are checked
 * against the context's own D and hc (`engram_context_info`): a mismatch is
 * `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` (also left in `l->status`, with
 * `l->message` saying why), and `engram_ggml_apply` then builds nothing for
 * the layer. A NULL `ctx` is `ENGRAM_STATUS_ERR_NULL_ARGUMENT`. */
static inline enum engram_status engram_ggml_layer_init(engram_ggml_layer *l, struct engram_context *ctx,
                                                        uint32_t layer_id, uint32_t d, uint32_t hc) {
    if (!l) return ENGRAM_STATUS_ERR_NULL_ARGUMENT;
    memset(l, 0, sizeof *l);
    l->ctx = ctx;
    l->layer_id = layer_id;
    l->d = d;
    l->hc = hc;
    uint32_t cd, chc;
    enum engram_status st = engram_ggml_context_shape_(ctx, &cd, &chc);
    if (st != ENGRAM_STATUS_OK) return engram_ggml_set_status_(l, st, "engram_ggml_layer_init: no context to check d and hc against");
    if (d != cd || hc != chc) {
        char m[sizeof l->message];
        snprintf(m, sizeof m, "engram_ggml_layer_init: d %u, hc %u given, but the context has D %u, hc %u",
                 (unsigned)d, (unsigned)hc, (unsigned)cd, (unsigned)chc);
        return engram_ggml_set_status_(l, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, m);
    }
    return engram_ggml_set_status_(l, ENGRAM_STATUS_OK, NULL);
}

/* The graph input for a batch's row ids: I64 `[n_layers * C, n_tokens]`,
 * marked as an input. NULL if `ctx` is NULL or `n_tokens` is 0. */
static inline struct ggml_tensor *engram_ggml_new_row_ids(struct ggml_context *gctx, const struct engram_context *ctx,
                                                          int64_t n_tokens) {
    size_t per_token = engram_row_ids_per_token(ctx);
    if (per_token == 0 || n_tokens <= 0) return NULL;
    struct ggml_tensor *t = ggml_new_tensor_2d(gctx, GGML_TYPE_I64, (int64_t)per_token, n_tokens);
    ggml_set_name(t, "engram_row_ids");
    ggml_set_input(t);
    return t;
}

/* Fill `row_ids` (from `engram_ggml_new_row_ids`, in host memory) for the
 * batch: token `i` of sequence `seq_ids[i]` at position `pos[i]`; the call
 * that records the history, so once per batch, in batch order. Returns
 * `engram_hash`'s status; a tensor of the wrong type, shape or memory is
 * `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` with nothing hashed. */
static inline enum engram_status engram_ggml_set_row_ids(struct engram_context *ctx, struct ggml_tensor *row_ids,
                                                         const int32_t *tokens, const int32_t *seq_ids,
                                                         const int32_t *pos, uint32_t n_tokens) {
    if (!row_ids || row_ids->type != GGML_TYPE_I64 || !ggml_is_contiguous(row_ids) || !row_ids->data ||
        row_ids->ne[0] != (int64_t)engram_row_ids_per_token(ctx) || row_ids->ne[1] != (int64_t)n_tokens ||
        row_ids->ne[2] != 1 || row_ids->ne[3] != 1) {
        return ENGRAM_STATUS_ERR_INVALID_ARGUMENT;
    }
    return engram_hash(ctx, tokens, seq_ids, pos, n_tokens, (int64_t *)row_ids->data,
                       (size_t)ggml_nelements(row_ids));
}

/* Internal: the one check of a highway and its row ids against the layer
 * and the layer's context, made when the graph is built and again by the op
 * before anything is written. `ENGRAM_STATUS_OK`, or the status and why in
 * `l->status` / `l->message`. The highway must be contiguous f32 or bf16
 * `[D, hc, n_tokens]` with D and hc the context's (and the layer's), the row
 * ids the I64 `[n_layers * C, n_tokens]` input. */
static inline enum engram_status engram_ggml_check_(engram_ggml_layer *l, const struct ggml_tensor *highway,
                                                    const struct ggml_tensor *row_ids) {
    uint32_t cd, chc;
    if (!l || !highway || !row_ids) return engram_ggml_set_status_(l, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_ggml: NULL tensor");
    enum engram_status st = engram_ggml_context_shape_(l->ctx, &cd, &chc);
    if (st != ENGRAM_STATUS_OK) return engram_ggml_set_status_(l, st, "engram_ggml: the layer has no usable context");
    char m[sizeof l->message];
    if ((highway->type != GGML_TYPE_F32 && highway->type != GGML_TYPE_BF16) || !ggml_is_contiguous(highway)) {
        snprintf(m, sizeof m, "engram_ggml: the highway must be a contiguous f32 or bf16 tensor (type %d)",
                 (int)highway->type);
        return engram_ggml_set_status_(l, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, m);
    }
    if (highway->ne[0] != (int64_t)cd || highway->ne[1] != (int64_t)chc || highway->ne[2] < 1 ||
        highway->ne[3] != 1 || highway->ne[2] > (int64_t)UINT32_MAX || l->d != cd || l->hc != chc) {
        snprintf(m, sizeof m,
                 "engram_ggml: highway [%lld, %lld, %lld, %lld] (layer d %u, hc %u), but the context's is [D %u, hc %u, "
                 "n_tokens]",
                 (long long)highway->ne[0], (long long)highway->ne[1], (long long)highway->ne[2],
                 (long long)highway->ne[3], (unsigned)l->d, (unsigned)l->hc, (unsigned)cd, (unsigned)chc);
        return engram_ggml_set_status_(l, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, m);
    }
    int64_t per_token = (int64_t)engram_row_ids_per_token(l->ctx);
    if (row_ids->type != GGML_TYPE_I64 || !ggml_is_contiguous(row_ids) || row_ids->ne[0] != per_token ||
        row_ids->ne[1] != highway->ne[2] || row_ids->ne[2] != 1 || row_ids->ne[3] != 1) {
        snprintf(m, sizeof m, "engram_ggml: row ids must be I64 [%lld, %lld] (got type %d, [%lld, %lld, %lld, %lld])",
                 (long long)per_token, (long long)highway->ne[2], (int)row_ids->type, (long long)row_ids->ne[0],
                 (long long)row_ids->ne[1], (long long)row_ids->ne[2], (long long)row_ids->ne[3]);
        return engram_ggml_set_status_(l, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, m);
    }
    return ENGRAM_STATUS_OK;
}

/* The op's body (ggml_custom_op_t): dst is the in-place view of the highway,
 * src[1] the row ids. The shapes are checked again against the context
 * before `engram_apply` (an op added with ggml_custom_inplace directly, or a
 * layer changed after the graph was built): a mismatch leaves the highway
 * as it was and `layer->status` `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`. */
static inline void engram_ggml_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)nth;
    if (ith != 0) return;
    engram_ggml_layer *l = (engram_ggml_layer *)userdata;
    const struct ggml_tensor *ids = dst->src[1];
    if (engram_ggml_check_(l, dst, ids) != ENGRAM_STATUS_OK || !dst->data || !ids->data) {
        if (l && l->status == ENGRAM_STATUS_OK)
            engram_ggml_set_status_(l, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_ggml_op: a tensor without data");
        return;
    }
    uint32_t type = dst->type == GGML_TYPE_BF16 ? (uint32_t)ENGRAM_TYPE_BF16 : (uint32_t)ENGRAM_TYPE_F32;
    enum engram_status st = engram_apply(l->ctx, l->layer_id, (const int64_t *)ids->data, (uint32_t)dst->ne[2],
                                         dst->data, type, NULL);
    engram_ggml_set_status_(l, st, st == ENGRAM_STATUS_OK ? NULL : engram_last_error());
}

/* `highway += engram(layer)`, in place: returns the view of `highway` that
 * the rest of the graph uses after the engram layer. `highway` is a
 * contiguous f32 or bf16 `[D, hc, n_tokens]` tensor, D and hc the
 * context's own (`engram_context_info`; the layer's `d` and `hc` must be
 * the same), `row_ids` the batch's `engram_ggml_new_row_ids` tensor (same
 * n_tokens). NULL (nothing added to the graph) for any other shape or type,
 * with `layer->status` `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` and
 * `layer->message` saying why. */
static inline struct ggml_tensor *engram_ggml_apply(struct ggml_context *gctx, struct ggml_tensor *highway,
                                                    struct ggml_tensor *row_ids, engram_ggml_layer *layer) {
    if (!gctx || !layer) return NULL;
    if (engram_ggml_check_(layer, highway, row_ids) != ENGRAM_STATUS_OK) return NULL;
    struct ggml_tensor *args[1] = {row_ids};
    struct ggml_tensor *out = ggml_custom_inplace(gctx, highway, args, 1, engram_ggml_op, 1, layer);
    ggml_format_name(out, "engram_%u", (unsigned)layer->layer_id);
    return out;
}

#ifdef __cplusplus
}
#endif

#endif /* ENGRAM_GGML_H */
