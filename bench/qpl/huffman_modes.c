/* QPL deflate Huffman modes on tern's corpus pages, one page per job as tern
 * sends them: dynamic, fixed, static (a table built from sampled pages,
 * written in each block header) and canned (the same table, no header; the
 * destination must hold the table), against libdeflate level 1.
 *
 * Build and run: bench/qpl/run-huffman-modes.sh (needs bench/install-qpl.sh).
 * Input: PAGES*4096 bytes from `cargo run -p tern-page --example dump_corpus`.
 * The first TRAIN pages only build the table; the rest are measured.
 * Prints, per mode: wire ratio (raw pages count 4096) and the median MB/s
 * (10^6 guest bytes per second, one thread) of ROUNDS rounds, after checking
 * every page decodes back (libdeflate, or QPL for canned). */
#include <libdeflate.h>
#include <qpl/qpl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PAGE 4096u
#define MAXC 4095u
#define TRAIN 64u
#define ROUNDS 7

enum mode { DYNAMIC, FIXED, STATIC, CANNED, LIBDEFLATE, MODES };
static const char *names[MODES] = {"qpl dynamic", "qpl fixed", "qpl static (sampled table)",
                                   "qpl canned (sampled table)", "libdeflate 1"};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void die(const char *what, int st) {
    fprintf(stderr, "%s failed: %d\n", what, st);
    exit(1);
}

/* Compresses one page; returns the length, or 0 when it did not shrink. */
static uint32_t compress_qpl(qpl_job *job, enum mode m, qpl_huffman_table_t table,
                             const uint8_t *in, uint8_t *out) {
    job->op = qpl_op_compress;
    job->level = qpl_default_level;
    job->next_in_ptr = (uint8_t *)in;
    job->available_in = PAGE;
    job->next_out_ptr = out;
    job->available_out = MAXC;
    job->flags = QPL_FLAG_FIRST | QPL_FLAG_LAST | QPL_FLAG_OMIT_VERIFY;
    job->huffman_table = NULL;
    if (m == DYNAMIC) job->flags |= QPL_FLAG_DYNAMIC_HUFFMAN;
    if (m == STATIC || m == CANNED) job->huffman_table = table;
    if (m == CANNED) job->flags |= QPL_FLAG_CANNED_MODE;
    qpl_status st = qpl_execute_job(job);
    if (st == QPL_STS_OK) return job->total_out;
    if (st == QPL_STS_MORE_OUTPUT_NEEDED || st == QPL_STS_DST_IS_SHORT_ERR ||
        st == QPL_STS_INTL_OUTPUT_OVERFLOW)
        return 0;
    die("qpl compress", st);
    return 0;
}

static void check_canned(qpl_job *job, qpl_huffman_table_t table, const uint8_t *c, uint32_t n,
                         const uint8_t *want) {
    uint8_t back[PAGE];
    job->op = qpl_op_decompress;
    job->next_in_ptr = (uint8_t *)c;
    job->available_in = n;
    job->next_out_ptr = back;
    job->available_out = PAGE;
    job->flags = QPL_FLAG_FIRST | QPL_FLAG_LAST | QPL_FLAG_CANNED_MODE;
    job->huffman_table = table;
    qpl_status st = qpl_execute_job(job);
    if (st != QPL_STS_OK || job->total_out != PAGE || memcmp(back, want, PAGE)) die("canned inflate", st);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_FILE\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) die("open corpus", 0);
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    rewind(f);
    uint32_t pages = (uint32_t)(bytes / PAGE);
    if (pages <= TRAIN) die("corpus too small", (int)pages);
    uint8_t *corpus = malloc((size_t)pages * PAGE);
    if (fread(corpus, PAGE, pages, f) != pages) die("read corpus", 0);
    fclose(f);

    uint32_t size = 0;
    qpl_status st = qpl_get_job_size(qpl_path_software, &size);
    if (st) die("qpl_get_job_size", st);
    qpl_job *job = aligned_alloc(64, (size + 63) / 64 * 64);
    if ((st = qpl_init_job(qpl_path_software, job))) die("qpl_init_job", st);

    qpl_histogram hist;
    memset(&hist, 0, sizeof hist);
    for (uint32_t i = 0; i < TRAIN; i++)
        if ((st = qpl_gather_deflate_statistics(corpus + (size_t)i * PAGE, PAGE, &hist,
                                                qpl_default_level, qpl_path_software)))
            die("qpl_gather_deflate_statistics", st);
    qpl_huffman_table_t table;
    if ((st = qpl_deflate_huffman_table_create(combined_table_type, qpl_path_software,
                                               (allocator_t)DEFAULT_ALLOCATOR_C, &table)))
        die("qpl_deflate_huffman_table_create", st);
    if ((st = qpl_huffman_table_init_with_histogram(table, &hist))) die("init_with_histogram", st);

    struct libdeflate_compressor *ld = libdeflate_alloc_compressor(1);
    struct libdeflate_decompressor *inflater = libdeflate_alloc_decompressor();
    uint8_t out[MAXC], back[PAGE];
    uint32_t measured = pages - TRAIN;
    printf("pages measured: %u (table from %u other pages), qpl %s, job %u bytes\n", measured,
           TRAIN, qpl_get_library_version(), size);
    printf("| mode | ratio | raw pages | compress MB/s (median of %d) |\n|---|---|---|---|\n", ROUNDS);
    for (int m = 0; m < MODES; m++) {
        double rates[ROUNDS];
        uint64_t wire = 0;
        uint32_t raw = 0;
        for (int r = 0; r < ROUNDS; r++) {
            double t0 = now();
            for (uint32_t i = TRAIN; i < pages; i++) {
                const uint8_t *in = corpus + (size_t)i * PAGE;
                uint32_t n = m == LIBDEFLATE
                                 ? (uint32_t)libdeflate_deflate_compress(ld, in, PAGE, out, MAXC)
                                 : compress_qpl(job, (enum mode)m, table, in, out);
                if (r) continue;
                wire += n ? n : PAGE;
                raw += !n;
                if (!n) continue;
                if (m == CANNED) {
                    check_canned(job, table, out, n, in);
                } else {
                    size_t got = 0;
                    if (libdeflate_deflate_decompress(inflater, out, n, back, PAGE, &got) ||
                        got != PAGE || memcmp(back, in, PAGE))
                        die(names[m], -1);
                }
            }
            rates[r] = (double)measured * PAGE / (now() - t0) / 1e6;
        }
        qsort(rates, ROUNDS, sizeof rates[0], cmp);
        printf("| %s | %.3f | %u | %.0f |\n", names[m], (double)measured * PAGE / (double)wire,
               raw, rates[ROUNDS / 2]);
    }
    qpl_huffman_table_destroy(table);
    qpl_fini_job(job);
    return 0;
}
