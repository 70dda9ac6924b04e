"""Config names follow one rule (EngineConfig's docstring); each renamed field's old name still
works as a keyword, a YAML key, a CLI flag and an attribute, with a DeprecationWarning naming the
new name, and sets the new field."""

from __future__ import annotations

import argparse
import warnings

import pytest

from cluster.cli import add_cluster_flags, cluster_config
from cluster.config import ClusterConfig
from engine import Engine
from engine.config import EngineConfig
from engine.errors import ConfigError

# A value other than the default for each old name; every renamed field must have one here.
OLD_ENGINE_VALUES = {
    "enable_overlap": True,
    "cpu_graph_lazy": True,
    "seed": 7,
    "speculative_ngram_min": 3,
    "speculative_ngram_max": 6,
}
OLD_CLUSTER_VALUES = {"dp_attention": True}


def test_every_rename_is_covered_and_maps_to_a_field():
    assert set(OLD_ENGINE_VALUES) == set(EngineConfig.renamed_fields)
    assert set(OLD_CLUSTER_VALUES) == set(ClusterConfig.renamed_fields)
    for cls, values in ((EngineConfig, OLD_ENGINE_VALUES), (ClusterConfig, OLD_CLUSTER_VALUES)):
        for old, new in cls.renamed_fields.items():
            assert new in cls.__struct_fields__ and old not in cls.__struct_fields__
            assert getattr(cls(), new) != values[old], f"{old}: pick a value other than the default"


def test_sglang_flag_names_are_kept():
    """SGLang's flags for the settings it has (server_args.py), and the names issue 26 froze."""
    fields = set(EngineConfig.__struct_fields__)
    assert {"disable_radix_cache", "enable_mixed_chunk", "disable_cuda_graph", "cuda_graph_max_bs",
            "enable_overlap_schedule", "random_seed", "speculative_ngram_min_match_window_size",
            "speculative_ngram_max_match_window_size"} <= fields
    assert {"model_path", "max_total_tokens", "max_context_len", "chunked_prefill_size"} <= fields
    assert {"model_path", "num_engines", "enable_dp_attention"} <= set(ClusterConfig.__struct_fields__)


@pytest.mark.parametrize("old", sorted(OLD_ENGINE_VALUES))
def test_old_engine_keyword_warns_and_sets_the_new_field(old):
    new, value = EngineConfig.renamed_fields[old], OLD_ENGINE_VALUES[old]
    for build in (lambda **kw: EngineConfig(**kw), EngineConfig.from_kwargs, EngineConfig().replace):
        with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use {new}") as record:
            cfg = build(**{old: value})
        assert len(record) == 1
        assert getattr(cfg, new) == value
    with pytest.warns(DeprecationWarning, match=f"use {new}"):
        assert getattr(cfg, old) == value  # the old attribute reads the new field


