"""Each format loads into the right Trace; bad input names file, row and column."""

import json
import warnings

import numpy as np
import pytest

from studies.formats import detect
from studies.traces import CAP_GIVEN, CAP_NONE, NO_CAP, TraceError, TraceWarning, load_trace
from tests.studies.conftest import write

MOONCAKE = "".join(json.dumps(r) + "\n" for r in [
    {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [0]},
    {"timestamp": 0, "input_length": 700, "output_length": 2, "hash_ids": [0, 2]},
    {"timestamp": 3000, "input_length": 50, "output_length": 0, "hash_ids": [3]},
    {"timestamp": 6000, "input_length": 1, "output_length": 1, "hash_ids": [4]},
])
AZURE_2023 = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
AZURE_2024 = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2024-05-10 00:00:00.009930+00:00,10,2\n2024-05-10 01:00:01.509930+01:00,20,0\n")
BURST = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
         "5,ChatGPT,472,18,490,Conversation log\n6.5,GPT-4,100,0,100,API log\n"
         "7,ChatGPT,10,5,15,API log\n")
NATIVE = ("arrival_s,prompt_tokens,output_tokens,max_tokens,tenant,priority,slo_class,deadline_s,block_hashes\n"
          "0.5,600,3,16,a,2,fast,10,1 2\n1.25,10,0,,b,,,,\n")


def test_mooncake_raw(tmp_path):
    t = load_trace(write(tmp_path, "m.jsonl", MOONCAKE), spread="raw")
    assert t.arrival_s.tolist() == [0, 0, 0, 3, 6]
    assert t.block_offsets.tolist() == [0, 2, 3, 5, 6, 7]
    assert t.block_hashes.tolist() == [0, 1, 0, 0, 2, 3, 4]
    # Mooncake carries no caps: every request is CAP_NONE (NO_CAP), never its true output length
    assert t.block_tokens == 512 and t.max_tokens.tolist() == [NO_CAP] * 5
    assert t.max_tokens_source.tolist() == [CAP_NONE] * 5 and not t.caps_known
    assert t.meta["format"] == "mooncake"


def test_mooncake_uniform_spreads_evenly_within_buckets(tmp_path):
    t = load_trace(write(tmp_path, "m.jsonl", MOONCAKE))  # default: uniform
    np.testing.assert_allclose(t.arrival_s, [0, 1, 2, 3, 6])
    assert t.prompt_tokens.tolist() == [600, 100, 700, 50, 1]  # file order kept within a bucket
    assert t.meta["bucket_s"] == 3.0


def test_mooncake_poisson_is_seeded_and_stays_in_bucket(tmp_path):
    path = write(tmp_path, "m.jsonl", MOONCAKE)
    a, b = load_trace(path, spread="poisson", seed=4), load_trace(path, spread="poisson", seed=4)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    assert not np.array_equal(a.arrival_s, load_trace(path, spread="poisson", seed=5).arrival_s)
    assert np.all((a.arrival_s[:3] >= 0) & (a.arrival_s[:3] < 3)) and np.all(np.diff(a.arrival_s) >= 0)


def test_azure_both_layouts(tmp_path):
    t = load_trace(write(tmp_path, "a.csv", AZURE_2023))
    np.testing.assert_allclose(t.arrival_s, [0, 4.314579])
    assert t.meta["start_time"] == "2023-11-16 18:15:46.680590" and t.block_offsets[-1] == 0
    t = load_trace(write(tmp_path, "b.csv", AZURE_2024))
    np.testing.assert_allclose(t.arrival_s, [0, 1.5])  # 01:00:01.5 at +01:00 is 00:00:01.5 UTC
    assert t.output_tokens.tolist() == [2, 0]


def test_burstgpt_keeps_failures_and_counts_filters(tmp_path):
    path = write(tmp_path, "b.csv", BURST)
    t = load_trace(path)
    assert t.output_tokens.tolist() == [18, 0, 5] and t.meta["zero_output_rows"] == 1
    assert t.arrival_s.tolist() == [5, 6.5, 7]
    t = load_trace(path, model="ChatGPT", tenants="log_type")
    assert t.n == 2 and t.meta["filtered_rows"] == 1 and t.meta["filters"] == {"model": 1}
    assert list(t.tenant_labels) == ["Conversation log", "API log"]
    with pytest.raises(TraceError, match=r"no rows with \['Claude'\]; values present: \['ChatGPT', 'GPT-4'\]"):
        load_trace(path, model="Claude")


