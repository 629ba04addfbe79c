"""The Jacobi window: warm-up, n-grams read down the columns, and the shift."""

from lookahead.window import JacobiWindow


def test_warm_up_then_ngrams_and_shift():
    win = JacobiWindow(window_size=3, ngram_size=4, seed_tokens=[9])
    assert win.levels == [[9, 9]] and not win.full
    assert win.update(t=1, new_level=[10, 11, 12]) == []  # warm-up: level 1 appended
    assert win.update(t=1, new_level=[20, 21, 22]) == []  # level 2: now full (N-1 = 3 levels)
    assert win.full and win.tokens() == [9, 9, 10, 11, 12, 20, 21, 22]
    grams = win.update(t=5, new_level=[30, 31, 32])
    # column 0 starts with t; columns 1, 2 with level 0
    assert grams == [(5, 10, 20, 30), (9, 11, 21, 31), (9, 12, 22, 32)]
    # shift: old level 1 without its column 0 becomes level 0
    assert win.levels == [[11, 12], [20, 21, 22], [30, 31, 32]]


def test_bigram_window_is_full_from_the_start():
    win = JacobiWindow(window_size=3, ngram_size=2, seed_tokens=[4])
    assert win.full
    assert win.update(t=7, new_level=[1, 2, 3]) == [(7, 1), (4, 2), (4, 3)]
    assert win.levels == [[2, 3]]


def test_single_column_window():
    win = JacobiWindow(window_size=1, ngram_size=3, seed_tokens=[4])
    assert win.levels == [[]]
    win.update(t=7, new_level=[1])
    assert win.update(t=8, new_level=[2]) == [(8, 1, 2)]
    assert win.levels == [[], [2]]


def test_disabled_window():
    assert JacobiWindow(window_size=0, ngram_size=4, seed_tokens=[1]).n_levels == 0
