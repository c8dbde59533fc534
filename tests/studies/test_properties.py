"""Property tests over generated files: valid ones load the same every time and hold what
was written; corrupting one cell gives a TraceError naming that row and column, never a
polars exception."""

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from studies.traces import TraceError, load_trace

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

rows = st.lists(
    st.tuples(st.integers(0, 10**7), st.integers(1, 200_000), st.integers(0, 5000), st.integers(0, 50)),
    min_size=1, max_size=30,
)
garbage = st.sampled_from(["abc", "-3", "1.5", "", "nan", "1e400", "[1]", "--"])


def mooncake_text(records) -> str:
    lines, next_id = [], 0
    for ms, prompt, output, _ in sorted(records):
        blocks = -(-prompt // 512)
        lines.append(json.dumps({"timestamp": ms, "input_length": prompt, "output_length": output,
                                 "hash_ids": list(range(next_id, next_id + blocks))}))
        next_id += blocks // 2 + 1  # overlapping ids: shared prefixes
    return "\n".join(lines) + "\n"


def native_csv(records) -> str:
    body = "".join(f"{ms / 1000},{p},{o},{o + extra + 1},t{extra % 3},{extra - 25},,\n"
                   for ms, p, o, extra in sorted(records))
    return "arrival_s,prompt_tokens,output_tokens,max_tokens,tenant,priority,slo_class,deadline_s\n" + body


@SETTINGS
@given(records=rows)
def test_valid_mooncake_loads_identically_twice(tmp_path, records):
    path = tmp_path / "m.jsonl"
    path.write_text(mooncake_text(records))
    a, b = load_trace(path, spread="raw"), load_trace(path, spread="raw")
    for column in ("arrival_s", "prompt_tokens", "output_tokens", "block_offsets", "block_hashes"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column))
    assert sorted(a.prompt_tokens.tolist()) == sorted(p for _, p, _, _ in records)
    assert a.block_offsets[-1] == sum(-(-p // 512) for _, p, _, _ in records)


@SETTINGS
@given(records=rows)
def test_valid_native_csv_loads_what_was_written(tmp_path, records):
    path = tmp_path / "n.csv"
    path.write_text(native_csv(records))
    t = load_trace(path)
    expected = sorted(records)
    assert t.output_tokens.tolist() == [o for _, _, o, _ in expected]
    assert t.max_tokens.tolist() == [o + e + 1 for _, _, o, e in expected]
    assert list(t.tenant_labels) == [f"t{e % 3}" for *_, e in expected]
    assert np.array_equal(t.arrival_s, load_trace(path).arrival_s)


@SETTINGS
@given(records=rows, data=st.data(), bad=garbage)
def test_corrupted_native_csv_names_row_and_column(tmp_path, records, data, bad):
    lines = native_csv(records).splitlines()
    row = data.draw(st.integers(1, len(lines) - 1), label="row")
    column = data.draw(st.sampled_from([0, 1, 2]), label="column")  # arrival_s, prompt_tokens, output_tokens
    name = ("arrival_s", "prompt_tokens", "output_tokens")[column]
    if name == "arrival_s" and bad == "1.5":
        bad = "soon"  # 1.5 is a fine time
    cells = lines[row].split(",")
    cells[column] = bad
    lines[row] = ",".join(cells)
    path = tmp_path / "n.csv"
    path.write_text("\n".join(lines) + "\n")
    try:
        load_trace(path)
    except TraceError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{bad!r} in {name} loaded")
    assert str(path) in message and f"row {row} (line {row + 1})" in message and repr(name) in message


@SETTINGS
@given(records=rows, data=st.data(), bad=st.sampled_from(['"x"', "-4", "2.5", "null", "[1]", "{}", "true"]))
def test_corrupted_mooncake_names_row_and_column(tmp_path, records, data, bad):
    lines = mooncake_text(records).splitlines()
    row = data.draw(st.integers(0, len(lines) - 1), label="row")
    key = data.draw(st.sampled_from(["input_length", "output_length"]), label="key")
    record = json.loads(lines[row])
    lines[row] = json.dumps(record).replace(f'"{key}": {record[key]}', f'"{key}": {bad}')
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    try:
        load_trace(path, spread="raw")
    except TraceError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{bad} in {key} loaded")
    assert f"row {row + 1} (line {row + 1})" in message and repr(key) in message


@SETTINGS
@given(text=st.text(max_size=200))
def test_arbitrary_text_never_leaks_a_polars_error(tmp_path, text):
    path = tmp_path / "x.csv"
    path.write_text(text)
    try:
        load_trace(path)
    except TraceError as exc:
        assert str(path) in str(exc)
