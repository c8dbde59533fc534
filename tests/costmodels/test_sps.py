import polars as pl
import pytest

from costmodels import CostModelError, build, read_step_csv, sps_curve, step_seconds, write_sps_csv


def test_sps_curve_is_decreasing_in_batch_and_round_trips(tmp_path):
    cost = build("meta-llama/Llama-3.1-8B", "h100")
    curve = sps_curve(cost, context=1024)
    assert (curve["steps_per_s"].diff().drop_nulls() <= 0).all()
    assert (curve["tokens_per_s"].diff().drop_nulls() > 0).all()
    path = tmp_path / "sps.csv"
    write_sps_csv(cost, path)
    measured = build("meta-llama/Llama-3.1-8B", "h100", sps_csv=path)
    assert measured.source == "measured:sps.csv"
    for b, ms in zip(curve["batch_tokens"], curve["step_ms"], strict=True):
        assert step_seconds(measured.tables, b, b, b, b * 1024.0, 0.0)[0] * 1e3 == pytest.approx(ms)


@pytest.mark.parametrize("frame, message", [
    ({"batch": [1, 2], "step_ms": [5.0, 6.0]}, "needs columns 'batch_tokens'"),
    ({"batch_tokens": [1, 4, 2], "step_ms": [5.0, 6.0, 7.0]}, "row 4: batch_tokens 2 does not increase"),
    ({"batch_tokens": [1, 2, 4], "step_ms": [5.0, 7.0, 6.0]}, "row 4: step time falls"),
    ({"batch_tokens": [1, 2], "step_ms": [5.0, -1.0]}, "row 3: step time"),
    ({"batch_tokens": [1], "step_ms": [5.0]}, "at least 2 rows"),
])
def test_bad_sps_csv_is_rejected_with_row(tmp_path, frame, message):
    path = tmp_path / "bad.csv"
    pl.DataFrame(frame).write_csv(path)
    with pytest.raises(CostModelError, match=message):
        read_step_csv(path)


def test_sps_csv_accepts_steps_per_second(tmp_path):
    path = tmp_path / "s.csv"
    pl.DataFrame({"batch_tokens": [1, 256], "steps_per_s": [200.0, 50.0]}).write_csv(path)
    t = read_step_csv(path)
    assert step_seconds(t, 256, 256, 256, 1e5, 0.0) == (pytest.approx(0.02), False)
    assert step_seconds(t, 512, 512, 512, 1e5, 0.0)[1]
