/* Prints the qpl_job layout and the constants tern's QPL codec writes by
 * hand (crates/tern-page/src/codec/qpl.rs, mod abi), from the installed QPL
 * headers; compare with the `abi_matches_the_qpl_1_9_headers` test when a
 * new QPL release comes out. QPL 1.9.0 prints:
 *   next_in_ptr 0 8, available_in 8 4, total_in 12 4, next_out_ptr 16 8,
 *   available_out 24 4, total_out 28 4, op 32 4, flags 36 4, level 52 4,
 *   sizeof(qpl_job) 240; statuses 0 2 5 225 311. */
#include <qpl/qpl.h>
#include <stddef.h>
#include <stdio.h>

#define FIELD(f) printf("%-14s %3zu %zu\n", #f, offsetof(qpl_job, f), sizeof(((qpl_job *)0)->f))

int main(void) {
    FIELD(next_in_ptr);
    FIELD(available_in);
    FIELD(total_in);
    FIELD(next_out_ptr);
    FIELD(available_out);
    FIELD(total_out);
    FIELD(op);
    FIELD(flags);
    FIELD(level);
    printf("sizeof(qpl_job) %zu\n", sizeof(qpl_job));
    printf("ops %d %d; flags %#x %#x %#x %#x\n", qpl_op_decompress, qpl_op_compress, QPL_FLAG_FIRST,
           QPL_FLAG_LAST, QPL_FLAG_DYNAMIC_HUFFMAN, QPL_FLAG_OMIT_VERIFY);
    printf("statuses %d %d %d %d %d\n", QPL_STS_OK, QPL_STS_MORE_OUTPUT_NEEDED,
           QPL_STS_QUEUES_ARE_BUSY_ERR, QPL_STS_DST_IS_SHORT_ERR, QPL_STS_INTL_OUTPUT_OVERFLOW);
    printf("paths %d %d %d; levels %d %d\n", qpl_path_auto, qpl_path_hardware, qpl_path_software,
           qpl_default_level, qpl_high_level);
    return 0;
}
