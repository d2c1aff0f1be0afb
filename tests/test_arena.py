"""The device memory arena (csrc/arena.c) under AddressSanitizer, LeakSanitizer
and UndefinedBehaviorSanitizer.

The CUDA backend takes every device buffer from one arena per device, with
chunks from cudaMalloc; the arena itself is plain C, so tests/c/arena_test.c
drives it here with malloc-backed chunks: random allocation and release
sequences against a model (alignment, no overlap, every byte writable, the
statistics), coalescing and best fit, a failing chunk allocator, misuse, and
four threads on one arena. The sanitizers fail the run on any out-of-bounds
access, leak or undefined behaviour.
"""
from test_sanitizers import build_and_run


def test_arena_is_correct_under_asan_lsan_ubsan(tmp_path):
    build_and_run(tmp_path, "arena_test", ["arena.c", "status.c"])