def test_old_cluster_keyword_and_engine_overrides_warn_and_map():
    with pytest.warns(DeprecationWarning, match="dp_attention is deprecated: use enable_dp_attention"):
        assert ClusterConfig(dp_attention=True).enable_dp_attention
    with pytest.warns(DeprecationWarning, match="dp_attention is deprecated"):
        assert ClusterConfig.from_kwargs(dp_attention=True).enable_dp_attention
    with pytest.warns(DeprecationWarning) as record:
        cfg = ClusterConfig.from_kwargs(engine={"enable_overlap": True, "seed": 3})
    assert {str(w.message) for w in record} == {"enable_overlap is deprecated: use enable_overlap_schedule",
                                                "seed is deprecated: use random_seed"}
    # Stored under the new names: the engines build from these without warning again.
    assert cfg.engine == {"enable_overlap_schedule": True, "random_seed": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = cfg.engine_config()
    assert engine.enable_overlap_schedule and engine.random_seed == 3


def test_old_yaml_keys_warn_and_map():
    """The Serve app's args (YAML `args`, `serve run ... key=value`): flat, nested under `engine`,
    and as strings."""
    import yaml

    from deploy.options import AppArgs

    args = yaml.safe_load("""
        dp_attention: true
        num_engines: 2
        enable_overlap: true
        speculative_ngram_max: 6
        engine:
          cpu_graph_lazy: true
    """)
    with pytest.warns(DeprecationWarning) as record:
        app = AppArgs.from_dict(args)
    assert len(record) == 4 and all("is deprecated: use " in str(w.message) for w in record)
    assert app.cluster.enable_dp_attention
    assert app.cluster.engine == {"enable_lazy_cpu_graph": True, "enable_overlap_schedule": True,
                                  "speculative_ngram_max_match_window_size": 6}
    with pytest.warns(DeprecationWarning, match="use random_seed"):
        assert AppArgs.from_dict({"seed": "5"}).cluster.engine == {"random_seed": 5}


def test_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = EngineConfig(enable_overlap_schedule=True, enable_lazy_cpu_graph=True, random_seed=7,
                           speculative_ngram_min_match_window_size=3, speculative_ngram_max_match_window_size=6,
                           cpu_graph_max_bs=8)
        assert cfg.replace(random_seed=1).random_seed == 1
        ClusterConfig(enable_dp_attention=True, engine={"enable_overlap_schedule": True})


def test_old_and_new_name_together_are_refused():
    with pytest.raises(ConfigError, match="give only enable_overlap_schedule"):
        EngineConfig.from_kwargs(enable_overlap=True, enable_overlap_schedule=False)
    with pytest.raises(ConfigError, match="give only enable_dp_attention"):
        ClusterConfig(dp_attention=True, enable_dp_attention=True)


OLD_ARGV = ["--dp-attention", "--enable-overlap", "--cpu-graph-lazy", "--seed", "7",
            "--speculative-ngram-min", "3", "--speculative-ngram-max", "6"]
NEW_ARGV = ["--enable-dp-attention", "--enable-overlap-schedule", "--enable-lazy-cpu-graph", "--random-seed", "7",
            "--speculative-ngram-min-match-window-size", "3", "--speculative-ngram-max-match-window-size", "6"]


def _parse(argv: list[str]) -> ClusterConfig:
    ap = argparse.ArgumentParser()
    fields = add_cluster_flags(ap)
    return cluster_config(ap.parse_args(argv), *fields)


def test_cli_takes_old_and_new_flags_alike():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = _parse(NEW_ARGV)
    with pytest.warns(DeprecationWarning) as record:
        old = _parse(OLD_ARGV)
    assert old == new
    assert new.enable_dp_attention and new.engine == {
        "enable_overlap_schedule": True, "enable_lazy_cpu_graph": True, "random_seed": 7,
        "speculative_ngram_min_match_window_size": 3, "speculative_ngram_max_match_window_size": 6}
    assert sorted(str(w.message) for w in record) == sorted(
        f"{o} is deprecated: use {n}" for o, n in zip(OLD_ARGV, NEW_ARGV) if o.startswith("--"))
    with pytest.raises(SystemExit):  # the old flag parses as the new one does
        _parse(["--seed", "seven"])


def test_serve_cli_keeps_its_names_and_takes_old_flags():
    from cluster.__main__ import serve_parser

    ap, _ = serve_parser()
    help_text = " ".join(ap.format_help().split())
    for flag in ("--model", "--engines", "--host", "--port", "--enable-overlap-schedule"):
        assert flag + " " in help_text
    assert "--enable-overlap deprecated: --enable-overlap-schedule" in help_text
    with pytest.warns(DeprecationWarning, match="--dp-attention is deprecated: use --enable-dp-attention"):
        args = ap.parse_args(["--model", "/m", "--engines", "2", "--host", "0.0.0.0", "--port", "9000",
                              "--dp-attention"])
    assert (args.model_path, args.num_engines, args.host, args.port, args.enable_dp_attention) == \
        ("/m", 2, "0.0.0.0", 9000, True)


def test_cpu_graph_max_bs_sizes_the_cpu_ladder(model_dirs):
    """The CPU graphs' ladder has its own bound; unset, it follows cuda_graph_max_bs as before."""
    path = model_dirs["llama"]
    lazy = dict(model_path=path, cpu_graph="on", enable_lazy_cpu_graph=True)
    assert Engine(**lazy, cpu_graph_max_bs=4, cuda_graph_max_bs=2).model_runner.graph_runner.ladder == [1, 2, 4]
    assert Engine(**lazy, cuda_graph_max_bs=2).model_runner.graph_runner.ladder == [1, 2]
    with pytest.raises(ConfigError, match="cpu_graph_max_bs must be >= 1"):
        EngineConfig(cpu_graph_max_bs=0)


def test_lora_paths_take_sglang_pairs_or_a_json_object():
    pairs = _parse(["--lora-paths", "a=/x/a b=/x/b,c=/x/c"]).engine["lora_paths"]
    assert pairs == {"a": "/x/a", "b": "/x/b", "c": "/x/c"}
    obj = _parse(["--lora-paths", '{"a": {"lora_path": "/x/a", "pinned": true}}']).engine["lora_paths"]
    assert obj == {"a": {"lora_path": "/x/a", "pinned": True}}
    with pytest.raises(SystemExit):  # neither form
        _parse(["--lora-paths", "/x/a"])