def test_native_csv_fields_and_defaults(tmp_path):
    t = load_trace(write(tmp_path, "n.csv", NATIVE))
    assert t.max_tokens.tolist() == [16, NO_CAP] and t.priority.tolist() == [2, 0]  # empty cap: none given
    assert t.max_tokens_source.tolist() == [CAP_GIVEN, CAP_NONE]
    assert list(t.tenant_labels) == ["a", "b"] and list(t.slo_class_labels) == ["fast", "default"]
    assert t.deadline_s[0] == 10 and np.isnan(t.deadline_s[1])
    assert t.block_hashes.tolist() == [1, 2] and t.block_offsets.tolist() == [0, 2, 2]


def test_detection_by_content_not_name(tmp_path):
    assert detect(write(tmp_path, "x.txt", MOONCAKE)) == "mooncake"
    assert detect(write(tmp_path, "y.jsonl", AZURE_2023)) == "azure"
    assert detect(write(tmp_path, "z", BURST)) == "burstgpt"
    assert detect(write(tmp_path, "w", NATIVE)) == "native"


def test_zero_prompt_rows_error_unless_dropped(tmp_path):
    path = write(tmp_path, "a.csv", AZURE_2023 + "2023-11-16 18:15:52.0,0,5\n")
    with pytest.raises(TraceError, match=r"row 3 \(line 4\), column 'ContextTokens': got '0'.*drop_zero_prompt"):
        load_trace(path)
    t = load_trace(path, drop_zero_prompt=True)
    assert t.n == 2 and t.meta["filtered_rows"] == 1 and t.meta["filters"] == {"zero_prompt": 1}


def test_unsorted_rows_sorted_with_warning_or_error_when_strict(tmp_path):
    path = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:00:05,1,1\n2023-11-16 18:00:00,2,2\n2023-11-16 18:00:09,3,3\n")
    with pytest.warns(TraceWarning, match=r"a.csv: row 2 \(line 3\), column 'TIMESTAMP'.*sorted by arrival"):
        t = load_trace(path)
    assert t.prompt_tokens.tolist() == [2, 1, 3] and t.arrival_s.tolist() == [0, 5, 9]
    assert t.meta["resorted_rows"] == 1
    with pytest.raises(TraceError, match=r"row 2 \(line 3\), column 'TIMESTAMP'.*sorted by time"):
        load_trace(path, strict=True)


def test_unsorted_mooncake_keeps_blocks_with_requests(tmp_path):
    text = "".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 5000, "input_length": 10, "output_length": 1, "hash_ids": [7]},
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [8, 9]}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)
        t = load_trace(write(tmp_path, "m.jsonl", text), spread="raw")
    assert t.prompt_tokens.tolist() == [600, 10] and t.block_hashes.tolist() == [8, 9, 7]


