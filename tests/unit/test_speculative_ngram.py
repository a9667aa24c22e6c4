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


def test_adaptive_length_follows_acceptance_and_cost():
    a = AdaptiveDraftLength(max_k=8, probe_interval=4)
    assert a.rate == 0.5 and a.draft_len(0.0) == 8  # rows cost nothing: the longest draft
    assert a.draft_len(0.3) == 1  # 0.5 ** 1 >= 0.3 > 0.5 ** 2
    for _ in range(10):
        a.update(4, 4)
    assert a.rate > 0.9 and a.draft_len(0.3) == 8
    for _ in range(20):
        a.update(1, 0)
    assert a.rate < 0.2
    assert [a.draft_len(0.3) for _ in range(12)] == [0, 0, 0, 0, 0, 1] * 2  # probes: every 4 / (1 - 0.3)
    assert [a.draft_len(0.9) for _ in range(50)].count(1) == 1  # dear rows: every 4 / (1 - 0.9), about 40
    assert AdaptiveDraftLength(max_k=0).draft_len(0.0) == 0


def test_a_draft_accepted_whole_starts_a_run_that_drafts_long_at_once_where_rows_are_cheap():
    a = AdaptiveDraftLength(max_k=8)
    assert a.draft_len(0.3) == 1  # rate 0.5
    a.update(1, 1)  # accepted whole: the next draft is estimated with the run's prior, 0.9
    assert a.rate == 0.9
    assert a.draft_len(0.3) == 8  # 0.9 ** 8 >= 0.3 (one request's rate alone would be 2 / 3: 2 tokens)
    assert a.draft_len(0.88) == 1  # dear rows (many streams): 0.9 ** 2 < 0.88, still short
    a.update(8, 3)  # cut short: the run ends, the request's own rate (1 accepted, 0 cut) returns
    assert a.rate == 2 / 3 and a.draft_len(0.3) == 2
    for _ in range(6):  # runs that keep being cut at once teach the run's estimate
        a.update(1, 1)
        a.update(8, 0)
    a.update(1, 1)
    assert a.rate < 0.55 and a.draft_len(0.3) == 1
