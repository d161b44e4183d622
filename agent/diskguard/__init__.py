"""The profiling disk guard: keeps the profiling tree under its limit by ageing the oldest records."""
