/* dflash-serve: the native target's whole forward on a CPU, float32, in one call (dflash_core/cpu_step/).
 *
 * A decoder of plain self-attention layers (Qwen3, Llama, Qwen2: RMSNorm, packed QKV, optional per-head q/k norm,
 * RoPE, grouped-query attention over the paged KV cache, output projection, SiLU-gated MLP) over T tokens of any
 * number of requests, each token at its own position, writing its keys and values into the paged cache in place.
 * Weights are the model's own tensors, stored input-major ([in, out] in memory, dflash_core/weight_layout.py).
 *
 * Why: a decode step of a small model on a CPU costs a few hundred tensor ops, and their dispatch, not their
 * arithmetic, is most of its time. Here the step is one call: no per-op dispatch, no temporaries.
 *
 * Every output element is one chain of fused multiply-adds over its inputs in order, whatever the number of tokens
 * and however they are tiled, and attention runs per token: a token's results do not depend on what else runs in
 * the same forward (a 16-token verify and a 1-token step compute a token bit for bit alike).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The vector the kernels work in: 16 floats where the compiler targets AVX-512 (32 registers: tiles of 8 rows x 3
 * vectors), else 8 (AVX2, NEON pairs: 16 registers, tiles of 4 rows x 3 vectors). */
#if defined(__AVX512F__)
#define VW 16
#define ROW_TILE 8
#else
#define VW 8
#define ROW_TILE 4
#endif
#define SUB_V 3    /* a multi-row tile's vectors */
#define ONE_V 8    /* a one-row tile's vectors: whole cache lines of every row of w */
typedef float vec __attribute__((vector_size(VW * 4)));

static inline vec ld(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, vec v) { memcpy(p, &v, sizeof v); }

typedef struct {
    const float *norm_in, *norm_post;  /* [H] */
    const float *qkv, *qkv_bias;       /* [H, Q + 2 KV] input-major; bias [Q + 2 KV] or NULL */
    const float *qk_norm;              /* [heads + kv_heads, d] or NULL (Llama, Qwen2) */
    const float *o, *o_bias;           /* [Q, H]; bias [H] or NULL */
    const float *gate_up;              /* [H, 2 I]: gate columns then up columns */
    const float *down;                 /* [I, H] */
    float *k_cache, *v_cache;          /* [rows, kv_heads, d] */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, layers, vocab, rot_dim, kv_block, max_pos;
    float eps, qk_eps, scale;
    const float *embed;                  /* token t's value j at embed[t * embed_row + j * embed_col] */
    int64_t embed_row, embed_col;
    const float *final_norm;             /* [H] */
    const float *lm_head;                /* [H, V] input-major (a draft: NULL, its caller runs the head) */
    const float *cos, *sin;              /* [max_pos, rot_dim] */
    const Layer *layer;
    /* a DFlash draft's: the context projection fc [feat, H] input-major (NULL for a target), its norm, the block
     * embeddings' scale */
    const float *fc, *hidden_norm;
    int64_t feat;
    float embed_scale;
} Model;

typedef struct {
    int64_t tokens;                      /* T */
    const int64_t *ids, *pos, *seq;      /* [T]: token id, position, its request's row of `tables` */
    const int64_t *tables;               /* [requests, table_len] block ids */
    int64_t requests, table_len;
    int64_t context;                     /* the longest position + 1 (scratch holds scores for that many keys) */
    const int64_t *hidden_ids;           /* hidden states to copy out: j is layer j's input, `layers` the normed */
    int64_t n_hidden;
    float *features;                     /* [T, n_hidden * H] or NULL */
    const int64_t *head_rows;            /* tokens whose logits are computed */
    int64_t n_head;
    float *logits;                       /* [n_head, V] */
    float *scratch;                      /* dflash_scratch_floats(model, T, longest context) floats */
} Batch;

/* ---- y[T, N] = x[T, K] @ w[K, N]: tiles of R rows x V vectors, each element one FMA chain over k ---- */

