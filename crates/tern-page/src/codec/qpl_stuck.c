/*
 * A stand-in for libqpl whose jobs never finish until told to: the device
 * that stopped answering, for the tests of the compressor's job deadline
 * (qpl.rs, `tests::a_stuck_device_*`). Only the entry points tern resolves
 * exist, with QPL 1.x's C signatures; statuses are QPL's values
 * (0 OK, 1 BEING_PROCESSED). Written for these tests; built with `cc`.
 */
#include <stdint.h>
#include <stdlib.h>

static volatile int released;
static volatile uint32_t submits;
static volatile uint32_t finis;

uint32_t qpl_get_job_size(uint32_t path, uint32_t *size) {
    (void)path;
    *size = 256; /* QPL 1.x's public 240 bytes and a little private state */
    return 0;
}

uint32_t qpl_init_job(uint32_t path, uint8_t *job) {
    (void)path;
    (void)job;
    return 0;
}

uint32_t qpl_submit_job(uint8_t *job) {
    (void)job;
    submits++;
    return 0;
}

/* Finished once released, having written nothing (total_out stays 0). */
uint32_t qpl_check_job(uint8_t *job) {
    (void)job;
    return released ? 0 : 1;
}

/* tern must never block here: a call is a test failure. */
uint32_t qpl_wait_job(uint8_t *job) {
    (void)job;
    abort();
}

uint32_t qpl_fini_job(uint8_t *job) {
    (void)job;
    finis++;
    return 0;
}

const char *qpl_get_library_version(void) { return "1.9.0-stuck"; }

/* The test's controls. */
void stuck_release_all(void) { released = 1; }
uint32_t stuck_submits(void) { return submits; }
uint32_t stuck_finis(void) { return finis; }
