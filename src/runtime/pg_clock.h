/* pg_clock: the one clock of the runtime and of Lua (pg.wtime).
 *
 * Monotonic seconds from an arbitrary origin (CLOCK_MONOTONIC): only
 * differences mean something. It is the same clock before MPI_Init and after
 * MPI_Finalize, on every backend, so comm_stats, the engine's compute and
 * wait times, the watchdog's reports, the GEMM rate probe and the Trainer's
 * timings all measure with it. */
#ifndef PG_CLOCK_H
#define PG_CLOCK_H

double pg_wtime(void);

#endif
