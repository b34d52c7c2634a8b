/* Paged attention on the CPU that reads K/V where they lie in the paged cache.
 *
 * Every "row" is one query token: its row in q, the block-table row of its request, and
 * how many keys it sees (causal: its own position + 1). A decode is one row; a short
 * prefill chunk is one row per token. For each KV head, a row walks the request's blocks
 * in table order and reads each slot's K (then V) row where it lies: no dense copy.
 *
 * Three passes per (row, KV head): scores of the G query heads that share the KV head,
 * softmax per query head, then the weighted sum of V, accumulated in registers when G and
 * the head size are among the common ones (about 1.6x faster than a loop over all heads
 * with the accumulators in memory). Threads take rows from a shared counter; the caller
 * sorts rows longest first so that the last rows taken are the short ones.
 *
 * Plain C with no torch headers: it compiles in well under a second, at first use. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;
    int64_t q_st, q_sh;
    const float *k_cache, *v_cache;
    int64_t c_sb, c_ss, c_sh;
    const int32_t *block_table;
    int64_t bt_stride;
    const int64_t *rows;
    const int32_t *row_req;
    const int32_t *row_len;
    int64_t n_rows;
    float *out;
    int64_t o_st, o_sh;
    int32_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int32_t max_len;
    int64_t next; /* the next row to take, shared by the threads */
    int failed;
} job_t;

/* One KV head of one row: its G query heads' scores, softmax and weighted V sum. With G and
 * D constant (inlined from the switch below) the G accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_head(const job_t *j, int64_t i, int kvh,
                                                              float *scores, const int G,
                                                              const int D) {
    const int BS = j->block_size;
    const int len = j->row_len[i];
    const int32_t *table = j->block_table + (int64_t)j->row_req[i] * j->bt_stride;
    const float *qrow = j->q + j->rows[i] * j->q_st;
    float qs[G][D];
    float acc[G][D];
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) qs[g][d] = qrow[(kvh * G + g) * j->q_sh + d] * j->scale;
    for (int pos0 = 0, b = 0; pos0 < len; pos0 += BS, b++) {
        const int n = len - pos0 < BS ? len - pos0 : BS;
        const float *k = j->k_cache + (int64_t)table[b] * j->c_sb + kvh * j->c_sh;
        for (int o = 0; o < n; o++, k += j->c_ss) {
            for (int g = 0; g < G; g++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qs[g][d] * k[d];
                scores[g * len + pos0 + o] = s;
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *s = scores + (int64_t)g * len;
        float m = s[0];
        for (int p = 1; p < len; p++) m = s[p] > m ? s[p] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int p = 0; p < len; p++) {
            s[p] = expf(s[p] - m);
            sum += s[p];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int p = 0; p < len; p++) s[p] *= inv;
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) acc[g][d] = 0.0f;
    for (int pos0 = 0, b = 0; pos0 < len; pos0 += BS, b++) {
        const int n = len - pos0 < BS ? len - pos0 : BS;
        const float *v = j->v_cache + (int64_t)table[b] * j->c_sb + kvh * j->c_sh;
        for (int o = 0; o < n; o++, v += j->c_ss) {
            for (int g = 0; g < G; g++) {
                const float w = scores[g * len + pos0 + o];
#pragma omp simd
                for (int d = 0; d < D; d++) acc[g][d] += w * v[d];
            }
        }
    }
    float *orow = j->out + j->rows[i] * j->o_st;
    for (int g = 0; g < G; g++) memcpy(orow + (kvh * G + g) * j->o_sh, acc[g], sizeof(float) * D);
}

#define HEAD(G, D) \
    for (int kvh = 0; kvh < j->num_kv_heads; kvh++) attend_head(j, i, kvh, scores, G, D)

static void attend_row(const job_t *j, int64_t i, float *scores) {
    const int G = j->num_heads / j->num_kv_heads, D = j->head_dim;
    if (D == 64 && G == 1) HEAD(1, 64);
    else if (D == 64 && G == 2) HEAD(2, 64);
    else if (D == 64 && G == 3) HEAD(3, 64);
    else if (D == 64 && G == 4) HEAD(4, 64);
    else if (D == 128 && G == 1) HEAD(1, 128);
    else if (D == 128 && G == 2) HEAD(2, 128);
    else if (D == 128 && G == 3) HEAD(3, 128);
    else if (D == 128 && G == 4) HEAD(4, 128);
    else HEAD(G, D); /* run-time sizes: the same code, its arrays on the stack */
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t group = j->num_heads / j->num_kv_heads;
    float *scores = (float *)malloc(sizeof(float) * group * (int64_t)j->max_len);
    if (scores == NULL) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    for (;;) {
        const int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n_rows) break;
        attend_row(j, i, scores);
    }
    free(scores);
    return NULL;
}

/* Returns 0, or -1 when memory or a thread could not be had (nothing is then trusted). */
int paged_attention_rows(const float *q, int64_t q_st, int64_t q_sh, const float *k_cache,
                         const float *v_cache, int64_t c_sb, int64_t c_ss, int64_t c_sh,
                         const int32_t *block_table, int64_t bt_stride, const int64_t *rows,
                         const int32_t *row_req, const int32_t *row_len, int64_t n_rows,
                         float *out, int64_t o_st, int64_t o_sh, int32_t num_heads,
                         int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                         float scale, int32_t max_len, int32_t num_threads) {
    job_t j = {q,         q_st,    q_sh,    k_cache,   v_cache,      c_sb,       c_ss,
               c_sh,      block_table, bt_stride, rows,  row_req,    row_len,    n_rows,
               out,       o_st,    o_sh,    num_heads, num_kv_heads, head_dim,   block_size,
               scale,     max_len, 0,       0};
    if (n_rows <= 0) return 0;
    if (num_threads > n_rows) num_threads = (int32_t)n_rows;
    if (num_threads < 1) num_threads = 1;
    pthread_t threads[64];
    if (num_threads > 64) num_threads = 64;
    int started = 0;
    for (int t = 1; t < num_threads; t++) {
        if (pthread_create(&threads[started], NULL, worker, &j) != 0) break;
        started++;
    }
    worker(&j); /* the calling thread works too */
    for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
    return j.failed ? -1 : 0;
}
