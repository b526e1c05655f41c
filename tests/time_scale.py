"""Wall-clock bounds in the Python checks, scaled to the machine and the moment they run on: the
Python side of tests/time_scale.h (read its comment for the why).

    from time_scale import time_bound
    assert elapsed < time_bound(1.0), f"took {elapsed:.2f} s{time_scale_note()}"

time_scale(): LOOM_TEST_TIME_SCALE when set; otherwise a fixed amount of pure-Python integer work,
the median of three runs against the reference machine's time (an idle 2-core AMD EPYC), at least
1 and at most 20. Measured once per process, the first time it is asked.
"""
import functools
import os
import time

REFERENCE_SECONDS = 0.026  # the loop below, median of 3, on the reference machine, idle


def _calibration_run():
    x = 88172645463325252
    mask = (1 << 64) - 1
    start = time.perf_counter()
    for _ in range(100_000):
        x ^= (x << 13) & mask
        x ^= x >> 7
        x ^= (x << 17) & mask
    return time.perf_counter() - start


@functools.lru_cache(maxsize=None)
def time_scale():
    forced = os.environ.get("LOOM_TEST_TIME_SCALE")
    if forced:
        try:
            value = float(forced)
            if value > 0:
                return value
        except ValueError:
            pass
    runs = sorted(_calibration_run() for _ in range(3))
    return min(max(runs[1] / REFERENCE_SECONDS, 1.0), 20.0)


def time_bound(seconds):
    """`seconds` on the reference machine, scaled to this one now."""
    return seconds * time_scale()


def time_scale_note():
    return f" (time scale {time_scale():.2f})"
