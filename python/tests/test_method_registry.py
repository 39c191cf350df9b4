"""The library's method registry from Python (kvslim/methods.h): kvslim.methods(),
kvslim.method_info(), kvslim.storages() read the one table."""
import pytest

import kvslim


def test_every_method_has_a_row():
    for name in kvslim.methods():
        info = kvslim.method_info(name)
        assert info["name"] == name
        assert info["kind"] in ("dense", "eviction", "quantizer")
        if info["kind"] == "eviction":
            assert info["budget_field"] == name + "_budget"
            assert info["sink_field"] == name + "_n_sink"
            assert info["budget_field"] in info["fields"]
        else:
            assert info["budget_field"] is None
        assert set(info["fields"]) <= set(kvslim.Config().fields())  # Config fields, by name


def test_storages_are_fp16_and_the_quantizers():
    quantizers = [m for m in kvslim.methods() if kvslim.method_info(m)["kind"] == "quantizer"]
    assert kvslim.storages() == ["fp16"] + quantizers


def test_unknown_method_raises_config_error():
    with pytest.raises(kvslim.ConfigError, match="must be one of"):
        kvslim.method_info("kivo")
