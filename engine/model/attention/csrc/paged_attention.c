/* Paged attention on the CPU that reads K/V where they lie in the paged cache.
 *
 * Every "row" is one query token: its row in q, the block-table row of its request, and
 * how many keys it sees (causal: its own position + 1). A decode is one row; a short
 * prefill chunk is one row per token. A row's work walks the request's blocks in table
 * order, reading each slot's K/V for all KV heads at once (one contiguous run per slot),
 * so the cache is streamed once per row with no dense copy.
 *
 * Three passes per row: scores (q . k for every query head), softmax per head, then the
 * weighted sum of V. Threads take rows from a shared counter; the caller sorts rows
 * longest first so that the last rows taken are the short ones.
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

/* Inlined into callers with a constant D (64, 128), where the compiler unrolls the head
 * loops completely (about 20% faster than a run-time D), and once with the run-time D. */
static inline __attribute__((always_inline)) void attend_row_d(const job_t *j, int64_t i,
                                                               float *scores, float *qs,
                                                               float *acc, const int D) {
    const int H = j->num_heads, HKV = j->num_kv_heads, BS = j->block_size;
    const int G = H / HKV;
    const int len = j->row_len[i];
    const int32_t *table = j->block_table + (int64_t)j->row_req[i] * j->bt_stride;
    const float *qrow = j->q + j->rows[i] * j->q_st;

    for (int h = 0; h < H; h++)
        for (int d = 0; d < D; d++) qs[h * D + d] = qrow[h * j->q_sh + d] * j->scale;

    /* scores[h * len + pos] = (scale * q_h) . k_pos */
    for (int pos0 = 0, b = 0; pos0 < len; pos0 += BS, b++) {
        const int n = len - pos0 < BS ? len - pos0 : BS;
        const float *blk = j->k_cache + (int64_t)table[b] * j->c_sb;
        for (int o = 0; o < n; o++) {
            const float *slot = blk + o * j->c_ss;
            for (int kvh = 0; kvh < HKV; kvh++) {
                const float *k = slot + kvh * j->c_sh;
                for (int g = 0; g < G; g++) {
                    const int h = kvh * G + g;
                    const float *qh = qs + h * D;
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < D; d++) s += qh[d] * k[d];
                    scores[h * len + pos0 + o] = s;
                }
            }
        }
    }

    /* softmax per head; the row's own key is always there, so len >= 1 */
    for (int h = 0; h < H; h++) {
        float *s = scores + (int64_t)h * len;
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

    /* out_h = sum over keys of p_h * v */
    memset(acc, 0, sizeof(float) * H * D);
    for (int pos0 = 0, b = 0; pos0 < len; pos0 += BS, b++) {
        const int n = len - pos0 < BS ? len - pos0 : BS;
        const float *blk = j->v_cache + (int64_t)table[b] * j->c_sb;
        for (int o = 0; o < n; o++) {
            const float *slot = blk + o * j->c_ss;
            for (int kvh = 0; kvh < HKV; kvh++) {
                const float *v = slot + kvh * j->c_sh;
                for (int g = 0; g < G; g++) {
                    const int h = kvh * G + g;
                    const float w = scores[(int64_t)h * len + pos0 + o];
                    float *a = acc + h * D;
#pragma omp simd
                    for (int d = 0; d < D; d++) a[d] += w * v[d];
                }
            }
        }
    }
    float *orow = j->out + j->rows[i] * j->o_st;
    for (int h = 0; h < H; h++) memcpy(orow + h * j->o_sh, acc + h * D, sizeof(float) * D);
}

static void attend_row(const job_t *j, int64_t i, float *scores, float *qs, float *acc) {
    switch (j->head_dim) {
        case 64: attend_row_d(j, i, scores, qs, acc, 64); break;
        case 128: attend_row_d(j, i, scores, qs, acc, 128); break;
        default: attend_row_d(j, i, scores, qs, acc, j->head_dim); break;
    }
}

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    const int64_t H = j->num_heads, D = j->head_dim;
    float *buf = (float *)malloc(sizeof(float) * (H * (int64_t)j->max_len + 2 * H * D));
    if (buf == NULL) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    for (;;) {
        const int64_t i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (i >= j->n_rows) break;
        attend_row(j, i, buf + 2 * H * D, buf, buf + H * D);
    }
    free(buf);
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
