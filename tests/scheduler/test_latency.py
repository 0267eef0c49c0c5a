"""Eq. 1 latency model: the Table 1 fit, the chunk-length root, profile files."""

from __future__ import annotations

import math

import pytest

from tetris.scheduler.latency import (
    LatencySample,
    PrefillLatencyModel,
    ProfileError,
    SpCoefficients,
    derive_llama3_70b_tp4,
    embedded_profiles,
    load_profile,
    read_table_csv,
)



@pytest.fixture(scope="module")
def table1():
    from importlib import resources

    path = resources.files("tetris.configs").joinpath("profiles/paper_table1_llama3_8b_a100.csv")
    return read_table_csv(str(path))


def test_table1_has_every_cell_but_the_oom_one(table1):
    assert len(table1) == 7 * 5 - 1
    assert not any(s.sp_size == 1 and s.chunk_tokens == 262144 for s in table1)


def test_fit_of_table1_is_within_seven_percent_everywhere(table1):
    m = PrefillLatencyModel.fit(table1, name="t1")
    errs = [abs(e) for _, e in m.relative_errors(table1)]
    assert max(errs) < 0.07
    assert m.max_relative_error == pytest.approx(max(errs))
    # SP 1 and 2 are nearly quadratic in l: the fit should be much tighter there.
    assert max(abs(e) for s, e in m.relative_errors(table1) if s.sp_size <= 2) < 0.02
    for c in m.coefficients:
        assert c.gamma == pytest.approx(2 * c.delta)  # SPEC §2 without history samples


def test_shipped_8b_profile_is_the_fit_of_table1(table1):
    shipped = load_profile("a100-llama3-8b-tp1")
    fitted = PrefillLatencyModel.fit(table1)
    for a, b in zip(shipped.coefficients, fitted.coefficients):
        assert (a.sp_size, a.alpha, a.beta, a.gamma, a.delta) == pytest.approx(
            (b.sp_size, b.alpha, b.beta, b.gamma, b.delta), rel=1e-9)
    assert shipped.sp_sizes == (1, 2, 4, 8, 16)


def test_shipped_70b_profile_is_reproducible_and_slower_than_8b():
    base = load_profile("a100-llama3-8b-tp1")
    shipped = load_profile("a100-llama3-70b-tp4")
    derived = derive_llama3_70b_tp4(base)
    assert shipped.tp_size == 4
    for sp in base.sp_sizes:
        for length in (4096, 65536):
            assert shipped.predict(sp, 0, length) == pytest.approx(derived.predict(sp, 0, length))
            assert shipped.predict(sp, 0, length) > base.predict(sp, 0, length)
    assert set(embedded_profiles()) >= {"a100-llama3-8b-tp1", "a100-llama3-70b-tp4"}


def test_fit_recovers_known_coefficients_with_history():
    truth = PrefillLatencyModel([SpCoefficients(4, 0.05, 2e-5, 7e-10, 3e-10)])
    samples = [LatencySample(4, h, l, truth.predict(4, h, l))
               for h in (0, 8192, 32768) for l in (1024, 4096, 16384, 65536)]
    m = PrefillLatencyModel.fit(samples)
    c = m.coefficients[0]
    assert (c.alpha, c.beta, c.gamma, c.delta) == pytest.approx((0.05, 2e-5, 7e-10, 3e-10), rel=1e-6)


@pytest.mark.parametrize("h", [0, 10000, 100000])
@pytest.mark.parametrize("budget", [0.2, 1.0, 7.5])
def test_solve_chunk_tokens_inverts_predict(h, budget):
    m = load_profile("a100-llama3-8b-tp1")
    for sp in m.sp_sizes:
        l = m.solve_chunk_tokens(sp, h, budget)
        if budget <= m.table[sp][0]:
            assert l == 0.0
        else:
            assert m.predict(sp, h, l) == pytest.approx(budget, rel=1e-9)


def test_save_load_roundtrip_and_errors(tmp_path):
    m = load_profile("a100-llama3-8b-tp1")
    p = m.save(tmp_path / "x.json")
    back = load_profile(p)
    assert back.predict(8, 1000, 5000) == m.predict(8, 1000, 5000)
    with pytest.raises(ProfileError, match="embedded"):
        load_profile("no-such-profile")
    with pytest.raises(ProfileError, match="SP size 3"):
        m.predict(3, 0, 10)
    with pytest.raises(ProfileError, match="negative"):
        PrefillLatencyModel([SpCoefficients(1, 0.0, -1.0, 0.0, 0.0)])
    bad = tmp_path / "bad.csv"
    bad.write_text("tokens,sp1\n1,2\n")
    with pytest.raises(ProfileError, match="prompt_tokens"):
        read_table_csv(bad)
    assert math.isfinite(m.predict(16, 0, 1))
