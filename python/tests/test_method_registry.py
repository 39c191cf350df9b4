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


def test_eval_variants_are_rows_of_their_method():
    listed = []
    for name in kvslim.methods():
        for v in kvslim.method_info(name)["variants"]:
            listed.append(v["name"])
            cfg = kvslim.Config.from_spec(name + ("@" + v["settings"] if v["settings"] else ""))
            assert cfg.method == name
            assert v["composed"] == (cfg.storage != "fp16")
            assert v["eval_only"] == (v["recent_window_fraction"] != 0 or v["reconstruction_weight"] != 0
                                      or v["prefill_full_prompt"])
            if not v["eval_only"]:
                assert kvslim.Config.from_spec(v["name"]) == cfg  # the variant's name is a spec
            else:
                with pytest.raises(kvslim.ConfigError, match="kvslim eval"):
                    kvslim.Config.from_spec(v["name"])
    assert sorted(kvslim.variants()) == sorted(listed)
    assert len(set(listed)) == len(listed)


def test_config_from_spec():
    assert kvslim.Config.from_spec("kivi4") == kvslim.Config(method="kivi", kivi_bits=4, kivi_group_size=32)
    assert kvslim.Config(method="kivi").kivi_bits == -1  # the default: keys at 4 bits, values at 2, groups of 128
    assert kvslim.Config.from_spec("kivi@kivi_bits=4,kivi_group_size=64").kivi_group_size == 64
    assert kvslim.Config.from_spec("h2o+kivi3_g64").storage == "kivi"
    with pytest.raises(kvslim.ConfigError, match="unknown method"):
        kvslim.Config.from_spec("kivo")
