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
 * Errors. A ggml op cannot return a status: the op stores `engram_apply`'s
 * in `layer->status` (`ENGRAM_STATUS_OK` on success; on error the highway
 * is unchanged, as `engram_apply` promises). Check it after
 * `ggml_graph_compute*`; `engram_last_error()` on the computing thread has
 * the message, which `layer->message` keeps a copy of.
 *
 * Backends. CPU only: the op reads and writes `tensor->data` on the host.
 * ggml-cuda does not run custom ops (see docs/ggml.md and
 * integrations/ggml/ggml-cuda-custom-op.patch for what it would take).
 */
#ifndef ENGRAM_GGML_H
#define ENGRAM_GGML_H

#include <stddef.h>
#include <stdint.h>
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
    uint32_t d, hc;             /* the context's hidden size D and hc (the highway's ne0, ne1) */
    enum engram_status status;  /* written by the op: engram_apply's status */
    char message[256];          /* written by the op on error: engram_last_error() */
} engram_ggml_layer;

static inline void engram_ggml_layer_init(engram_ggml_layer *l, struct engram_context *ctx, uint32_t layer_id,
                                          uint32_t d, uint32_t hc) {
    memset(l, 0, sizeof *l);
    l->ctx = ctx;
    l->layer_id = layer_id;
    l->d = d;
    l->hc = hc;
    l->status = ENGRAM_STATUS_OK;
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

/* The op's body (ggml_custom_op_t): dst is the in-place view of the highway,
 * src[0] the highway, src[1] the row ids. */
static inline void engram_ggml_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)nth;
    if (ith != 0) return;
    engram_ggml_layer *l = (engram_ggml_layer *)userdata;
    const struct ggml_tensor *ids = dst->src[1];
    uint32_t type = dst->type == GGML_TYPE_BF16 ? (uint32_t)ENGRAM_TYPE_BF16 : (uint32_t)ENGRAM_TYPE_F32;
    l->status = engram_apply(l->ctx, l->layer_id, (const int64_t *)ids->data, (uint32_t)dst->ne[2], dst->data,
                             type, NULL);
    if (l->status != ENGRAM_STATUS_OK) {
        const char *m = engram_last_error();
        size_t n = m ? strlen(m) : 0;
        if (n >= sizeof l->message) n = sizeof l->message - 1;
        if (n) memcpy(l->message, m, n);
        l->message[n] = '\0';
    } else {
        l->message[0] = '\0';
    }
}

/* `highway += engram(layer)`, in place: returns the view of `highway` that
 * the rest of the graph uses after the engram layer. `highway` is a
 * contiguous f32 or bf16 `[D, hc, n_tokens]` tensor (D and hc as given to
 * `engram_ggml_layer_init`), `row_ids` the batch's
 * `engram_ggml_new_row_ids` tensor (same n_tokens). NULL (nothing added to
 * the graph) for any other shape or type. */
static inline struct ggml_tensor *engram_ggml_apply(struct ggml_context *gctx, struct ggml_tensor *highway,
                                                    struct ggml_tensor *row_ids, engram_ggml_layer *layer) {
    if (!gctx || !highway || !row_ids || !layer || !layer->ctx) return NULL;
    if ((highway->type != GGML_TYPE_F32 && highway->type != GGML_TYPE_BF16) || !ggml_is_contiguous(highway) ||
        highway->ne[0] != (int64_t)layer->d || highway->ne[1] != (int64_t)layer->hc || highway->ne[2] < 1 ||
        highway->ne[3] != 1 || row_ids->type != GGML_TYPE_I64 || !ggml_is_contiguous(row_ids) ||
        row_ids->ne[0] != (int64_t)engram_row_ids_per_token(layer->ctx) || row_ids->ne[1] != highway->ne[2] ||
        row_ids->ne[2] != 1 || row_ids->ne[3] != 1 || highway->ne[2] > (int64_t)UINT32_MAX) {
        return NULL;
    }
    struct ggml_tensor *args[1] = {row_ids};
    struct ggml_tensor *out = ggml_custom_inplace(gctx, highway, args, 1, engram_ggml_op, 1, layer);
    ggml_format_name(out, "engram_%u", (unsigned)layer->layer_id);
    return out;
}

#ifdef __cplusplus
}
#endif

#endif /* ENGRAM_GGML_H */