BAD = [
    ("a.csv", AZURE_2023 + "2023-11-16 18:15:52.0,x,5\n", r"a.csv: row 3 \(line 4\), column 'ContextTokens': got 'x'"),
    ("a.csv", AZURE_2023 + "yesterday,3,5\n", r"row 3 \(line 4\), column 'TIMESTAMP': got 'yesterday'; expected a date-time"),
    ("a.csv", AZURE_2023 + "2023-11-16 18:15:52.0,3,-5\n", r"row 3 \(line 4\), column 'GeneratedTokens': got '-5'"),
    ("a.csv", AZURE_2023 + "2023-11-16 18:15:52.0,3,5,9\n", r"a.csv: line 4: 4 fields; expected 3"),
    ("a.csv", AZURE_2023 + "2023-11-16 18:15:52.0,3\n", r"row 3 \(line 4\), column 'GeneratedTokens': got nothing"),
    ("a.csv", "TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:15:52.0,3,4\n", r"missing column\(s\) \['ContextTokens'\]"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", "has a header but no rows"),
    ("e.csv", "", "e.csv: the file is empty"),
    ("u.csv", "foo,bar\n1,2\n", "unknown trace format"),
    ("b.csv", BURST + "8,ChatGPT,10,1.5,11,API log\n", r"row 4 \(line 5\), column 'Response tokens': got '1.5'; expected an integer"),
    ("b.csv", BURST + "nan,ChatGPT,10,1,11,API log\n", r"row 4 \(line 5\), column 'Timestamp': got 'nan'; expected a finite time"),
    ("m.jsonl", MOONCAKE + '{"timestamp": 9000, "input_length": "many", "output_length": 1}\n',
     r"m.jsonl: row 6 \(line 6\), column 'input_length': got 'many'; expected an integer"),
    ("m.jsonl", MOONCAKE + '{"timestamp": 9000, "output_length": 1}\n', r"row 6 \(line 6\), column 'input_length': got nothing"),
    ("m.jsonl", MOONCAKE + '{"timestamp": 9000, "input_length": 5,\n', r"row 6 \(line 6\), character \d+: not valid JSON"),
    ("m.jsonl", MOONCAKE + '{"timestamp": NaN, "input_length": 5, "output_length": 1}\n', r"row 6 \(line 6\), column 'timestamp': got nan"),
    ("m.jsonl", MOONCAKE + '{"timestamp": -1, "input_length": 5, "output_length": 1}\n', r"row 6 \(line 6\), column 'timestamp': got -1.0; expected a finite time >= 0"),
    ("m.jsonl", MOONCAKE + '{"timestamp": 9000, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}\n',
     r"row 6 \(line 6\), column 'hash_ids': got \[1, 2\]; expected at most ceil"),
    ("m.jsonl", MOONCAKE + '{"timestamp": 9000, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}\n',
     r"row 6 \(line 6\), column 'hash_ids': got \['a'\]"),
    ("n.csv", NATIVE + "2,5,1,,a,,,1,\n", r"row 3 \(line 4\), column 'deadline_s': got '1'; expected a time >= arrival_s"),
    ("n.csv", NATIVE + "2,5,1,,a,,,,3 x\n", r"row 3 \(line 4\), column 'block_hashes': got '3 x'"),
    ("n.csv", NATIVE.replace("tenant,", "tenants,"), r"unknown column\(s\) \['tenants'\]"),
    ("n.jsonl", '{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1, "tenantt": "a"}\n', r"line 1: unknown key\(s\) \['tenantt'\]"),
]


@pytest.mark.parametrize("name, text, message", BAD)
def test_bad_input_names_file_row_and_column(tmp_path, name, text, message):
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, name, text))


def test_blank_lines_are_not_requests(tmp_path):
    t = load_trace(write(tmp_path, "a.csv", AZURE_2023.replace("44\n", "44\n\n") + "\n"))
    assert t.n == 2
    with pytest.raises(TraceError, match=r"row 2 \(line 3\), column 'input_length'"):
        load_trace(write(tmp_path, "m.jsonl", MOONCAKE.split("\n")[0] + '\n\n{"timestamp": 1, "input_length": "x"}\n'))


def test_bad_options_and_formats(tmp_path):
    path = write(tmp_path, "m.jsonl", MOONCAKE)
    with pytest.raises(TraceError, match=r"take no option\(s\) \['model'\]; valid: \['spread'"):
        load_trace(path, model="x")
    with pytest.raises(TraceError, match="option spread='even'"):
        load_trace(path, spread="even")
    with pytest.raises(TraceError, match="unknown trace format 'sharegpt'"):
        load_trace(path, "sharegpt")
    with pytest.raises(TraceError, match="missing column"):
        load_trace(path, "azure")
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.csv")


def test_constant_max_tokens_option(tmp_path):
    t = load_trace(write(tmp_path, "a.csv", AZURE_2023), max_tokens=64)
    assert t.max_tokens.tolist() == [64, 64] and t.output_tokens.tolist() == [44, 109]


def test_native_explicit_zero_max_tokens_is_an_error(tmp_path):
    with pytest.raises(TraceError, match=r"row 3 \(line 4\), column 'max_tokens': got '0'"):
        load_trace(write(tmp_path, "n.csv", NATIVE + "2,5,1,0,a,,,,\n"))
