import random

import pytest

from forge_service.speculative import AdaptiveDraftLength, NgramIndex


def brute_propose(tokens, min_n, max_n, k):
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_proposes_continuation_of_latest_longest_match():
    idx = NgramIndex(2, 4, [1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert idx.propose(3) == [4, 5, 9]
    assert idx.propose(0) == []
    idx.append(7)  # suffix (2, 3, 7) never seen; (3, 7) neither
    assert idx.propose(3) == []


def test_incremental_index_matches_rescan():
    rng = random.Random(0)
    for min_n, max_n in [(1, 1), (2, 4), (3, 5)]:
        idx = NgramIndex(min_n, max_n)
        toks = []
        for _ in range(400):
            t = rng.randrange(5)
            toks.append(t)
            idx.append(t)
            for k in (1, 3, 8):
                assert idx.propose(k) == brute_propose(toks, min_n, max_n, k)


def test_bad_bounds():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_adaptive_grows_shrinks_and_probes():
    a = AdaptiveDraftLength(max_k=8, probe_interval=4)
    k0 = a.draft_len()
    for _ in range(10):
        a.update(a.draft_len(), a.draft_len())
    assert a.k == 8 and a.k > k0
    for _ in range(20):
        a.update(a.k or 1, 0)
    assert a.k == 0
    lens = [a.draft_len() for _ in range(8)]
    assert lens == [0, 0, 0, 1, 0, 0, 0, 1]
    a.update(1, 1)  # probe accepted: drafting resumes
    assert a.k >= 1
    assert AdaptiveDraftLength(max_k=0).draft_len() == 0