static inline __attribute__((always_inline)) void tile(int R, int V, int first, int64_t K, const float *x,
                                                      int64_t ldx, const float *w, int64_t ldw, float *y,
                                                      int64_t ldy) {
    vec acc[8][8];  /* `first`: the chains start at 0, else they go on from y (a block of k after another) */
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = first ? (vec){0} : ld(y + r * ldy + VW * v);
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * ldw;
        vec wv[8];
        for (int v = 0; v < V; v++) wv[v] = ld(wk + VW * v);
        for (int r = 0; r < R; r++) {
            float xr = x[r * ldx + k];
            for (int v = 0; v < V; v++) acc[r][v] += xr * wv[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) st(y + r * ldy + VW * v, acc[r][v]);
}

/* rows 0 .. R of x times columns n .. end of w (whole vectors by sub-tiles of V, then lone vectors, then scalars) */
static inline __attribute__((always_inline)) void rows_block(int R, int V, int first, int64_t K, int64_t n,
                                                            int64_t end, const float *x, int64_t ldx,
                                                            const float *w, int64_t ldw, float *y, int64_t ldy) {
    int64_t c = n;
    for (; c + V * VW <= end; c += V * VW) tile(R, V, first, K, x, ldx, w + c, ldw, y + c, ldy);
    for (; c + VW <= end; c += VW) tile(R, 1, first, K, x, ldx, w + c, ldw, y + c, ldy);
    for (int r = 0; r < R; r++)
        for (int64_t j = c; j < end; j++) {
            float acc = first ? 0.0f : y[r * ldy + j];
            for (int64_t k = 0; k < K; k++) acc = fmaf(x[r * ldx + k], w[k * ldw + j], acc);
            y[r * ldy + j] = acc;
        }
}

/* y[T, N] = x[T, K] @ w[K, N] (row stride ldw). One row: panels of ONE_V vectors, w read a row of whole cache lines
 * at a time (a stream the hardware prefetcher follows). Several rows: w in blocks of KC whole rows (one
 * contiguous stretch of memory, read once), each block's panels of one tile's columns outside and the rows of x
 * inside, so the block serves every row of x from the cache; each element's chain of multiply-adds goes on from
 * one block to the next in order of k, as in one row's. (Panels walking all of w with a stride ran at a third of
 * the bandwidth.) */
#define KC 64  /* rows of w a block: 64 to 256 KB here; measured best of 8 to 128 at 1 to 16 rows of x */
static void gemm(int64_t T, int64_t K, int64_t N, const float *x, int64_t ldx, const float *w, int64_t ldw,
                 float *y, int64_t ldy) {
    if (T == 1) {
        for (int64_t n = 0; n < N; n += ONE_V * VW)
            rows_block(1, ONE_V, 1, K, n, n + ONE_V * VW < N ? n + ONE_V * VW : N, x, ldx, w, ldw, y, ldy);
        return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t kn = k0 + KC < K ? KC : K - k0;
        const float *xk = x + k0, *wk = w + k0 * ldw;
        int first = k0 == 0;
        for (int64_t n = 0; n < N; n += SUB_V * VW) {
            int64_t end = n + SUB_V * VW < N ? n + SUB_V * VW : N, r = 0;
            for (; r + ROW_TILE <= T; r += ROW_TILE)
                rows_block(ROW_TILE, SUB_V, first, kn, n, end, xk + r * ldx, ldx, wk, ldw, y + r * ldy, ldy);
            for (; r + 4 <= T; r += 4)
                rows_block(4, SUB_V, first, kn, n, end, xk + r * ldx, ldx, wk, ldw, y + r * ldy, ldy);
            for (; r < T; r++) rows_block(1, SUB_V, first, kn, n, end, xk + r * ldx, ldx, wk, ldw, y + r * ldy, ldy);
        }
    }
}

/* ---- row-wise pieces ---- */

static float sum_squares(const float *x, int64_t n) {
    vec acc = (vec){0};
    int64_t i = 0;
    for (; i + VW <= n; i += VW) { vec v = ld(x + i); acc += v * v; }
    float s = 0.0f;
    for (int j = 0; j < VW; j++) s += acc[j];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* transformers' RMSNorm in float32: x * rsqrt(mean(x^2) + eps), then times the weight */
static void rms_norm(const float *x, const float *weight, float eps, int64_t n, float *out) {
    float inv = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

/* rotate_half RoPE on the first r dims of x [d] at one position (cos / sin rows of r values) */
static void rope(float *x, const float *cos, const float *sin, int64_t r) {
    int64_t half = r / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

typedef float v8 __attribute__((vector_size(32)));

/* a dot product of two head vectors: 8 lanes, then halved (d is a multiple of 8 in every supported model) */
static float dot(const float *a, const float *b, int64_t n) {
    v8 acc = (v8){0}, x, y;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { memcpy(&x, a + i, 32); memcpy(&y, b + i, 32); acc += x * y; }
    float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* exp of each lane: Cephes' single-precision polynomial (about 1 ulp), the argument clamped to [-87.3, 88.37] (no
 * overflow, no denormal); the same arithmetic wherever it runs, so every forward rounds alike */
typedef int32_t veci __attribute__((vector_size(VW * 4)));

static inline vec vexp(vec x) {
    const vec hi = (vec){0} + 88.37f, lo = (vec){0} - 87.3f, magic = (vec){0} + 12582912.0f;
    veci above = x > hi, below = x < lo;  /* lanes -1 where true: a bitwise select (C has no vector ?:) */
    x = (vec)(((veci)x & ~above) | ((veci)hi & above));
    x = (vec)(((veci)x & ~below) | ((veci)lo & below));
    vec n = (x * 1.44269504088896341f + magic) - magic;  /* round to nearest: x / ln 2 */
    vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vec p = (vec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    veci bits = (__builtin_convertvector(n, veci) + 127) << 23;  /* 2^n */
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* exp of n floats in place (the last partial vector through a padded copy) */
static void exp_inplace(float *s, int64_t n) {
    int64_t j = 0;
    for (; j + VW <= n; j += VW) st(s + j, vexp(ld(s + j)));
    if (j < n) {
        float pad[VW] = {0};
        memcpy(pad, s + j, sizeof(float) * (n - j));
        st(pad, vexp(ld(pad)));
        memcpy(s + j, pad, sizeof(float) * (n - j));
    }
}

/* softmax of n scores in place */
static void softmax(float *s, int64_t n) {
    float top = s[0];
    for (int64_t j = 1; j < n; j++) top = s[j] > top ? s[j] : top;
    for (int64_t j = 0; j < n; j++) s[j] -= top;
    exp_inplace(s, n);
    vec acc = (vec){0};
    int64_t j = 0;
    for (; j + VW <= n; j += VW) acc += ld(s + j);
    float total = 0.0f;
    for (int i = 0; i < VW; i++) total += acc[i];
    for (; j < n; j++) total += s[j];
    float inv = 1.0f / total;
    for (j = 0; j < n; j++) s[j] *= inv;
}

/* one query row's heads q [heads, d] over n_cache keys of the layer's cache (positions 0 .. n_cache - 1 of the
 * request's block table `table`, walked block by block) and then n_block keys of this forward (`block`: qkv rows of
 * stride W, keys at column Q, values at Q + KV): out [heads, d] */
static void attend(const Model *m, const Layer *L, const int64_t *table, int64_t n_cache, const float *block,
                   int64_t n_block, int64_t W, const float *q, float *out, float *scores) {
    int64_t d = m->head_dim, kvh = m->kv_heads, group = m->heads / m->kv_heads, n = n_cache + n_block;
    int64_t Q = m->heads * d, KV = kvh * d, kvb = m->kv_block;
    memset(out, 0, sizeof(float) * m->heads * d);
    for (int64_t g = 0; g < kvh; g++) {
        for (int64_t j0 = 0; j0 < n; j0 += kvb) {  /* scores [group, n]: a key row once for the group's heads */
            int64_t row = j0 < n_cache ? table[j0 / kvb] * kvb : 0;
            for (int64_t j = j0; j < j0 + kvb && j < n; j++) {
                const float *key = j < n_cache ? L->k_cache + ((row + j - j0) * kvh + g) * d
                                               : block + (j - n_cache) * W + Q + g * d;
                for (int64_t h = 0; h < group; h++)
                    scores[h * n + j] = dot(q + (g * group + h) * d, key, d) * m->scale;
            }
        }
        for (int64_t h = 0; h < group; h++) softmax(scores + h * n, n);
        for (int64_t j0 = 0; j0 < n; j0 += kvb) {
            int64_t row = j0 < n_cache ? table[j0 / kvb] * kvb : 0;
            for (int64_t j = j0; j < j0 + kvb && j < n; j++) {
                const float *val = j < n_cache ? L->v_cache + ((row + j - j0) * kvh + g) * d
                                               : block + (j - n_cache) * W + Q + KV + g * d;
                for (int64_t h = 0; h < group; h++) {
                    float p = scores[h * n + j], *o = out + (g * group + h) * d;
                    for (int64_t i = 0; i < d; i++) o[i] = fmaf(p, val[i], o[i]);
                }
            }
        }
    }
}

static void copy_hidden(const Model *m, const Batch *b, int64_t j, const float *h) {
    for (int64_t k = 0; k < b->n_hidden; k++)
        if (b->hidden_ids[k] == j)
            for (int64_t t = 0; t < b->tokens; t++)
                memcpy(b->features + (t * b->n_hidden + k) * m->hidden, h + t * m->hidden, sizeof(float) * m->hidden);
}

/* ---- the forward ---- */

int64_t dflash_scratch_floats(const Model *m, int64_t tokens, int64_t context) {
    int64_t H = m->hidden, Q = m->heads * m->head_dim, KV = m->kv_heads * m->head_dim, I = m->inter;
    int64_t per_token = 3 * H + (Q + 2 * KV) + Q + 2 * I + I;
    return tokens * per_token + (m->heads / m->kv_heads) * context;
}

/* a layer's queries, keys and values [T, Q + 2 KV] of T rows h at positions pos: normed, projected, biased, the
 * queries' and keys' heads normed (Qwen3) and rotated */
static void project(const Model *m, const Layer *L, int64_t T, const float *h, const int64_t *pos, float *x,
                    float *qkv) {
    int64_t H = m->hidden, d = m->head_dim, W = (m->heads + 2 * m->kv_heads) * d;
    for (int64_t t = 0; t < T; t++) rms_norm(h + t * H, L->norm_in, m->eps, H, x + t * H);
    gemm(T, H, W, x, H, L->qkv, W, qkv, W);
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * W;
        if (L->qkv_bias)
            for (int64_t i = 0; i < W; i++) row[i] += L->qkv_bias[i];
        const float *cos = m->cos + pos[t] * m->rot_dim, *sin = m->sin + pos[t] * m->rot_dim;
        for (int64_t hd = 0; hd < m->heads + m->kv_heads; hd++) {  /* queries' heads, then keys' */
            float *v = row + hd * d;
            if (L->qk_norm) rms_norm(v, L->qk_norm + hd * d, m->qk_eps, d, v);
            rope(v, cos, sin, m->rot_dim);
        }
    }
}

/* the rest of a layer on T rows h, in place: the output projection of att [T, Q], the residual, the SiLU MLP */
static void finish(const Model *m, const Layer *L, int64_t T, float *h, const float *att, float *x, float *tmp,
                   float *gu, float *act) {
    int64_t H = m->hidden, I = m->inter, Q = m->heads * m->head_dim;
    gemm(T, Q, H, att, Q, L->o, H, tmp, H);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < H; i++) h[t * H + i] += L->o_bias ? tmp[t * H + i] + L->o_bias[i] : tmp[t * H + i];
    for (int64_t t = 0; t < T; t++) rms_norm(h + t * H, L->norm_post, m->eps, H, x + t * H);
    gemm(T, H, 2 * I, x, H, L->gate_up, 2 * I, gu, 2 * I);
    for (int64_t t = 0; t < T; t++) {  /* SiLU(gate) * up = gate / (1 + exp(-gate)) * up */
        const float *g = gu + t * 2 * I, *u = g + I;
        float *a = act + t * I;
        for (int64_t i = 0; i < I; i++) a[i] = -g[i];
        exp_inplace(a, I);
        for (int64_t i = 0; i < I; i++) a[i] = g[i] / (1.0f + a[i]) * u[i];
    }
    gemm(T, I, H, act, I, L->down, H, tmp, H);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < H; i++) h[t * H + i] += tmp[t * H + i];
}

static void layer_forward(const Model *m, const Layer *L, const Batch *b, float *h, float *x, float *tmp,
                          float *qkv, float *att, float *gu, float *act, float *scores) {
    int64_t T = b->tokens, d = m->head_dim, Q = m->heads * d, KV = m->kv_heads * d, W = Q + 2 * KV;
    project(m, L, T, h, b->pos, x, qkv);
    for (int64_t t = 0; t < T; t++) {  /* every token's keys and values in the cache before any query reads */
        const int64_t *table = b->tables + b->seq[t] * b->table_len;
        int64_t cr = table[b->pos[t] / m->kv_block] * m->kv_block + b->pos[t] % m->kv_block;
        memcpy(L->k_cache + cr * KV, qkv + t * W + Q, sizeof(float) * KV);
        memcpy(L->v_cache + cr * KV, qkv + t * W + Q + KV, sizeof(float) * KV);
    }
    for (int64_t t = 0; t < T; t++)
        attend(m, L, b->tables + b->seq[t] * b->table_len, b->pos[t] + 1, NULL, 0, W, qkv + t * W, att + t * Q,
               scores);
    finish(m, L, T, h, att, x, tmp, gu, act);
}

/* 0 on success; -1 (nothing written) when a position lies outside the rotary table or the request's table */
int64_t dflash_forward(const Model *m, const Batch *b) {
    int64_t T = b->tokens, H = m->hidden, d = m->head_dim, I = m->inter;
    int64_t Q = m->heads * d, KV = m->kv_heads * d;
    for (int64_t t = 0; t < T; t++)  /* a position outside the rotary table, the scratch or the request's table */
        if (b->pos[t] < 0 || b->pos[t] >= m->max_pos || b->pos[t] >= b->context
            || b->pos[t] / m->kv_block >= b->table_len || b->seq[t] < 0 || b->seq[t] >= b->requests)
            return -1;
    float *h = b->scratch, *x = h + T * H, *tmp = x + T * H, *qkv = tmp + T * H, *att = qkv + T * (Q + 2 * KV);
    float *gu = att + T * Q, *act = gu + T * 2 * I, *scores = act + T * I;
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < H; j++) h[t * H + j] = m->embed[b->ids[t] * m->embed_row + j * m->embed_col];
    for (int64_t li = 0; li < m->layers; li++) {
        copy_hidden(m, b, li, h);
        layer_forward(m, m->layer + li, b, h, x, tmp, qkv, att, gu, act, scores);
    }
    for (int64_t t = 0; t < T; t++) rms_norm(h + t * H, m->final_norm, m->eps, H, x + t * H);
    copy_hidden(m, b, m->layers, x);
    for (int64_t r = 0; r < b->n_head; r++)  /* the head's rows side by side (tmp holds T rows) */
        memcpy(tmp + r * H, x + b->head_rows[r] * H, sizeof(float) * H);
    gemm(b->n_head, H, m->vocab, tmp, H, m->lm_head, m->vocab, b->logits, m->vocab);
    return 0;
}

/* ---- a DFlash draft's forward: new context rows into its cache, then the block over context and block ---- */

typedef struct {
    int64_t requests, width;             /* b blocks of w tokens */
    const int64_t *ids;                  /* [b, w] the blocks' tokens (the last token, then mask tokens) */
    const int64_t *start;                /* [b] a block's first position: its context is positions 0 .. start - 1 */
    const int64_t *block_len;            /* [b] the block's keys its queries see (the first block_len) */
    int64_t n_ctx;                       /* new context rows (target features) */
    const float *ctx;                    /* [n_ctx, feat] */
    const int64_t *ctx_pos, *ctx_row;    /* [n_ctx] their positions and draft cache rows */
    const int64_t *tables;               /* [b, table_len] block ids */
    int64_t table_len;
    const int64_t *pos;                  /* [b * w] the block rows' positions: start + column */
    int64_t context;                     /* the largest start (scratch holds scores for context + w keys) */
    float *hidden;                       /* [b * w, H] out: the block rows' final-normed hidden states */
    float *scratch;                      /* dflash_draft_scratch_floats(...) floats */
} DraftBatch;

int64_t dflash_draft_scratch_floats(const Model *m, int64_t rows, int64_t width, int64_t n_ctx, int64_t context) {
    int64_t H = m->hidden, KV = m->kv_heads * m->head_dim, Q = m->heads * m->head_dim, I = m->inter;
    int64_t T = rows * width, per_row = 3 * H + (Q + 2 * KV) + Q + 2 * I + I;
    return n_ctx * (2 * H + 2 * KV) + T * per_row + (m->heads / m->kv_heads) * (context + width);
}

/* 0 on success; -1 when a position lies outside the rotary table */
int64_t dflash_draft_forward(const Model *m, const DraftBatch *b) {
    int64_t H = m->hidden, d = m->head_dim, I = m->inter, C = b->n_ctx, w = b->width, T = b->requests * w;
    int64_t Q = m->heads * d, KV = m->kv_heads * d, W = Q + 2 * KV;
    for (int64_t r = 0; r < b->requests; r++)
        if (b->start[r] < 0 || b->start[r] + w > m->max_pos || b->start[r] > b->context
            || (b->start[r] + m->kv_block - 1) / m->kv_block > b->table_len || b->block_len[r] > w)
            return -1;
    for (int64_t c = 0; c < C; c++)
        if (b->ctx_pos[c] < 0 || b->ctx_pos[c] >= m->max_pos) return -1;
    float *proj = b->scratch, *ctx = proj + C * H, *kv = ctx + C * H, *h = kv + C * 2 * KV, *x = h + T * H;
    float *tmp = x + T * H, *qkv = tmp + T * H, *att = qkv + T * W, *gu = att + T * Q, *act = gu + T * 2 * I;
    float *scores = act + T * I;
    const int64_t *pos = b->pos;
    if (C) {  /* the context rows: fc, then its norm */
        gemm(C, m->feat, H, b->ctx, m->feat, m->fc, H, proj, H);
        for (int64_t c = 0; c < C; c++) rms_norm(proj + c * H, m->hidden_norm, m->eps, H, ctx + c * H);
    }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t j = 0; j < H; j++)
            h[t * H + j] = m->embed[b->ids[t] * m->embed_row + j * m->embed_col] * m->embed_scale;
    }
    for (int64_t li = 0; li < m->layers; li++) {
        const Layer *L = m->layer + li;
        if (C) {  /* the context rows' keys (normed, rotated) and values into the cache */
            gemm(C, H, 2 * KV, ctx, H, L->qkv + Q, W, kv, 2 * KV);
            for (int64_t c = 0; c < C; c++) {
                float *row = kv + c * 2 * KV;
                if (L->qkv_bias)
                    for (int64_t i = 0; i < 2 * KV; i++) row[i] += L->qkv_bias[Q + i];
                const float *cos = m->cos + b->ctx_pos[c] * m->rot_dim, *sin = m->sin + b->ctx_pos[c] * m->rot_dim;
                for (int64_t g = 0; g < m->kv_heads; g++) {
                    if (L->qk_norm) rms_norm(row + g * d, L->qk_norm + (m->heads + g) * d, m->qk_eps, d, row + g * d);
                    rope(row + g * d, cos, sin, m->rot_dim);
                }
                memcpy(L->k_cache + b->ctx_row[c] * KV, row, sizeof(float) * KV);
                memcpy(L->v_cache + b->ctx_row[c] * KV, row + KV, sizeof(float) * KV);
            }
        }
        project(m, L, T, h, pos, x, qkv);
        for (int64_t t = 0; t < T; t++) {  /* every query sees its context and its block's first block_len keys */
            int64_t r = t / w;
            attend(m, L, b->tables + r * b->table_len, b->start[r], qkv + r * w * W, b->block_len[r], W,
                   qkv + t * W, att + t * Q, scores);
        }
        finish(m, L, T, h, att, x, tmp, gu, act);
    }
    for (int64_t t = 0; t < T; t++) rms_norm(h + t * H, m->final_norm, m->eps, H, b->hidden + t * H);
    return 0;
}
