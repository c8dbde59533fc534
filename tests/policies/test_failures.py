"""Failure schedules: parsing, validation naming the row, event order, seeded random failures."""

import math

import numpy as np
import pytest

from policies.failures import FailureError, FailureSchedule, random_failures


def test_cli_text_parses_into_windows_sorted_by_down_time():
    schedule = FailureSchedule.parse("2@600:900, 0@100:200,1@50:inf")
    assert schedule.rows() == [(1, 50.0, math.inf), (0, 100.0, 200.0), (2, 600.0, 900.0)]
    assert FailureSchedule.parse(schedule.describe()).rows() == schedule.rows()
    assert schedule.replica.dtype == np.int64 and schedule.t_down.dtype == np.float64


def test_events_put_downs_before_ups_at_equal_times_and_skip_never_ending_windows():
    schedule = FailureSchedule.parse("1@5:10,0@10:20,2@1:inf")
    times, replicas, up = schedule.events()
    assert list(zip(times, replicas, up, strict=True)) == [
        (1.0, 2, False), (5.0, 1, False), (10.0, 0, False), (10.0, 1, True), (20.0, 0, True)]


@pytest.mark.parametrize("text, message", [
    ("2@600:500", r"--fail '2@600:500' row 0: t_up \('500'\) must be after t_down"),
    ("0@1:2,x@1:2", "row 1: replica must be an integer >= 0, got 'x'"),
    ("-1@1:2", "replica must be an integer >= 0"),
    ("1.5@1:2", "replica must be an integer >= 0"),
    ("1@nan:3", "t_down must be a number of seconds"),
    ("1@inf:inf", "t_down must be a finite time"),
    ("2@600", "expected REPLICA@DOWN:UP"),
    ("1@1:5,0@2:3,1@5:8", r"rows 0 and 2: replica 1's windows \[1, 5\) and \[5, 8\) overlap or touch"),
    ("1@1:5,1@3:4", "overlap or touch"),
    (" , ", "is empty"),
])
def test_bad_schedules_name_the_row(text, message):
    with pytest.raises(FailureError, match=message):
        FailureSchedule.parse(text)


def test_a_replica_outside_the_fleet_is_named():
    schedule = FailureSchedule.parse("0@1:2,3@5:6")
    schedule.check_replicas(4)
    with pytest.raises(FailureError, match=r"failure 3@5:6: replica 3 does not exist in a fleet of 3"):
        schedule.check_replicas(3)


def test_direct_construction_is_validated_too():
    with pytest.raises(FailureError, match="t_up .* must be after t_down"):
        FailureSchedule(np.array([1]), np.array([2.0]), np.array([1.0]))
    with pytest.raises(FailureError, match="equal length"):
        FailureSchedule(np.array([1, 2]), np.array([2.0]), np.array([3.0]))


def test_toml_windows_as_strings_or_tables():
    schedule = FailureSchedule.from_toml(
        '[failures]\nwindows = ["1@3:4", {replica = 0, down_s = 1.5}, {replica = 2, down_s = 7, up_s = 9}]\n')
    assert schedule.rows() == [(0, 1.5, math.inf), (1, 3.0, 4.0), (2, 7.0, 9.0)]
    assert FailureSchedule.from_mapping({"windows": []}).rows() == []
    with pytest.raises(FailureError, match=r"windows\[0\]: needs replica and down_s"):
        FailureSchedule.from_toml("[failures]\nwindows = [{replica = 0, up_s = 3}]\n")
    with pytest.raises(FailureError, match=r"unknown key\(s\) \['mtbf'\]"):
        FailureSchedule.from_toml("[failures]\nmtbf = 3\nwindows = []\n")
    with pytest.raises(FailureError, match="windows row 1: t_up"):
        FailureSchedule.from_toml('windows = ["0@1:2", "1@5:4"]\n')


def test_random_failures_are_seeded_per_replica_with_exponential_up_times():
    schedule = random_failures(4, horizon_s=10_000.0, mtbf_s=500.0, repair_s=50.0, seed=3)
    assert schedule.rows() == random_failures(4, 10_000.0, 500.0, 50.0, seed=3).rows()
    assert schedule.rows() != random_failures(4, 10_000.0, 500.0, 50.0, seed=4).rows()
    # a replica's failures do not depend on the fleet's size
    bigger = random_failures(6, 10_000.0, 500.0, 50.0, seed=3)
    assert [r for r in bigger.rows() if r[0] < 4] == schedule.rows()
    assert np.all(schedule.t_up - schedule.t_down == pytest.approx(50.0))
    assert np.all(schedule.t_down < 10_000.0)
    # up-times: from 0 to the first failure, then from each repair to the next failure
    long = random_failures(1, horizon_s=5e6, mtbf_s=500.0, repair_s=50.0, seed=0)
    up_times = long.t_down - np.r_[0.0, long.t_up[:-1]]
    assert len(up_times) > 5000
    assert up_times.mean() == pytest.approx(500.0, rel=0.05)  # ~9000 draws: standard error ~1%
    assert np.std(up_times) == pytest.approx(500.0, rel=0.05)  # exponential: sd = mean


@pytest.mark.parametrize("kwargs, message", [
    ({"n_replicas": 0}, "n_replicas must be an integer >= 1"),
    ({"mtbf_s": 0.0}, "mtbf_s must be a finite number > 0"),
    ({"repair_s": math.inf}, "repair_s must be a finite number > 0"),
    ({"seed": -1}, "seed must be an integer >= 0"),
])
def test_bad_random_failure_settings_are_named(kwargs, message):
    settings = {"n_replicas": 2, "horizon_s": 100.0, "mtbf_s": 10.0, "repair_s": 1.0, "seed": 0, **kwargs}
    with pytest.raises(FailureError, match=message):
        random_failures(**settings)
