"""A custom reward (reward.custom_fn) for tests: +1 or -1 from a checksum of the response text.

A random-init model never answers the addition task, so the math reward would make every group
degenerate. A checksum gives groups a mix of scores that a few update steps cannot learn to
game (a length-parity reward was learned within two steps and every group became degenerate).
"""
import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if zlib.crc32(solution_str.encode()) % 2 == 0 else -1.0
