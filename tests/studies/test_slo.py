"""SLO strings and files parse as vllm bench serve --goodput does; bad ones name the part."""

import math

import pytest

from studies.slo import SLOClass, SLOError, SLOSet, load_slo_toml, parse_slo


def test_vllm_style_string():
    slos = parse_slo("ttft:2000,tpot:100,e2el:30000")
    (cls,) = slos.classes
    assert (cls.ttft_ms, cls.tpot_ms, cls.e2el_ms, cls.weight) == (2000, 100, 30000, 1.0)
    assert parse_slo("ttft:2000 tpot:100").classes[0].bounds_ms == (2000.0, 100.0, math.inf)


@pytest.mark.parametrize(
    "text, message",
    [("ttft=2000", "expected KEY:MS"), ("itl:5", "expected KEY:MS"), ("ttft:fast", "not a number"),
     ("ttft:1,ttft:2", "given twice"), ("", "no bounds"), ("tpot:-1", "must be a finite number of ms > 0"),
     ("ttft:0", "must be a finite number of ms > 0")],
)
def test_bad_strings(text, message):
    with pytest.raises(SLOError, match=message):
        parse_slo(text)


def test_toml_classes_and_lookup(tmp_path):
    path = tmp_path / "slo.toml"
    path.write_text('[slo.chat]\nttft = 500\ntpot = 50\nweight = 2\n[slo.default]\ne2el = 60000\n')
    slos = load_slo_toml(path)
    assert slos.lookup("chat").weight == 2 and slos.lookup("chat").ttft_ms == 500
    assert slos.lookup("batch").name == "default"  # unknown trace classes fall back to default
    assert slos.has_bounds


def test_toml_unknown_key_and_missing_default(tmp_path):
    path = tmp_path / "slo.toml"
    path.write_text("[slo.chat]\nttfb = 500\n")
    with pytest.raises(SLOError, match="unknown key"):
        load_slo_toml(path)
    with pytest.raises(SLOError, match="no 'default' class"):
        SLOSet((SLOClass("chat", ttft_ms=1),)).lookup("batch")


def test_weights_names_and_descriptions():
    slos = parse_slo("tpot:50", name="chat", weight=3)
    (cls,) = slos.classes
    assert cls.name == "chat" and cls.weight == 3 and cls.ttft_ms is None
    assert cls.describe() == "tpot:50" and slos.describe() == "chat: tpot:50 (w=3)"
    assert not SLOSet().has_bounds


def test_toml_top_level_tables_and_bad_toml(tmp_path):
    path = tmp_path / "slo.toml"
    path.write_text("[default]\nttft = 2000\n")
    assert load_slo_toml(path).lookup("anything").ttft_ms == 2000
    path.write_text("[slo.chat\nttft = 1\n")
    with pytest.raises(SLOError, match="not valid TOML"):
        load_slo_toml(path)
    path.write_text("[slo]\nchat = 5\n")
    with pytest.raises(SLOError, match="must be a table"):
        load_slo_toml(path)


def test_duplicate_classes_and_bad_weight():
    with pytest.raises(SLOError, match="duplicate"):
        SLOSet((SLOClass("a"), SLOClass("a")))
    with pytest.raises(SLOError, match="weight must be >= 0"):
        SLOClass("a", weight=-1)
